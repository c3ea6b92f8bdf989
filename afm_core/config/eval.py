"""The schemas of ``conf/eval.yaml``, ``conf/filter_rl.yaml`` (eval + ``filter``) and ``conf/distill.yaml``,
checked by ``jobs.eval``, ``jobs.filter_rl`` and ``jobs.distill`` before they submit (unknown keys and bad values
exit with status 2 naming the key). The groups they share with ``conf/rl.yaml`` (judge, tool servers) are
:mod:`afm_core.config.rl`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from afm_core.config.checks import at_least_one, require
from afm_core.config.cluster import cluster_schema
from afm_core.config.data import DataConfig
from afm_core.config.rl import JudgeConfig, ToolServersConfig
from afm_core.config.sampling import SamplingConfig
from afm_core.config.sft import ModelConfig
from afm_core.config.tracking import TrackingConfig, check_loggers


@dataclass
class ToolJobConfig:
    """What every tool-using job has: model, engine, tools, cluster, judge and tool servers, one rank."""

    run_dir: str = MISSING
    data_dir: str | None = None
    model: ModelConfig = MISSING
    engine: dict[str, Any] = field(default_factory=dict)
    tools: Any = None
    cluster: Any = MISSING
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    tool_servers: ToolServersConfig = field(default_factory=ToolServersConfig)
    parallel: dict[str, Any] = field(default_factory=lambda: {"tp": 1, "pp": 1})
    benchmarks: list[str] | None = None  # eval: null is [gsm8k_test] unless benchmark_files is set
    benchmark_files: list[str] = field(default_factory=list)
    logger: list[str] = field(default_factory=lambda: ["console"])
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        self.cluster = cluster_schema(self.cluster)
        check_loggers(self.logger)
        require(
            self.parallel == {"tp": 1, "pp": 1},
            "parallel",
            self.parallel,
            "{tp: 1, pp: 1}: one rank (the engine batches the samples itself)",
        )


@dataclass
class EvalConfig(ToolJobConfig):
    """``conf/eval.yaml``."""

    eval: SamplingConfig = field(default_factory=SamplingConfig)
    reward_fn: Any = None  # a plug-in ({_target_: ...}), checked by jobs.eval as it imports it


@dataclass
class FilterConfig:
    """``filter`` of ``conf/filter_rl.yaml``: the pass-rate band of the RL prompts kept."""

    max_pass_rate: float | None = 0.3
    min_pass_rate: float | None = None
    drop_all_correct: bool = False
    sft_data: list[str] = field(default_factory=list)
    sample_size: int | None = None
    seed: int = 0
    out: str | None = None

    def __post_init__(self) -> None:
        for key in ("max_pass_rate", "min_pass_rate"):
            value = getattr(self, key)
            require(value is None or 0 <= value <= 1, f"filter.{key}", value, "in [0, 1], or null")
        low, high = self.min_pass_rate, self.max_pass_rate
        require(low is None or high is None or low <= high, "filter.min_pass_rate", low, f"<= max_pass_rate={high}")
        if self.sample_size is not None:
            at_least_one("filter.sample_size", self.sample_size)


@dataclass
class FilterRLConfig(EvalConfig):
    """``conf/filter_rl.yaml``: eval's settings and ``filter``."""

    filter: FilterConfig = field(default_factory=FilterConfig)


@dataclass
class DistillRunConfig:
    limit: int | None = 20
    samples: int = 1
    concurrency: int = 8
    verification: bool = True

    def __post_init__(self) -> None:
        if self.limit is not None:
            at_least_one("distill.limit", self.limit)
        at_least_one("distill.samples", self.samples)
        at_least_one("distill.concurrency", self.concurrency)


@dataclass
class DistillConfig(ToolJobConfig):
    """``conf/distill.yaml``; ``mas``, ``teachers`` and ``roles`` are checked by :mod:`afm_core.distill` as it
    builds them (their keys: ``afm_core.distill.mas.MASConfig`` and ``afm_core.distill.teacher``)."""

    data: DataConfig = MISSING
    distill: DistillRunConfig = field(default_factory=DistillRunConfig)
    mas: dict[str, Any] = field(default_factory=dict)
    teachers: dict[str, Any] = field(default_factory=dict)
    roles: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        for role, spec in self.roles.items():
            teacher = (spec or {}).get("teacher")
            require(
                teacher in self.teachers,
                f"roles.{role}.teacher",
                teacher,
                f"one of the teachers: {', '.join(self.teachers)}",
            )
