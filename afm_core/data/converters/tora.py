"""ToRA tool-integrated math solutions -> CoA trajectories (task ``math``).

Source: microsoft/ToRA ``data/tora/examples.jsonl``: ``{id, dataset, level, gt, gt_cot, messages:
[user problem, assistant solution]}``. The solution interleaves prose, ```` ```python ```` programs and
their recorded ```` ```output ```` blocks, and ends with ``\\boxed{answer}``.

Mapping: prose -> ``<think>``; each program -> ``<code>`` (query ```` ```py ...``` ````); its recorded
output -> ``<observation>``; the last ``\\boxed{}`` -> ``<answer>\\boxed{...}``. Correct when that answer
equals ``gt`` under math-verify (:func:`afm_core.rewards.math_equal`); otherwise rejected as ``wrong_answer``.
An answer that the plain string/number check would have rejected but math-verify accepts (``\\frac12`` vs
``0.5``) is kept and marked ``meta["answer_check"] = "math_verify_rescued"``; the conversion report counts them.

Rejection reasons: ``bad_turn_order``, ``missing_output``, ``no_answer``, ``wrong_answer``.
"""

from __future__ import annotations

import re
from typing import Any

from afm_core.coa.trajectory import Step, Trajectory
from afm_core.data.converters.answer_check import boxed_content, math_answers_equal
from afm_core.data.converters.base import Converter, Rejected, kept_trajectory
from afm_core.data.converters.math_tools import code_call, steps_around_calls
from afm_core.data.io import Where, require
from afm_core.rewards.math import math_equal

_PROGRAM_RE = re.compile(r"```python\n(.*?)```(?:\s*```output\n(.*?)```)?", re.DOTALL)


def convert_record(where: Where, record: dict[str, Any]) -> Trajectory:
    """One ToRA record -> one trajectory.

    Raises:
        Rejected: see the module docstring for the reasons.
        DataFormatError: a missing or mistyped ``gt``/``messages`` field.
    """
    gold = require(record, "gt", str, where).strip()
    messages = require(record, "messages", list, where)
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    if roles != ["user", "assistant"]:
        raise Rejected("bad_turn_order", f"expected [user, assistant] messages, got {roles}")
    question = require(messages[0], "content", str, where, owner="messages[0]").strip()
    solution = require(messages[1], "content", str, where, owner="messages[1]")

    def program_steps(program: re.Match[str]) -> list[Step]:
        if program.group(2) is None:
            raise Rejected("missing_output", f"program at char {program.start()} has no ```output block")
        return code_call(program.group(1), program.group(2))

    steps, tail = steps_around_calls(solution, _PROGRAM_RE, program_steps)
    tail = tail.strip()
    answer = boxed_content(tail)
    if answer is None:
        raise Rejected("no_answer", "no \\boxed{} after the last program")
    if not math_equal(answer, gold):
        raise Rejected("wrong_answer", f"boxed {answer!r}, gt {gold!r}")
    rescued = not math_answers_equal(answer, gold)
    steps.append(Step("think", tail))
    steps.append(Step("answer", f"\\boxed{{{answer}}}"))
    source_id = str(record.get("id") or f"{where.path.stem}:{where.line}")
    meta = {
        "file": where.path.name,
        "dataset": record.get("dataset"),
        "level": record.get("level"),
        **({"answer_check": "math_verify_rescued"} if rescued else {}),
    }
    return kept_trajectory("tora", "math", source_id, question, steps, gold, meta)


TORA = Converter(name="tora", files=("trajectories/tora/examples.jsonl",), convert_record=convert_record)
