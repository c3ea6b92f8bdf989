"""A job's run dir, opened on its rank (eval, distillation, the RL prompt filter)."""

from __future__ import annotations

import logging
from pathlib import Path


def open_run(run_dir: str | Path) -> Path:
    """``run_dir``, created (with its parents) when absent; INFO logging to stderr."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path
