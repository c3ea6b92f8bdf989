"""Plug-ins by ``_target_`` (afm_core.utils.plugins): the worked example's reward function and tool
(examples/plugins/my_plugins.py), given as a file path or a dotted path, graded and called through the same
Graders and ToolPool as the built-in ones; bad targets are refused naming the key."""

from __future__ import annotations

import asyncio

import pytest

from afm_core.rewards import Graders
from afm_core.rewards.grader import custom_reward
from afm_core.tools.registry import build_tool_pool
from afm_core.utils.paths import repo_root
from afm_core.utils.plugins import PluginError

EXAMPLE = repo_root() / "examples" / "plugins" / "my_plugins.py"
GOOD = "<think>2+2</think>\n<answer>\\boxed{4}</answer>"
WRONG = "<think>2+3</think>\n<answer>\\boxed{5}</answer>"


@pytest.mark.parametrize("target", [f"{EXAMPLE}:partial_credit", "examples.plugins.my_plugins.partial_credit"])
def test_a_plugged_in_reward_grades_every_task_with_its_bound_arguments(target):
    graders = Graders(custom=custom_reward({"_target_": target, "format_bonus": 0.25}))

    def grade(response: str, kind: str = "qa"):
        return asyncio.run(graders.grade(kind, response, gold="4", question="2+2?", meta={"data_source": "x"}))

    assert (grade(GOOD).score, grade(GOOD).reason) == (1.0, "correct")
    assert (grade(WRONG).score, grade(WRONG).reason) == (0.25, "format_only")
    assert grade("no tags at all").score == 0.0


def test_a_reward_plugin_that_raises_or_returns_junk_is_a_grader_error_not_a_crash(tmp_path):
    plugin = tmp_path / "bad.py"
    plugin.write_text(
        "def boom(response, **kw):\n    raise KeyError('gold')\n\ndef junk(response, **kw):\n    return 'yes'\n"
    )
    boom = asyncio.run(Graders(custom=custom_reward({"_target_": f"{plugin}:boom"})).grade("math", "x", gold="1"))
    assert boom.error and boom.extra == {"message": "KeyError: 'gold'"}
    junk = asyncio.run(Graders(custom=custom_reward({"_target_": f"{plugin}:junk"})).grade("math", "x", gold="1"))
    assert junk.error and "returned 'yes'" in junk.extra["message"]


def test_bad_targets_are_refused_naming_the_key(tmp_path):
    with pytest.raises(PluginError, match=r"reward_fn._target_: no file .*nope.py"):
        custom_reward({"_target_": f"{tmp_path}/nope.py:score"})
    with pytest.raises(PluginError, match=r"reward_fn: Error locating target 'examples.plugins.my_plugins.nope'"):
        custom_reward({"_target_": "examples.plugins.my_plugins.nope"})
    with pytest.raises(ValueError, match=r"tools\.calculator: a plug-in tool serves one of the CoA tool tags"):
        build_tool_pool({"tools": {"calculator": {"_target_": "x.Y"}}}, addresses={})
    with pytest.raises(
        ValueError, match=r"tools\.code\._target_: built .*expected an afm_core.tools.Tool whose name is 'code'"
    ):
        build_tool_pool({"tools": {"code": {"_target_": f"{EXAMPLE}:GlossarySearch"}}}, addresses={})


def test_a_plugged_in_tool_answers_its_coa_tag_through_the_tool_pool_with_limits_and_the_duplicate_guard():
    pool = build_tool_pool({"tools": {"wiki_search": {"_target_": "examples.plugins.my_plugins.GlossarySearch",
                                                      "topk": 1, "limits": {"timeout_s": 5}}}}, addresses={})  # fmt: skip

    async def calls():
        async with pool:
            first = await pool.call("wiki_search", "what do mitochondria do?", trajectory_id="t1")
            again = await pool.call("wiki_search", "what do mitochondria do?", trajectory_id="t1")
            empty = await pool.call("wiki_search", "  ", trajectory_id="t1")
        return first, again, empty

    first, again, empty = asyncio.run(calls())
    assert first == "Doc 1 (Title: mitochondria)\nThe organelles that make a cell's ATP."
    assert again == "I have searched for this before; I should try another query."
    assert "empty search query" in empty
    assert pool.limits["wiki_search"].timeout_s == 5 and pool.metrics["wiki_search"].calls >= 1


def test_a_plugged_in_tool_without_a_server_starts_no_server_and_stays_in_the_reachable_tools():
    from afm_core.tools.job_servers import needed_servers, reachable_tools_cfg

    plugin = {"_target_": "examples.plugins.my_plugins.GlossarySearch"}
    builtin = {"server": "wiki", "topk": 3}
    assert needed_servers({"mhqa"}, {"qa"}, {"tools": {"wiki_search": builtin}}) == ["wiki"]
    assert needed_servers({"mhqa"}, {"qa"}, {"tools": {"wiki_search": plugin}}) == []
    assert needed_servers({"mhqa"}, {"qa"}, {"tools": {"wiki_search": {**plugin, "server": "wiki"}}}) == ["wiki"]
    assert reachable_tools_cfg({"tools": {"wiki_search": plugin, "code": {"server": "sandbox"}}}, {})["tools"] == {
        "wiki_search": plugin
    }


def test_the_agent_loop_calls_the_plugged_in_tool_and_the_plugged_in_reward_grades_the_trajectory():
    from afm_core.coa.prompts import user_prompt
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rollout import AgentConfig, AgentLoop, AgentTask, SamplingConfig
    from afm_core.rollout.factory import load_tokenizer
    from tests.rollout.replay import ReplayEngine

    tokenizer = load_tokenizer(ensure_hf_checkpoint("tiny-llama"))
    engine = ReplayEngine(tokenizer, ["<think>Look it up.</think>\n<wiki_search>mitochondria</wiki_search>",
                                      "<think>ATP.</think>\n<answer>\\boxed{ATP}</answer>"])  # fmt: skip
    pool = build_tool_pool({"tools": {"wiki_search": {"_target_": f"{EXAMPLE}:GlossarySearch"}}}, addresses={})
    graders = Graders(custom=custom_reward({"_target_": "examples.plugins.my_plugins.partial_credit"}))
    task = AgentTask("q:0", "mhqa", user_prompt("mhqa", "What do mitochondria make?"), "What do mitochondria make?",
                     "ATP")  # fmt: skip

    async def run():
        async with pool:
            rollout = await AgentLoop(engine, tokenizer, pool, AgentConfig(), SamplingConfig(max_tokens=256)).run(task)
        return rollout, await graders.grade("qa", rollout.response_text, gold="ATP", question=task.question)

    rollout, grade = asyncio.run(run())
    assert [c.name for c in rollout.tool_calls] == ["wiki_search"] and not rollout.tool_calls[0].error
    assert (
        "<observation>\nDoc 1 (Title: mitochondria)\nThe organelles that make a cell's ATP.\n</observation>"
        in rollout.response_text
    )
    assert (grade.score, grade.reason) == (1.0, "correct")
