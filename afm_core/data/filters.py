"""SFT trajectory filters: the AFM paper's four, and the lenient defaults of ``jobs.prepare_data``.

The paper's agentic SFT data section (arXiv 2508.13167, "Agentic Supervised Fine-Tuning", data filtering;
upstream ships no code for it) filters the distilled trajectories in four ways. Each is a stage here, and
each stage reports how many trajectories it took in, kept and dropped (by reason):

==================  ================================================================================
stage               what it drops (reason codes) / does
==================  ================================================================================
``complexity``      fewer than ``min_tool_calls`` tool interactions (``few_tool_calls``; the paper: 5)
``quality``         wrong answers: the source's own verdict (``incorrect``), or a re-grade with
                    :mod:`afm_core.rewards` (``wrong_answer``, ``grader_error``, ``ungraded``): math-verify
                    for math, the sandbox tests for code, the LLM judge for QA/web when one is configured,
                    else exact match (or token F1 >= ``qa_min_f1``); redundant tool inputs
                    (``redundant_tool_inputs``: the same call twice); instruction or format violations
                    (``format_violation``: the CoA validator's issues, an answer that is not in the task's
                    answer format, CoA tags the teacher wrote inside a block)
``reflection``      ``require_reflection``: every trajectory without ``<reflection>`` (``no_reflection``).
                    ``reflection_enrichment`` (the paper): math/code trajectories without reflection
                    (``no_reflection``); QA/web ones without reflection when another trajectory of the same
                    question has one (``reflection_preferred``)
``dedup``           exact duplicates (same prompt and steps) of a kept trajectory (``duplicate``)
upsampling          in the TRAIN split only, each error-correction trajectory appears
                    ``error_correction_upsample`` times. ``error_correction: any`` (the default) counts any
                    recovery (:func:`~afm_core.data.trajectory_checks.is_error_correction`);
                    ``double_check`` (the paper) counts a correct trajectory whose FIRST ``<double_check>``
                    scored <= ``low_double_check`` and that suggested another answer after it
                    (:func:`~afm_core.data.trajectory_checks.is_double_check_correction`)
==================  ================================================================================

Dedup runs last among the dropping stages, so a duplicate of a dropped trajectory is dropped for the same
reason as its twin and only a duplicate of a kept one counts as ``duplicate``.

Defaults keep the behaviour ``jobs.prepare_data`` always had (known-wrong trajectories and duplicates are
dropped, nothing else); ``preset: paper`` (:data:`PAPER_PRESET`) switches the paper's filters on. What each stage
asks of one trajectory (its checks, its grade) is :mod:`afm_core.data.trajectory_checks`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from afm_core.coa.trajectory import Trajectory
from afm_core.data.schema import task_id, trajectory_row
from afm_core.data.trajectory_checks import (
    format_violations,
    grade_trajectory,
    has_reflection,
    is_double_check_correction,
    is_error_correction,
    redundant_tool_inputs,
)

ERROR_CORRECTION_KINDS = ("any", "double_check")

PAPER_PRESET: dict[str, Any] = {
    "min_tool_calls": 5,
    "require_correct": True,
    "grade_answers": True,
    "drop_redundant_tool_inputs": True,
    "drop_format_violations": True,
    "reflection_enrichment": True,
    "error_correction": "double_check",
    "error_correction_upsample": 2,
}
"""``filters.preset: paper``: the four filters of the paper. The upsampling factor k is not given in the
paper; 2 is this project's choice (set ``error_correction_upsample`` to change it)."""

PRESETS: dict[str, dict[str, Any]] = {"paper": PAPER_PRESET}


