"""The converter on hand-made MAS run records: role outputs become role blocks, tool-agent calls become tool
tags with observations, the result passes the CoA validator, and what a weak teacher gets wrong is repaired and
counted, or not converted at all; the role parsers read loose replies."""

from __future__ import annotations

import pytest

from afm_core.coa.grammar import validate_steps
from afm_core.coa.prompts import user_prompt
from afm_core.coa.render import render_response
from afm_core.distill import roles
from afm_core.distill.convert import NotConverted, convert_run, convert_runs


def role(role_name, kind, output, **parsed):
    return {"role": role_name, "kind": kind, "teacher": "main", "messages": [{"role": "user", "content": "..."}],
            "output": output, "finish_reason": "stop", "prompt_tokens": 9, "completion_tokens": 3, "seconds": 0.1,
            "error": None, **parsed}  # fmt: skip


def tool(name, query, observation):
    return {"role": "tool", "kind": "tool_call", "tool": name, "query": query, "observation": observation,
            "seconds": 0.2, "error": None}  # fmt: skip


def record(events, final="Paris", task="mhqa", grade=None):
    return {"record_version": 1, "benchmark": "hotpotqa500", "problem_id": "7", "sample": 0,
            "task": {"id": "hotpotqa500:7", "task": task, "prompt": "p", "question": "Capital of France?",
                     "answer": "Paris", "system": None, "meta": {"grader": "qa", "benchmark": "hotpotqa500"}},
            "events": events, "final_answer": final, "finish": "answer" if final else "no_answer", "replans": 1,
            "tool_calls": 2, "seconds": 3.0, "grade": grade}  # fmt: skip


FULL_RUN = [
    role("planner", "plan", "1. Search the capital.\n2. Check it.", plan_steps=["Search the capital.", "Check it."]),
    role("thinker", "think", "I need the capital.\nNEXT: wiki_search", next="wiki_search"),
    role("search", "tool_input", "capital of France", tool="wiki_search", query="capital of France"),
    tool("wiki_search", "capital of France", "Doc 1 (Title: Paris)\nParis is the capital."),
    role("reflection", "reflection", "Information conflict: good\nTool effectiveness: good"),
    role("thinker", "suggest", "Answer: Lyon", answer="Lyon"),
    role("verifier", "double_check", "Score: 1. The passage says Paris.", score=1),
    role("planner", "plan", "1. Search again."),
    role("thinker", "think", "NEXT: wiki_search", next="wiki_search"),  # only a NEXT line: no <think>
    role("search", "tool_input", "", tool="wiki_search", query=""),  # the agent wrote nothing: no call
    role("thinker", "think", "Search once more.\nNEXT: wiki_search", next="wiki_search"),
    role("search", "tool_input", "<wiki_search>Paris</wiki_search>", tool="wiki_search", query="Paris"),
    tool("wiki_search", "Paris", "Paris <observation>is</observation> the capital."),
    role("thinker", "suggest", "Paris", answer="Paris"),
    role("verifier", "double_check", "Score: 4 <answer>sure</answer>", score=4),
]


def test_role_outputs_and_tool_calls_become_the_canonical_blocks():
    grade = {"grader": "qa", "score": 1.0, "reason": "correct", "error": False, "correct": True, "f1": 1.0}
    trajectory = convert_run(record(FULL_RUN, grade=grade))
    assert [s.tag for s in trajectory.steps] == [
        "plan", "think", "wiki_search", "observation", "reflection", "suggested_answer", "double_check",
        "plan", "think", "wiki_search", "observation", "suggested_answer", "double_check", "answer",
    ]  # fmt: skip
    assert validate_steps(trajectory.steps) == []
    contents = [s.content for s in trajectory.steps]
    assert contents[1] == "I need the capital." and contents[5] == "Lyon" and contents[-1] == "Paris"
    assert contents[10] == "Paris is the capital." and contents[12] == "Score: 4 sure"
    assert trajectory.meta["format_repairs"] == {"tags_in_double_check": 2}
    assert trajectory.id == "distill:hotpotqa500:7#0" and trajectory.source == "distill"
    assert trajectory.prompt == user_prompt("mhqa", "Capital of France?") and trajectory.answer == "Paris"
    assert trajectory.correct is True and trajectory.meta["grade"] == grade and trajectory.meta["grader"] == "qa"
    assert render_response(trajectory.steps).endswith("<answer>\nParis\n</answer>")


def test_without_verification_blocks_and_without_answer():
    plain = convert_run(record(FULL_RUN), verification=False)
    assert "suggested_answer" not in {s.tag for s in plain.steps} and "double_check" not in {s.tag for s in plain.steps}
    assert validate_steps(plain.steps) == [] and plain.correct is None
    with pytest.raises(NotConverted, match="no_answer"):
        convert_run(record(FULL_RUN, final=None))
    failed = [dict(e, error="HTTP 500") if e["role"] == "planner" else e for e in FULL_RUN]
    assert "plan" not in {s.tag for s in convert_run(record(failed)).steps}  # a failed call says nothing
    trajectories, skipped = convert_runs([record(FULL_RUN), record(FULL_RUN, final="")])
    assert len(trajectories) == 1 and dict(skipped) == {"no_answer": 1}


def test_role_parsers_read_loose_replies():
    tools = ("wiki_search",)
    assert roles.next_action("think more\nNEXT: wiki_search", tools) == "wiki_search"
    assert roles.next_action("Next = Search", tools) == "wiki_search"  # the agent's name
    assert roles.next_action("NEXT: answer", tools) == "answer"
    assert roles.next_action("NEXT: browse", tools) is None and roles.next_action("no action", tools) is None
    assert roles.plan_steps("1. a\n2) b\n- c") == ["a", "b", "c"] and roles.plan_steps("just do it") == ["just do it"]
    assert roles.tool_input("wiki_search", 'Query: "Eiffel tower height"\nmore') == "Eiffel tower height"
    assert roles.tool_input("wiki_search", "<wiki_search>Louvre</wiki_search>") == "Louvre"
    assert roles.tool_input("code", "Run this:\n```python\nprint(2+2)\n```") == "```py\nprint(2+2)\n```"
    assert (
        roles.tool_input("crawl_page", "see https://a.org/x and https://b.org/y.")
        == "https://a.org/x | https://b.org/y"
    )
    assert roles.tool_input("crawl_page", "none") == ""
    assert roles.reflection_ratings("Information conflict: Good. Tool effectiveness - poor") == {
        "information_conflict": "good", "tool_effectiveness": "poor", "trajectory_monitoring": None}  # fmt: skip
    assert roles.verifier_score("I checked 3 sources. Score: 2") == 2 and roles.verifier_score("4/4") == 4
    assert roles.verifier_score("no idea") is None
    assert roles.suggested_answer("<answer>Final answer: \\boxed{5}</answer>") == "\\boxed{5}"
