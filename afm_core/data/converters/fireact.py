"""FireAct ReAct traces -> CoA trajectories (task ``mhqa``).

Source: anchen1011/FireAct ``data/finetune/gpt_format/*.jsonl`` (GPT-4 ReAct trajectories on HotpotQA,
StrategyQA, MMLU...). Each record is ``{"messages": [user question, assistant "Thought: ...\\nAction:
search[...]", user "Observation: ...", ..., assistant "...Action: finish[answer]", user "Observation:
Episode finished, reward = True"]}``.

Mapping: ``Thought`` -> ``<think>``; ``search[q]`` and ``lookup[q]`` -> ``<wiki_search>q`` (ReAct's
Wikipedia API; lookup searches within the last page, the nearest CoA tool is a search);
``Observation`` -> ``<observation>``; ``finish[a]`` -> ``<answer>a``. The environment's reward after
``finish`` is the correctness verdict (its exact match with the gold answer, which the files do not
hold): a falsy reward is rejected as ``wrong_answer``.

Rejection reasons: ``missing_action``, ``unknown_action``, ``empty_tool_call``, ``no_finish``,
``no_reward``, ``wrong_answer``, ``bad_turn_order``.
"""

from __future__ import annotations

import re
from typing import Any

from afm_core.coa.trajectory import Step, Trajectory
from afm_core.data.converters.base import Converter, Rejected, kept_trajectory
from afm_core.data.io import Where, require

_ACTION_RE = re.compile(r"Action:\s*(\w+)\[(.*)\]\s*$", re.DOTALL)
_REWARD_RE = re.compile(r"Episode finished, reward\s*=\s*(\S+)")
_TOOL_ACTIONS = {"search": "wiki_search", "lookup": "wiki_search"}


def _strip_prefix(text: str, prefix: str) -> str:
    text = text.strip()
    return text[len(prefix) :].strip() if text.startswith(prefix) else text


def _messages(where: Where, record: dict[str, Any]) -> list[tuple[str, str]]:
    messages = require(record, "messages", list, where)
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise where.error(f"messages[{i}] must be an object, got {type(message).__name__}")
        role = require(message, "role", str, where, owner=f"messages[{i}]")
        content = require(message, "content", str, where, owner=f"messages[{i}]")
        out.append((role, content))
    return out


def convert_record(where: Where, record: dict[str, Any]) -> Trajectory:
    """One FireAct record -> one trajectory.

    Raises:
        Rejected: see the module docstring for the reasons.
        DataFormatError: no ``messages`` list, or a message without ``role``/``content``.
    """
    messages = _messages(where, record)
    if len(messages) < 2 or messages[0][0] != "user":
        raise Rejected("bad_turn_order", "the first message must be the user question")
    question = _strip_prefix(messages[0][1], "Question:")
    steps: list[Step] = []
    answer = None
    for i in range(1, len(messages), 2):
        role, content = messages[i]
        if role != "assistant":
            raise Rejected("bad_turn_order", f"message {i} should be the assistant's")
        match = _ACTION_RE.search(content)
        if match is None:
            raise Rejected("missing_action", f"message {i} has no 'Action: name[argument]'")
        thought = _strip_prefix(content[: match.start()], "Thought:")
        if thought:
            steps.append(Step("think", thought))
        action, argument = match.group(1), match.group(2).strip()
        reply = messages[i + 1][1] if i + 1 < len(messages) and messages[i + 1][0] == "user" else None
        if action == "finish":
            reward = _REWARD_RE.search(reply) if reply is not None else None
            if reward is None:
                raise Rejected("no_reward", "no 'Episode finished, reward = ...' after finish")
            if reward.group(1).rstrip(".").lower() not in ("true", "1", "1.0"):
                raise Rejected("wrong_answer", f"reward = {reward.group(1)}")
            answer = argument
            steps.append(Step("answer", argument))
            break
        if action not in _TOOL_ACTIONS:
            raise Rejected("unknown_action", action)
        if not argument:
            raise Rejected("empty_tool_call", f"{action}[] in message {i}")
        if reply is None:
            raise Rejected("bad_turn_order", f"no observation after message {i}")
        steps.append(Step(_TOOL_ACTIONS[action], argument))
        steps.append(Step("observation", _strip_prefix(reply, "Observation:")))
    if answer is None:
        raise Rejected("no_finish", "the trace never calls finish[...]")
    source_id = f"{where.path.stem}:{where.line}"
    return kept_trajectory("fireact", "mhqa", source_id, question, steps, answer, {"file": where.path.name})


FIREACT = Converter(
    name="fireact",
    files=("trajectories/fireact/hotpotqa.jsonl", "trajectories/fireact/multitask.jsonl"),
    convert_record=convert_record,
)
