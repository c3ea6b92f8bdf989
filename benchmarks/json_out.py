"""The ``--out`` file of the benchmark scripts: their figures, also written as JSON."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from afm_core.utils.atomic import atomic_write_json

T = TypeVar("T")


def write_out(path: Path | None, figures: T) -> T:
    """Write ``figures`` as JSON to ``path`` when one is given (atomically, its folder created:
    :func:`afm_core.utils.atomic.atomic_write_json`) and return them: a script's ``main`` ends in
    ``return write_out(args.out, results)``."""
    if path is not None:
        atomic_write_json(path, figures)
    return figures