@dataclass(frozen=True)
class DataFilters:
    """Which filters run, and their thresholds (the module docstring lists the stages and reason codes).

    Attributes:
        min_tool_calls: complexity: drop trajectories with fewer tool calls (0: off; the paper: 5).
        require_correct: quality: drop trajectories whose ``correct`` is False (the source's verdict or a
            re-grade); unknown correctness (None) is kept unless ``grade_answers``.
        grade_answers: quality: grade each trajectory's final answer against its reference with
            :class:`afm_core.rewards.Graders`, unless it already carries a grade (``meta["grade"]``, e.g.
            graded by ``jobs.distill`` with the sandbox tests); wrong ones and ones that cannot be graded are
            dropped.
        qa_min_f1: QA answers graded by exact match also count as correct when their token F1 against the
            gold answers reaches this (None: exact match only).
        judge_url, judge_model, judge_api_key_env: an OpenAI-compatible chat endpoint that judges QA/web
            answers (None: exact match / F1).
        drop_redundant_tool_inputs: quality: drop trajectories that call the same tool with the same input
            (whitespace and case folded) more than once.
        drop_format_violations: quality: drop trajectories with CoA validator issues, an answer outside the
            task's answer format (math: ``\\boxed{}``; code: a fenced program) or repaired tags
            (``meta["format_repairs"]``).
        require_reflection: drop every trajectory without a ``<reflection>`` step.
        reflection_enrichment: the paper's reflection filter (module docstring).
        error_correction: ``any`` or ``double_check``: which trajectories are upsampled.
        low_double_check: ``double_check``: the highest first ``<double_check>`` score that counts as low.
        error_correction_upsample: copies of each error-correction trajectory in the train split (1: none).
    """

    min_tool_calls: int = 0
    require_correct: bool = True
    require_reflection: bool = False
    error_correction_upsample: int = 1
    grade_answers: bool = False
    qa_min_f1: float | None = None
    judge_url: str | None = None
    judge_model: str | None = None
    judge_api_key_env: str | None = None
    drop_redundant_tool_inputs: bool = False
    drop_format_violations: bool = False
    reflection_enrichment: bool = False
    error_correction: str = "any"
    low_double_check: int = 2

    def __post_init__(self) -> None:
        if self.min_tool_calls < 0:
            raise ValueError(f"data.filters.min_tool_calls must be >= 0, got {self.min_tool_calls}")
        if self.error_correction_upsample < 1:
            raise ValueError(
                f"data.filters.error_correction_upsample must be >= 1, got {self.error_correction_upsample}"
            )
        if self.error_correction not in ERROR_CORRECTION_KINDS:
            raise ValueError(
                f"data.filters.error_correction must be one of {', '.join(ERROR_CORRECTION_KINDS)}, "
                f"got {self.error_correction!r}"
            )
        if not 1 <= self.low_double_check <= 4:
            raise ValueError(f"data.filters.low_double_check must be in 1..4, got {self.low_double_check}")
        if self.qa_min_f1 is not None and not 0.0 < self.qa_min_f1 <= 1.0:
            raise ValueError(f"data.filters.qa_min_f1 must be in (0, 1] or null, got {self.qa_min_f1}")
        if bool(self.judge_url) != bool(self.judge_model):
            raise ValueError("data.filters.judge_url and data.filters.judge_model go together (set both or neither)")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None) -> DataFilters:
        """Build from a mapping of overrides; ``preset: paper`` starts from :data:`PAPER_PRESET`.

        Raises:
            ValueError: an unknown key or preset (named), or a value out of range.
        """
        cfg = dict(cfg or {})
        preset = cfg.pop("preset", None)
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(cfg) - known):
            raise ValueError(f"data.filters: unknown key(s) {unknown}; known: {sorted(known | {'preset'})}")
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"data.filters.preset: unknown preset {preset!r}; known: {', '.join(PRESETS)} or null")
        return cls(**{**PRESETS.get(preset or "", {}), **cfg})


# --------------------------------------------------------------------------------------------------
# Stages


@dataclass
class StageReport:
    """What one filter stage did: trajectories in, kept, and dropped by reason."""

    name: str
    input: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "input": self.input,
            "kept": self.kept,
            "dropped": dict(sorted(self.dropped.items())),
        }


