"""What the SFT filters (:mod:`afm_core.data.filters`) and the teacher system (:mod:`afm_core.distill`) ask of one
trajectory: its ``<double_check>`` score, whether it reflects or recovers from a mistake (the error-correction
definitions of the upsampling), its repeated tool inputs, its format violations, and its grade.

Plain functions of a :class:`~afm_core.coa.trajectory.Trajectory`; :func:`grade_trajectory` awaits the graders it
is given (:class:`afm_core.rewards.Graders`)."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from afm_core.coa.grammar import validate_steps
from afm_core.coa.render import render_response
from afm_core.coa.trajectory import Trajectory

_TOOL_ERROR_RE = re.compile(
    r"Traceback \(most recent call last\)|^\w*(Error|Exception)\b|Could not find|No results? found",
    re.MULTILINE | re.IGNORECASE,
)
_EMPTY_RESULTS = frozenset({"", "none", "null", "[]", "{}"})
_SCORE_RE = re.compile(r"\b([1-4])\b")
_BOXED_RE = re.compile(r"\\boxed\s*\{")
_FENCE_RE = re.compile(r"```")


_NAMED_SCORE_RE = re.compile(r"\bscore\b\W{0,3}([1-4])\b", re.IGNORECASE)


def double_check_score(content: str) -> int | None:
    """The 1-4 score in a ``<double_check>`` text: the digit after the word "score" (``Score: 2``), else the
    first standalone digit 1-4; None when there is none."""
    match = _NAMED_SCORE_RE.search(content) or _SCORE_RE.search(content)
    return int(match.group(1)) if match else None


def _failed(observation: str) -> bool:
    return observation.strip().lower() in _EMPTY_RESULTS or bool(_TOOL_ERROR_RE.search(observation))


def has_reflection(trajectory: Trajectory) -> bool:
    return any(step.tag == "reflection" for step in trajectory.steps)


def is_error_correction(trajectory: Trajectory) -> bool:
    """Whether the trajectory recovers from a mistake: it has a ``<reflection>``, or a tool call that
    failed (its observation is empty/``None``, a traceback, an error or "not found") followed by
    another tool call, or a ``<double_check>`` scored 1-2 followed by more work."""
    steps = trajectory.steps
    for i, step in enumerate(steps):
        later_call = any(s.kind == "tool" for s in steps[i + 1 :])
        if step.tag == "reflection":
            return True
        if step.kind == "observation" and later_call and _failed(step.content):
            return True
        if step.tag == "double_check" and i + 1 < len(steps) and steps[i + 1].tag != "answer":
            score = double_check_score(step.content)
            if score and score <= 2:
                return True
    return False


def _folded(text: str | None) -> str:
    return " ".join((text or "").lower().split())


def is_double_check_correction(trajectory: Trajectory, low: int = 2) -> bool:
    """The paper's error-correction case: the FIRST ``<double_check>`` scored ``<= low``, the trajectory then
    suggested another answer (whitespace and case folded) and ended correct (``trajectory.correct is True``)."""
    steps = trajectory.steps
    first = next((i for i, step in enumerate(steps) if step.tag == "double_check"), None)
    if first is None or first == 0 or trajectory.correct is not True:
        return False
    score = double_check_score(steps[first].content)
    if score is None or score > low:
        return False
    rejected = _folded(steps[first - 1].content)
    return any(s.tag == "suggested_answer" and _folded(s.content) != rejected for s in steps[first + 1 :])


def redundant_tool_inputs(trajectory: Trajectory) -> list[tuple[str, str]]:
    """The ``(tool, input)`` pairs called more than once in the trajectory (input whitespace/case folded)."""
    seen: Counter[tuple[str, str]] = Counter(
        (step.tag, " ".join(step.content.lower().split())) for step in trajectory.steps if step.kind == "tool"
    )
    return [key for key, count in seen.items() if count > 1]


def answer_format_issue(task: str, answer: str | None) -> str | None:
    """Why ``answer`` is not in the answer format the task's prompt asks for (None: it is).

    math: a ``\\boxed{}`` (:data:`afm_core.coa.prompts.MATH_PROMPT`); code: a fenced program; every task: a
    non-empty answer.
    """
    if answer is None or not answer.strip():
        return "empty_answer"
    if task == "math" and not _BOXED_RE.search(answer):
        return "answer_not_boxed"
    if task == "code" and not _FENCE_RE.search(answer):
        return "answer_not_fenced"
    return None


def format_violations(trajectory: Trajectory) -> list[str]:
    """The CoA validator's issue codes, the answer-format issue and the converter's repairs, in that order."""
    issues = [issue.code for issue in validate_steps(trajectory.steps)]
    if issue := answer_format_issue(trajectory.task, trajectory.final_answer):
        issues.append(issue)
    issues += [f"repaired:{kind}" for kind in sorted(trajectory.meta.get("format_repairs") or {})]
    return issues


def grader_of(trajectory: Trajectory, judged: bool) -> str:
    """The grader kind of a trajectory: ``meta["grader"]`` when set, else by task family (math -> ``math``,
    code -> ``code``, mhqa -> ``judge`` with a judge else ``qa``, web -> ``judge``). :func:`grade_trajectory`
    then judges every QA answer when a judge is configured, and grades ``judge`` ones by EM/F1 when not."""
    if kind := trajectory.meta.get("grader"):
        return str(kind)
    return {"math": "math", "code": "code", "mhqa": "judge" if judged else "qa"}.get(trajectory.task, "judge")


async def grade_trajectory(trajectory: Trajectory, graders: Any, qa_min_f1: float | None = None) -> dict[str, Any]:
    """Grade the final answer of ``trajectory`` against ``trajectory.answer`` (the code tests in
    ``meta["tests"]``) with ``graders`` (:class:`afm_core.rewards.Graders`).

    Returns:
        ``{"grader", "score", "reason", "error", "correct"}`` (JSON-safe). ``correct`` is True also for a
        QA answer with token F1 >= ``qa_min_f1``.
    """
    judged = getattr(graders, "judge", None) is not None
    kind = grader_of(trajectory, judged)
    if kind in ("qa", "judge"):
        kind = "judge" if judged else "qa"
    grade = await graders.grade(
        kind,
        render_response(trajectory.steps),
        gold=trajectory.answer,
        question=trajectory.question,
        meta=trajectory.meta,
    )
    f1 = (grade.extra or {}).get("f1")
    correct = grade.correct or (kind == "qa" and qa_min_f1 is not None and f1 is not None and f1 >= qa_min_f1)
    return {"grader": kind, "score": grade.score, "reason": grade.reason, "error": grade.error, "correct": correct,
            "f1": f1}  # fmt: skip
