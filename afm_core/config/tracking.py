"""The ``logger``, ``tracking`` and ``profile`` keys every training and evaluation app shares.

``logger``: the tracking backends (:mod:`afm_core.utils.tracking`), a Hydra list as verl's ``trainer.logger``:
``logger=[console,tensorboard]``. ``profile``: a ``torch.profiler`` trace of some steps
(:mod:`afm_core.utils.profiling`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from afm_core.config.checks import require
from afm_core.utils.tracking import BACKENDS


def check_loggers(loggers: list[str]) -> None:
    """Raises ConfigError naming ``logger`` unless every entry is one of :data:`BACKENDS`."""
    for name in loggers:
        require(name in BACKENDS, "logger", loggers, f"a list of {', '.join(BACKENDS)}")


@dataclass
class TrackingConfig:
    project: str = "afm"  # W&B project, MLflow experiment
    name: str | None = None  # run name; null: <job>/<run dir name>
    mlflow_uri: str | None = None  # null: $MLFLOW_TRACKING_URI, else the file store RUN_DIR/mlruns


@dataclass
class ProfileConfig:
    enabled: bool = False
    steps: list[int] = field(default_factory=lambda: [2, 3])  # [first, last] optimizer steps, inclusive
    ranks: list[int] = field(default_factory=lambda: [0])
    dir: str | None = None  # null: RUN_DIR/profile
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False

    def __post_init__(self) -> None:
        require(
            len(self.steps) == 2 and 1 <= self.steps[0] <= self.steps[1],
            "profile.steps",
            self.steps,
            "[first, last] optimizer steps with 1 <= first <= last",
        )
        require(all(r >= 0 for r in self.ranks), "profile.ranks", self.ranks, "global ranks >= 0")
