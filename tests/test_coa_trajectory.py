"""The Trajectory type (JSON round trip, field errors) and the task prompts."""

import json

import pytest

from afm_core.coa.prompts import TASK_PROMPTS, TASKS, split_user_prompt, task_of_prompt, user_prompt
from afm_core.coa.trajectory import Step, Trajectory


def make():
    return Trajectory(
        id="gsm8k:train:1",
        task="math",
        question="What is 2+2?",
        prompt=user_prompt("math", "What is 2+2?"),
        steps=[Step("code", "```py\nprint(2+2)\n```"), Step("observation", "4"), Step("answer", "\\boxed{4}")],
        answer="4",
        correct=True,
        source="gsm8k",
        source_id="train:1",
        meta={"file": "train.jsonl"},
    )


def test_json_round_trip():
    trajectory = make()
    data = json.loads(json.dumps(trajectory.to_dict()))
    assert Trajectory.from_dict(data) == trajectory
    assert trajectory.num_tool_calls == 1
    assert trajectory.final_answer == "\\boxed{4}"


def test_step_checks():
    assert Step("think", "  x \n").content == "x"
    assert Step("wiki_search", "q").kind == "tool"
    with pytest.raises(ValueError, match="unknown CoA tag 'search'"):
        Step("search", "q")


def test_from_dict_names_missing_field():
    data = make().to_dict()
    del data["steps"][1]["content"]
    with pytest.raises(ValueError, match=r"steps\[1\]: step: missing field 'content'"):
        Trajectory.from_dict(data)
    data = make().to_dict()
    del data["question"]
    with pytest.raises(ValueError, match="missing field 'question'"):
        Trajectory.from_dict(data)
    with pytest.raises(ValueError, match="unknown task 'chat'"):
        Trajectory.from_dict({**make().to_dict(), "task": "chat"})


def test_prompts():
    for task in TASKS:
        prompt = user_prompt(task, "  Who?  ")
        assert prompt.endswith("\n\nQuestion: Who?")
        assert split_user_prompt(prompt) == (TASK_PROMPTS[task].strip(), "Who?")
        assert task_of_prompt(prompt) == task
    assert "<wiki_search>" in TASK_PROMPTS["mhqa"] and "<double_check>" in TASK_PROMPTS["web"]
    assert "\\boxed{" in TASK_PROMPTS["math"] and "```py" in TASK_PROMPTS["code"]
    assert task_of_prompt("Some other prompt\n\nQuestion: x") is None
    assert split_user_prompt("just a question") == ("", "just a question")
    with pytest.raises(ValueError, match="unknown task"):
        user_prompt("chat", "x")
