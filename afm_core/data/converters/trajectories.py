"""CoA trajectories already in this project's format -> trajectories (any task), e.g. ``jobs.distill``'s output.

Source: JSON lines, one :meth:`afm_core.coa.trajectory.Trajectory.to_dict` per line (the distillation job
writes ``trajectories.jsonl`` this way). No default files: give the path, ``data.sources.trajectories.path=FILE``.
The record is taken as written (id, task, prompt, steps, answer, ``correct``, meta); the tag grammar is
checked as for every converter.

Rejection reasons: ``bad_trajectory`` (a field missing or mistyped, an unknown tag or task).
"""

from __future__ import annotations

from typing import Any

from afm_core.coa.trajectory import Trajectory
from afm_core.data.converters.base import Converter, Rejected
from afm_core.data.io import Where


def convert_record(where: Where, record: dict[str, Any]) -> Trajectory:
    """One ``Trajectory.to_dict()`` record -> the trajectory.

    Raises:
        Rejected: ``bad_trajectory``, with the field named.
    """
    try:
        return Trajectory.from_dict(record)
    except ValueError as err:
        raise Rejected("bad_trajectory", f"{where}: {err}") from None


TRAJECTORIES = Converter(name="trajectories", files=(), convert_record=convert_record)
