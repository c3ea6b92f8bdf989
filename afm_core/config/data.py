"""The schemas of the ``data`` group (``conf/data/*.yaml``) and of ``conf/prepare_data.yaml``.

``data.sources`` maps a converter name to ``{limit, path}``: at most ``limit`` trajectories (null: all) from
``path`` (a file or a glob, e.g. ``data.sources.r1searcher.path=my_rollouts.jsonl``; null: the converter's
files under the shared data folder). The value checks are :mod:`afm_core.data.prepare`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from afm_core.config.checks import ConfigError, require


@dataclass
class DataConfig:
    name: str = "coa_traces"
    shared_dir: str | None = None
    out_dir: str | None = None
    sources: dict[str, Any] = field(default_factory=dict)
    heldout_fraction: float = 0.05
    split_seed: int = 0
    mask_observations: bool = True
    pack: bool = True
    filters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from pathlib import Path

        from afm_core.data.prepare import DataFilters, normalize_sources, source_files

        require(0.0 <= self.heldout_fraction <= 1.0, "data.heldout_fraction", self.heldout_fraction, "in [0, 1]")
        try:
            for name, spec in normalize_sources(self.sources).items():
                if spec["path"] is not None:  # the user's own file: it must exist where the job is submitted
                    source_files(name, spec["path"], Path("."))
            DataFilters.from_config(self.filters)
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError(str(err)) from None


@dataclass
class InputConfig:
    format: str = "converters"
    path: str | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        from afm_core.data.prepare import PrepareInput

        try:
            PrepareInput(format=self.format, path=self.path, task=self.task)
        except ValueError as err:
            raise ConfigError(str(err)) from None


@dataclass
class PrepareDataConfig:
    """``conf/prepare_data.yaml`` (``python -m jobs.prepare_data``)."""

    data: DataConfig = MISSING
    input: InputConfig = MISSING
    export: str | None = None
    export_dir: str | None = None
    strict: bool = False
    force: bool = False

    def __post_init__(self) -> None:
        from afm_core.data.prepare import EXPORT_FORMATS

        require(
            self.export is None or self.export in EXPORT_FORMATS,
            "export",
            self.export,
            f"null or one of {', '.join(EXPORT_FORMATS)}",
        )
