"""The schemas of ``conf/eval.yaml``, ``conf/filter_rl.yaml`` (eval + ``filter``) and ``conf/distill.yaml``
(``mas``, ``teachers``, ``roles``), and what makes each job's checked config on its rank (:func:`eval_config`,
:func:`filter_rl_config`, :func:`distill_config`, as :func:`afm_core.config.rl.rl_config` for RL). ``jobs.eval``,
``jobs.filter_rl`` and ``jobs.distill`` check them before they submit (unknown keys and bad values exit with
status 2 naming the key: :func:`afm_core.launch.submit.check_job_config`). The groups they share with
``conf/rl.yaml`` (judge, tool servers, tools) are :mod:`afm_core.config.rl_rollout`'s and
:mod:`afm_core.config.tools`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING, DictConfig

from afm_core.config.checks import at_least_one, job_config, require
from afm_core.config.cluster import ClusterConfig, cluster_schema
from afm_core.config.data import DataConfig
from afm_core.config.rl_rollout import JudgeConfig, ToolServersConfig
from afm_core.config.sampling import SamplingConfig
from afm_core.config.sft import ModelConfig
from afm_core.config.tools import ToolsConfig
from afm_core.config.tracking import TrackingConfig, check_loggers

if TYPE_CHECKING:
    ClusterField = ClusterConfig
else:  # OmegaConf has no union of structured configs: the group is checked by its name (cluster_schema)
    ClusterField = Any


@dataclass
class ToolJobConfig:
    """What every tool-using job has: model, engine, tools, cluster, judge and tool servers, one rank.

    ``engine`` is ``conf/engine/vllm.yaml`` or ``remote.yaml`` (``+engine.in_process=true`` and the like are
    allowed): the mapping :func:`afm_core.rollout.factory.build_engine` reads and checks.
    """

    run_dir: str = MISSING
    data_dir: str | None = None
    model: ModelConfig = MISSING
    engine: dict[str, Any] = field(default_factory=dict)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    cluster: ClusterField = MISSING
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

    @property
    def model_name(self) -> str:
        """``model.hf_path`` when set, else the preset's name (what a report and a run's settings record)."""
        return self.model.hf_path or self.model.name


@dataclass
class EvalConfig(ToolJobConfig):
    """``conf/eval.yaml``."""

    eval: SamplingConfig = field(default_factory=SamplingConfig)
    reward_fn: Any = None  # a plug-in ({_target_: ...}), checked by jobs.eval as it imports it


@dataclass
class FilterConfig:
    """``filter`` of ``conf/filter_rl.yaml``: the pass-rate band of the RL prompts kept
    (:func:`afm_core.eval.filter_rl.decide`), the SFT data whose questions never reach RL, and the draw."""

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
    """``distill``: the first ``limit`` tasks of each source (null: all), ``samples`` MAS runs per task,
    ``concurrency`` runs in flight, and whether the trajectories keep ``<suggested_answer>`` / ``<double_check>``."""

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
class MASConfig:
    """``mas``: limits and policy of one multi-agent run (:class:`afm_core.distill.mas.MultiAgentSystem`).

    Attributes:
        max_tool_calls: tool calls per run (the paper's evaluation allows 12).
        max_steps: thinking-agent calls per run (bounds a run whose tool agents keep failing).
        max_replans: new plans after a low verifier score.
        max_plan_steps: steps the planner is asked for.
        accept_score: the lowest verifier score that ends the run (the CoA rule: <= 2 re-plans, so 3).
        reflect_every: a reflection after every this many tool calls (0: only before each suggestion).
        obs_chars: characters of each observation shown to the roles (the trajectory keeps it whole).
        context_events: transcript entries shown to the roles (the latest ones).
    Raises:
        ConfigError: a count below its minimum, ``accept_score`` outside 1..4 (the verifier's scale).
    """

    max_tool_calls: int = 8
    max_steps: int = 12
    max_replans: int = 1
    max_plan_steps: int = 4
    accept_score: int = 3
    reflect_every: int = 2
    obs_chars: int = 600
    context_events: int = 12

    def __post_init__(self) -> None:
        for key in ("max_tool_calls", "max_steps", "max_plan_steps"):
            at_least_one(f"mas.{key}", getattr(self, key))
        for key in ("max_replans", "reflect_every", "obs_chars", "context_events"):
            require(getattr(self, key) >= 0, f"mas.{key}", getattr(self, key), "an integer >= 0")
        require(1 <= self.accept_score <= 4, "mas.accept_score", self.accept_score, "in 1..4 (the verifier's score)")


TEACHER_BACKENDS = ("engine", "chat")


@dataclass
class TeacherConfig:
    """``teachers.<name>``: a chat model the roles talk to (:mod:`afm_core.distill.teacher`).

    Attributes:
        backend: ``engine`` (the job's ``engine`` on ``model``, through the chat template) or ``chat`` (an
            OpenAI-compatible ``/v1/chat/completions`` endpoint: ``url``, ``model``, ``api_key_env``).
        temperature, top_p, max_tokens: the teacher's sampling (a role may set its own ``max_tokens`` and
            ``temperature``).
        concurrency: requests in flight to this teacher; null: 16 for ``chat``, 64 for ``engine`` (vLLM batches).
        timeout_s, retries: ``chat`` only: seconds per request; attempts after HTTP 429/5xx or a dropped connection.
    """

    backend: str = "engine"
    url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 256
    concurrency: int | None = None
    timeout_s: float = 300.0
    retries: int = 3


@dataclass
class RoleConfig:
    """``roles.<role>``: the teacher it talks to, and its own ``max_tokens`` / ``temperature`` (null: the teacher's)."""

    teacher: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None


@dataclass
class DistillConfig(ToolJobConfig):
    """``conf/distill.yaml``; which roles there are is :data:`afm_core.distill.roles.ROLES`' (checked by
    :func:`afm_core.distill.runner.role_specs` before the queue).

    Raises:
        ConfigError: a teacher's unknown backend, a ``chat`` teacher without ``url`` or ``model``, a role naming
            no teacher of ``teachers``, and the checks of each group.
    """

    data: DataConfig = MISSING
    distill: DistillRunConfig = field(default_factory=DistillRunConfig)
    mas: MASConfig = field(default_factory=MASConfig)
    teachers: dict[str, TeacherConfig] = field(default_factory=dict)
    roles: dict[str, RoleConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, teacher in self.teachers.items():
            key = f"teachers.{name}"
            require(teacher.backend in TEACHER_BACKENDS, f"{key}.backend", teacher.backend, "engine or chat")
            if teacher.backend == "chat":
                for part in ("url", "model"):
                    value = getattr(teacher, part)
                    require(bool(value), f"{key}.{part}", value, "required for backend=chat (an OpenAI-compatible "
                            "endpoint)")  # fmt: skip
        for role, spec in self.roles.items():
            require(
                spec.teacher in self.teachers,
                f"roles.{role}.teacher",
                spec.teacher,
                f"one of the teachers: {', '.join(self.teachers)}",
            )


def eval_config(cfg: DictConfig | Mapping[str, Any] | EvalConfig) -> EvalConfig:
    """``conf/eval.yaml`` as a checked :class:`EvalConfig` (``jobs.eval``'s ``load_cfg``)."""
    return job_config(EvalConfig, cfg)


def filter_rl_config(cfg: DictConfig | Mapping[str, Any] | FilterRLConfig) -> FilterRLConfig:
    """``conf/filter_rl.yaml`` as a checked :class:`FilterRLConfig` (``jobs.filter_rl``'s ``load_cfg``)."""
    return job_config(FilterRLConfig, cfg)


def distill_config(cfg: DictConfig | Mapping[str, Any] | DistillConfig) -> DistillConfig:
    """``conf/distill.yaml`` as a checked :class:`DistillConfig` (``jobs.distill``'s ``load_cfg``)."""
    return job_config(DistillConfig, cfg)
