"""A recorded MAS run -> one CoA trajectory in the canonical layout (:mod:`afm_core.coa`).

=========================================  ===========================================================
record event                               trajectory steps
=========================================  ===========================================================
planner ``plan``                           ``<plan>``
thinker ``think``                          ``<think>`` (its ``NEXT:`` line removed)
tool agent ``tool_input`` + ``tool_call``  ``<tool>input</tool>`` + ``<observation>``; an input the
                                           agent failed to write (no call made) leaves no step
reflection ``reflection``                  ``<reflection>``
thinker ``suggest``                        ``<suggested_answer>``
verifier ``double_check``                  ``<double_check>`` (right after its suggested answer)
the run's final answer                     ``<answer>`` (last)
=========================================  ===========================================================

Role outputs keep the teacher's words. CoA tags a teacher wrote inside its output are removed, and counted
in ``meta["format_repairs"]`` (the SFT format filter treats them as instruction violations); an empty output
leaves no step. ``<observation>`` tags inside a tool's output are removed too (they would end the
observation early). ``verification=False`` leaves out the suggested-answer / double-check pairs (the math,
MHQA and code prompts of :mod:`afm_core.coa.prompts` do not describe them; the web prompt does).

The trajectory's prompt is the task family's CoA prompt (:func:`afm_core.coa.prompts.user_prompt`), its
``answer`` the task's reference, ``correct`` and ``meta["grade"]`` the job's grade of the run, and ``meta``
keeps the run key and the code tests (for re-grading).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from afm_core.coa.grammar import validate_steps
from afm_core.coa.prompts import user_prompt
from afm_core.coa.trajectory import Step, Trajectory
from afm_core.distill.roles import reasoning, strip_tags

SOURCE = "distill"
_OBSERVATION_TAGS_RE = re.compile(r"</?observation>")


class NotConverted(ValueError):
    """A run that gives no trajectory; ``reason`` is a short code (``no_answer``, ``grammar:<code>``)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def run_key(record: Mapping[str, Any]) -> str:
    """``<benchmark>:<problem_id>#<sample>``: the id of a run (and of its trajectory, after ``distill:``)."""
    return f"{record['benchmark']}:{record['problem_id']}#{record['sample']}"


def _role_step(tag: str, raw: str, repairs: Counter[str]) -> Step | None:
    text, removed = strip_tags(raw)
    if removed:
        repairs[f"tags_in_{tag}"] += removed
    return Step(tag, text) if text else None


def convert_run(record: Mapping[str, Any], *, verification: bool = True) -> Trajectory:
    """The CoA trajectory of one run record (see the module docstring).

    Raises:
        NotConverted: the run has no final answer (``no_answer``), or its steps break the tag grammar
            (``grammar:<code>``, a bug: the mapping is valid by construction).
    """
    final = (record.get("final_answer") or "").strip()
    if not final:
        raise NotConverted("no_answer", f"run {run_key(record)} ended without an answer")
    task = record["task"]
    repairs: Counter[str] = Counter()
    steps: list[Step] = []
    for event in record["events"]:
        kind = event["kind"]
        if event.get("error") and kind != "tool_call":
            continue  # a failed teacher call said nothing
        step: Step | None = None
        if kind == "plan":
            step = _role_step("plan", event["output"], repairs)
        elif kind == "think":
            step = _role_step("think", reasoning(event["output"]), repairs)
        elif kind == "reflection":
            step = _role_step("reflection", event["output"], repairs)
        elif kind == "tool_call":
            steps.append(Step(event["tool"], event["query"]))
            step = Step("observation", _OBSERVATION_TAGS_RE.sub("", event["observation"]))
        elif kind == "suggest" and verification and event.get("answer"):
            _role_step("suggested_answer", event["output"], repairs)  # counts the tags the teacher wrote
            step = Step("suggested_answer", event["answer"])
        elif kind == "double_check" and verification and steps and steps[-1].tag == "suggested_answer":
            step = _role_step("double_check", event["output"], repairs)
        if step is not None:
            steps.append(step)
    steps.append(Step("answer", final))
    if issues := validate_steps(steps):
        raise NotConverted(f"grammar:{issues[0].code}", f"run {run_key(record)}: {issues[0]}")
    grade = record.get("grade")
    meta: dict[str, Any] = {
        "benchmark": record["benchmark"],
        "problem_id": record["problem_id"],
        "sample": record["sample"],
        "grader": (task.get("meta") or {}).get("grader"),
        "grade": grade,
        "format_repairs": dict(sorted(repairs.items())),
        "mas": {"replans": record.get("replans"), "tool_calls": record.get("tool_calls"),
                "seconds": record.get("seconds"), "teachers": sorted({e["teacher"] for e in record["events"]
                                                                      if e.get("teacher")})},
    }  # fmt: skip
    if tests := (task.get("meta") or {}).get("tests"):
        meta["tests"] = tests
    return Trajectory(
        id=f"{SOURCE}:{run_key(record)}",
        task=task["task"],
        question=task["question"],
        prompt=user_prompt(task["task"], task["question"]),
        steps=steps,
        answer=task.get("answer") or "",
        correct=None if not grade or grade.get("error") else bool(grade.get("correct")),
        source=SOURCE,
        source_id=run_key(record),
        meta=meta,
    )


def convert_runs(
    records: Sequence[Mapping[str, Any]], *, verification: bool = True
) -> tuple[list[Trajectory], Counter[str]]:
    """``(trajectories, runs not converted by reason)`` of ``records``, in order."""
    trajectories: list[Trajectory] = []
    skipped: Counter[str] = Counter()
    for record in records:
        try:
            trajectories.append(convert_run(record, verification=verification))
        except NotConverted as err:
            skipped[err.reason] += 1
    return trajectories, skipped