@dataclass
class FilterResult:
    """The kept trajectories (input order) and one :class:`StageReport` per stage, in order."""

    kept: list[Trajectory]
    stages: list[StageReport]

    @property
    def dropped(self) -> Counter[str]:
        """Dropped trajectories by reason, over every stage."""
        total: Counter[str] = Counter()
        for stage in self.stages:
            total.update(stage.dropped)
        return total


Check = Callable[[Trajectory], "str | None"]


def _stage(name: str, items: list[Trajectory], check: Check) -> tuple[list[Trajectory], StageReport]:
    report = StageReport(name, input=len(items))
    kept = []
    for trajectory in items:
        reason = check(trajectory)
        if reason is None:
            kept.append(trajectory)
        else:
            report.dropped[reason] += 1
    report.kept = len(kept)
    return kept, report


def _complexity(filters: DataFilters) -> Check:
    return lambda t: "few_tool_calls" if t.num_tool_calls < filters.min_tool_calls else None


def _quality(filters: DataFilters) -> Check:
    def check(trajectory: Trajectory) -> str | None:
        grade = trajectory.meta.get("grade")
        if trajectory.correct is False and (filters.require_correct or filters.grade_answers):
            return "wrong_answer" if grade else "incorrect"
        if filters.grade_answers and trajectory.correct is not True:
            return "grader_error" if grade and grade.get("error") else "ungraded"
        if filters.drop_redundant_tool_inputs and redundant_tool_inputs(trajectory):
            return "redundant_tool_inputs"
        if filters.drop_format_violations and format_violations(trajectory):
            return "format_violation"
        return None

    return check


def _reflection(filters: DataFilters, items: Sequence[Trajectory]) -> Check:
    reflective_questions = {task_id(t.question) for t in items if has_reflection(t)}

    def check(trajectory: Trajectory) -> str | None:
        if has_reflection(trajectory):
            return None
        if filters.require_reflection:
            return "no_reflection"
        if filters.reflection_enrichment:
            if trajectory.task in ("math", "code"):
                return "no_reflection"
            if task_id(trajectory.question) in reflective_questions:
                return "reflection_preferred"
        return None

    return check


def _dedup(items: Sequence[Trajectory]) -> Check:
    seen: set[Any] = set()

    def check(trajectory: Trajectory) -> str | None:
        key = (trajectory.prompt, tuple(trajectory.steps))
        if key in seen:
            return "duplicate"
        seen.add(key)
        return None

    return check


async def _grade_all(items: list[Trajectory], filters: DataFilters, graders: Any, concurrency: int) -> None:
    """Grade, in place, the trajectories without a grade in ``meta["grade"]`` (sets ``correct``)."""
    slots = asyncio.Semaphore(concurrency)

    async def one(trajectory: Trajectory) -> None:
        async with slots:
            grade = await grade_trajectory(trajectory, graders, filters.qa_min_f1)
        trajectory.meta["grade"] = grade
        trajectory.correct = None if grade["error"] else bool(grade["correct"])

    await asyncio.gather(*(one(t) for t in items if not t.meta.get("grade")))


async def apply_filters(
    trajectories: Sequence[Trajectory], filters: DataFilters, graders: Any = None, *, concurrency: int = 16
) -> FilterResult:
    """Run the stages (complexity, quality, reflection, dedup) over ``trajectories``.

    With ``filters.grade_answers`` the trajectories without ``meta["grade"]`` are graded first, in place
    (``correct`` and ``meta["grade"]`` are set), with ``graders`` (None: built from the ``judge_*``
    settings, no sandbox: code answers then grade as errors).

    Returns:
        A :class:`FilterResult`; upsampling is left to :func:`upsampled_rows` (train split only).
    """
    items = list(trajectories)
    own = None
    if filters.grade_answers:
        to_grade = [t for t in items if not t.meta.get("grade")]
        if to_grade:
            if graders is None:
                graders = own = build_graders(filters)
            try:
                await _grade_all(to_grade, filters, graders, concurrency)
            finally:
                if own is not None:
                    await own.close()
    stages = []
    for name, make in (
        ("complexity", lambda kept: _complexity(filters)),
        ("quality", lambda kept: _quality(filters)),
        ("reflection", lambda kept: _reflection(filters, kept)),
        ("dedup", _dedup),
    ):
        items, report = _stage(name, items, make(items))
        stages.append(report)
    return FilterResult(items, stages)


