"""What every converter shares: the per-record loop, rejections counted by reason, and the report."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afm_core.coa.grammar import TagGrammarError, validate_steps
from afm_core.coa.prompts import user_prompt
from afm_core.coa.trajectory import Step, Trajectory
from afm_core.data.io import Where, read_jsonl


def kept_trajectory(
    source: str, task: str, source_id: str, question: str, steps: list[Step], answer: str, meta: dict[str, Any]
) -> Trajectory:
    """The trajectory a converter keeps (its answer checked: ``correct=True``): id ``"{source}:{source_id}"``, the
    CoA user prompt of ``task`` around ``question``."""
    prompt = user_prompt(task, question)
    return Trajectory(f"{source}:{source_id}", task, question, prompt, steps, answer, True, source, source_id, meta)


class Rejected(Exception):
    """One source record cannot become a valid trajectory; ``reason`` is a short stable code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class ConversionReport:
    """Counts of one conversion.

    Attributes:
        source: converter name.
        files: the files read.
        read: records read.
        converted: trajectories produced (every one passes the tag grammar).
        rejected: rejected records by reason code (``wrong_answer``, ``grammar:<code>``...).
        answer_checks: converted trajectories by their ``meta["answer_check"]`` note (e.g. ``math_verify_rescued``:
            kept because math-verify found the answer equal where a plain string/number check did not).
    """

    source: str
    files: list[str] = field(default_factory=list)
    read: int = 0
    converted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    answer_checks: Counter[str] = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "files": list(self.files),
            "read": self.read,
            "converted": self.converted,
            "rejected": dict(sorted(self.rejected.items())),
            "answer_checks": dict(sorted(self.answer_checks.items())),
        }


@dataclass
class Conversion:
    """A converter's output: the trajectories and the report."""

    trajectories: list[Trajectory]
    report: ConversionReport


RecordReader = Callable[[Path], Iterator[tuple[Where, dict[str, Any]]]]
RecordConverter = Callable[[Where, dict[str, Any]], Trajectory]


@dataclass(frozen=True)
class Converter:
    """A named converter from one kind of source file to CoA trajectories.

    Attributes:
        name: the source name (also each trajectory's ``source`` and id prefix).
        files: default input files, relative to the shared data dir.
        convert_record: one record -> one trajectory; raises :class:`Rejected` for a record that
            cannot be used, :class:`~afm_core.coa.grammar.TagGrammarError` for text that breaks
            the tag grammar, :class:`~afm_core.data.io.DataFormatError` for a malformed record.
        read_records: ``path -> (where, record)`` iterator (default: JSON lines).
    """

    name: str
    files: tuple[str, ...]
    convert_record: RecordConverter
    read_records: RecordReader = read_jsonl

    def __call__(
        self, paths: Sequence[str | os.PathLike[str]], *, limit: int | None = None, strict: bool = False
    ) -> Conversion:
        """Convert the records of ``paths`` in order, stopping after ``limit`` trajectories.

        Every trajectory is checked with :func:`~afm_core.coa.grammar.validate_steps`; a broken one
        (or a record whose text does not parse) is rejected as ``grammar:<first issue code>``.

        Raises:
            DataFormatError: a malformed record (bad JSON, missing or mistyped field).
            TagGrammarError: ``strict`` and a trajectory breaks the tag grammar (message starts
                with ``file:line``).
        """
        report = ConversionReport(self.name, files=[str(p) for p in paths])
        trajectories: list[Trajectory] = []
        for path in paths:
            for where, record in self.read_records(Path(path)):
                if limit is not None and report.converted >= limit:
                    return Conversion(trajectories, report)
                report.read += 1
                try:
                    trajectory = self.convert_record(where, record)
                    validate_steps(trajectory.steps, strict=True)
                except Rejected as rejection:
                    report.rejected[rejection.reason] += 1
                    continue
                except TagGrammarError as err:
                    if strict:
                        raise TagGrammarError(err.issues, context=str(where)) from None
                    report.rejected[f"grammar:{err.issues[0].code}"] += 1
                    continue
                trajectories.append(trajectory)
                report.converted += 1
                if note := trajectory.meta.get("answer_check"):
                    report.answer_checks[note] += 1
        return Conversion(trajectories, report)