def run_filters(trajectories: Sequence[Trajectory], filters: DataFilters, graders: Any = None) -> FilterResult:
    """:func:`apply_filters` from synchronous code (runs its own event loop)."""
    return asyncio.run(apply_filters(trajectories, filters, graders))


def build_graders(filters: DataFilters, sandbox_url: str | None = None) -> Any:
    """:class:`afm_core.rewards.Graders` with the filters' judge (if any) and a sandbox client (if a URL)."""
    from afm_core.rewards import Graders, LLMJudge, SandboxClient  # aiohttp: prepare imports this module, no grading

    judge = None
    if filters.judge_url and filters.judge_model:
        judge = LLMJudge(filters.judge_url, filters.judge_model, filters.judge_api_key_env)
    return Graders(sandbox=SandboxClient(sandbox_url) if sandbox_url else None, judge=judge)


def filter_trajectories(
    trajectories: Sequence[Trajectory], filters: DataFilters
) -> tuple[list[Trajectory], Counter[str]]:
    """The stages without grading: ``(kept, dropped count by reason)``, ``kept`` in input order.

    Raises:
        ValueError: ``filters.grade_answers`` (grading is async: use :func:`apply_filters`).
    """
    if filters.grade_answers:
        raise ValueError("filter_trajectories cannot grade answers: use apply_filters (async) or run_filters")
    result = asyncio.run(apply_filters(trajectories, filters))
    return result.kept, result.dropped


def is_upsampled(trajectory: Trajectory, filters: DataFilters) -> bool:
    """Whether ``trajectory`` is an error-correction trajectory under ``filters.error_correction``."""
    if filters.error_correction == "double_check":
        return is_double_check_correction(trajectory, filters.low_double_check)
    return is_error_correction(trajectory)


def upsampled_rows(trajectories: Sequence[Trajectory], filters: DataFilters | int) -> list[dict[str, Any]]:
    """Parquet rows, with ``factor - 1`` extra copies (ids ``<id>#up<k>``) of each error-correction trajectory.

    ``filters`` may be a bare factor (the ``any`` definition), as before the paper's filters existed.
    """
    if isinstance(filters, int):
        filters = DataFilters(error_correction_upsample=filters)
    factor = filters.error_correction_upsample
    rows = []
    for trajectory in trajectories:
        rows.append(trajectory_row(trajectory))
        if factor > 1 and is_upsampled(trajectory, filters):
            rows += [trajectory_row(trajectory, row_id=f"{trajectory.id}#up{k}") for k in range(1, factor)]
    return rows


def filters_report(result: FilterResult, inputs: int, train: Sequence[Trajectory], train_rows: int,
                   filters: DataFilters) -> dict[str, Any]:  # fmt: skip
    """The ``filters`` section of a ``report.json``: totals, each stage's counts, and the upsampling of the
    ``train`` split (its trajectories and its number of rows)."""
    return {
        "input": inputs,
        "kept": len(result.kept),
        "dropped": dict(sorted(result.dropped.items())),
        "upsampled_rows": train_rows - len(train),
        "stages": [stage.to_dict() for stage in result.stages],
        "upsampling": {
            "definition": filters.error_correction,
            "factor": filters.error_correction_upsample,
            "train_trajectories_upsampled": sum(is_upsampled(t, filters) for t in train),
        },
        "settings": asdict(filters),
    }
