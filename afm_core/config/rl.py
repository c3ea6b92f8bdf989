"""The schema of ``conf/rl.yaml`` (``python -m jobs.rl``): the composed :class:`RLConfig` with the checks across its
groups, the trainer side's groups (``algorithm``, ``critic``, ``trainer``, ``weight_sync``, ``val``), and the
run-time views its parts receive (:attr:`RLConfig.policy`, ``.actor``, ``.checkpoint``, ``.validation``). The
rollout side's groups are :mod:`afm_core.config.rl_rollout`'s, the policy-loss settings (``algorithm.clip_ratio_*``,
``tis_cap``, ``kl_coef`` ...) and their bounds :mod:`afm_core.config.policy_loss`'s.

Dynamic sampling keeps a group when its ``algorithm.filter_groups_metric`` varies over the group's samples: ``acc``
(the task's 0/1 correctness, DAPO eq. 11 and verl's recipe ``algorithm.filter_groups.metric=acc``) or ``score``
(the shaped reward).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING, DictConfig

from afm_core.config.checks import at_least_one, divisors, job_config, positive, require
from afm_core.config.cluster import ClusterConfig, cluster_schema
from afm_core.config.engine import VLLMEngineConfig
from afm_core.config.lora import LoRAConfig
from afm_core.config.policy_loss import PolicyLossConfig, has_off_policy_correction
from afm_core.config.rl_rollout import REWARD_MODES as REWARD_MODES  # re-exported: rl.reward_shaping reads it here
from afm_core.config.rl_rollout import (
    ColocationConfig,
    JudgeConfig,
    RewardConfig,
    RLDataConfig,
    RolloutConfig,
    ToolServersConfig,
    check_context_length,
)
from afm_core.config.rl_rollout import ContextStage as ContextStage  # re-exported: the RL schema's name
from afm_core.config.rl_rollout import PartialConfig as PartialConfig  # re-exported: rl.train_batch reads it here
from afm_core.config.sampling import SamplingConfig
from afm_core.config.sft import ModelConfig, OptimConfig, ParallelConfig, check_plan_options
from afm_core.config.timeouts import collective_timeout_min, rollout_wait_s
from afm_core.config.tools import ToolsConfig
from afm_core.config.tracking import ProfileConfig, TrackingConfig, check_loggers
from afm_core.config.trainer import TrainerBaseConfig

if TYPE_CHECKING:
    ClusterField = ClusterConfig
else:  # OmegaConf has no union of structured configs: the group is checked by its name (cluster_schema)
    ClusterField = Any

ADVANTAGE_ESTIMATORS = ("grpo", "drgrpo", "gae")
#: algorithm.filter_groups_metric -> the field of the sample (afm_core.rl.grading.Sample) a kept group varies in
FILTER_METRICS = {"acc": "score", "score": "reward"}


@dataclass
class AlgorithmConfig(PolicyLossConfig):
    """``algorithm``: the advantage estimator, the batch sizes, dynamic sampling, GAE's ``gamma`` / ``lam`` and
    the policy-loss settings it extends (:class:`~afm_core.config.policy_loss.PolicyLossConfig`: the same
    ``algorithm.*`` keys, declared and bounded there, and what :func:`afm_core.rl.losses.policy_loss` reads)."""

    adv_estimator: str = "grpo"
    train_batch_size: int = 16
    gen_batch_size: int = 16
    mini_batch_size: int = 8
    ppo_epochs: int = 1
    filter_groups: bool = True
    filter_groups_metric: str = "acc"
    max_num_gen_batches: int = 10
    allow_partial: bool = False
    gamma: float = 1.0
    lam: float = 1.0

    def __post_init__(self) -> None:
        a = "algorithm."
        require(
            self.adv_estimator in ADVANTAGE_ESTIMATORS,
            a + "adv_estimator",
            self.adv_estimator,
            f"one of {', '.join(ADVANTAGE_ESTIMATORS)}",
        )
        for key in ("train_batch_size", "gen_batch_size", "mini_batch_size", "ppo_epochs"):
            at_least_one(a + key, getattr(self, key))
        require(
            self.train_batch_size % self.mini_batch_size == 0,
            a + "mini_batch_size",
            self.mini_batch_size,
            f"must divide algorithm.train_batch_size={self.train_batch_size}",
        )
        require(
            self.filter_groups_metric in FILTER_METRICS,
            a + "filter_groups_metric",
            self.filter_groups_metric,
            "acc (the task's correctness, DAPO eq. 11) or score (the shaped reward)",
        )
        super().__post_init__()  # the policy-loss bounds
        for key in ("gamma", "lam"):
            require(0 <= getattr(self, key) <= 1, a + key, getattr(self, key), "in [0, 1]")


@dataclass
class CriticOptimConfig:
    lr: float = 1.0e-5
    min_lr: float = 1.0e-5
    warmup_ratio: float = 0.0

    def __post_init__(self) -> None:
        positive("critic.optim.lr", self.lr)
        require(0 <= self.min_lr <= self.lr, "critic.optim.min_lr", self.min_lr, f"in [0, critic.optim.lr={self.lr}]")
        require(0 <= self.warmup_ratio <= 1, "critic.optim.warmup_ratio", self.warmup_ratio, "in [0, 1]")


@dataclass
class CriticConfig:
    optim: CriticOptimConfig = field(default_factory=CriticOptimConfig)
    clip_range_value: float = 0.5
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        positive("critic.clip_range_value", self.clip_range_value)
        require(self.grad_clip >= 0, "critic.grad_clip", self.grad_clip, ">= 0")


@dataclass
class RLTrainerConfig(TrainerBaseConfig):
    """RL's ``trainer``: the shared fields (:class:`~afm_core.config.trainer.TrainerBaseConfig`, RL's defaults
    for the micro batch and the checkpoints) and these."""

    micro_batch_size: int = 2
    save_interval: int = 10
    keep_last: int = 2
    max_steps: int = 20
    rollout_data_dir: str | None = None
    val_before_train: bool = False
    test_freq: int = 0
    val_benchmarks: list[str] = field(default_factory=list)
    remove_padding: bool = True
    max_tokens_per_micro_batch: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_tokens_per_micro_batch is not None:
            at_least_one("trainer.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch)
        require(self.test_freq >= 0, "trainer.test_freq", self.test_freq, ">= 0 (0: off)")
        at_least_one("trainer.max_steps", self.max_steps)


@dataclass
class WeightSyncConfig:
    bucket_mb: int = 512

    def __post_init__(self) -> None:
        at_least_one("weight_sync.bucket_mb", self.bucket_mb)


def check_token_budget(max_tokens: int, max_prompt_len: int, longest_response: int, pp: int) -> None:
    """Micro batches by tokens (``trainer.max_tokens_per_micro_batch``, :func:`afm_core.rl.batch.token_micro_batches`)
    need a budget that holds the longest trajectory the rollout can return, ``data.max_prompt_len`` + the largest
    stage's ``max_response_len`` (a trajectory is never split over micro batches), and one pipeline stage (PP
    stages send activations of one fixed ``[seq_length, micro_batch_size]`` shape; the token path's micro batches
    vary in both).

    Raises:
        ConfigError: naming ``trainer.max_tokens_per_micro_batch``.
    """
    key = "trainer.max_tokens_per_micro_batch"
    longest = max_prompt_len + longest_response
    require(
        max_tokens >= longest,
        key,
        max_tokens,
        f"a micro batch must hold the longest trajectory: data.max_prompt_len + the largest stage's max_response_len "
        f"= {max_prompt_len} + {longest_response} = {longest} tokens",
    )
    require(pp == 1, key, max_tokens, f"micro batches by tokens need parallel.pp=1 (got {pp}), or null")


@dataclass
class ValConfig(SamplingConfig):
    """``val``: validation's settings, the eval job's ``eval.*`` (:class:`~afm_core.config.sampling.SamplingConfig`,
    verl's ``val_kwargs``: greedy, one sample), and the benchmark files validated besides ``trainer.val_benchmarks``."""

    k: int = 1
    temperature: float = 0.0
    benchmark_files: list[str] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    """The RL run's checkpoints, as :class:`afm_core.rl.checkpoint.Checkpointer` and the resume read them
    (:attr:`RLConfig.checkpoint`, from ``run_dir``, ``resume``, ``trainer.*`` and ``cluster.signal_delay_s``)."""

    run_dir: str
    resume: str | None
    save_interval: int  # rollout steps between checkpoints (and always at the last)
    keep_last: int
    export_hf: bool  # the policy as HF files in RUN_DIR/hf when the run completes
    signal_delay_s: int  # the lead of Slurm's USR2 (0: not checked)


@dataclass
class ValidationConfig:
    """Validation during RL (:attr:`RLConfig.validation`, from ``trainer.val_*``, ``trainer.test_freq``, ``val``
    and ``data_dir``), as :mod:`afm_core.rl.validation` reads it; ``eval``: ``val`` itself (:class:`ValConfig`)."""

    before_train: bool
    test_freq: int  # rollout steps between validations, and the last (0: off)
    presets: list[str]
    benchmark_files: list[str]
    eval: ValConfig
    data_dir: str | None

    @property
    def asked(self) -> bool:
        """Validation is asked for (before training or every ``test_freq`` steps)."""
        return self.before_train or self.test_freq > 0


@dataclass
class PolicyConfig:
    """The trainer side of the run (:attr:`RLConfig.policy`): what :mod:`afm_core.rl.policy_trainer`,
    :mod:`afm_core.rl.critic` and :mod:`afm_core.rl.batch` read."""

    algorithm: AlgorithmConfig
    trainer: RLTrainerConfig
    optim: OptimConfig
    parallel: ParallelConfig
    critic: CriticConfig
    n: int  # rollout.n: samples per prompt (a mini-batch is algorithm.mini_batch_size x n samples)
    temperature: float  # rollout.temperature: the engine's logprobs are after it, so are the trainer's
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # model.lora: adapters trained, the base the reference


@dataclass
class ActorConfig:
    """The rollout side of the run (:attr:`RLConfig.actor`): what :mod:`afm_core.rl.rollout_actor` reads; ``engine``,
    ``tools`` and ``tool_servers`` go on to the engine factory and the tool layer (below ``config``) as plain
    mappings (``dataclasses.asdict``)."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    colocation: ColocationConfig = field(default_factory=ColocationConfig)
    engine: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    tool_servers: ToolServersConfig = field(default_factory=ToolServersConfig)
    reward_fn: Any = None  # a plug-in ({_target_: ...}) or None
    precision: str = "auto"  # trainer.precision: the engine computes in the trainer's dtype
    run_dir: str = "."
    data_dir: str | None = None
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # model.lora: the engine serves the synced adapters


@dataclass
class RLConfig:
    """``conf/rl.yaml`` as composed. Every group is typed; ``cluster`` is checked against the schema its ``name``
    picks (:func:`~afm_core.config.cluster.cluster_schema`: ``Any`` to OmegaConf, a
    :data:`~afm_core.config.cluster.ClusterConfig` once checked); ``plan`` holds the submit-only ``+plan.force``
    (:func:`~afm_core.config.sft.check_plan_options`: a ``dict`` so that ``+`` can add it, as SFT's)."""

    run_dir: str = MISSING
    resume: str | None = None
    data_dir: str | None = None
    model: ModelConfig = MISSING
    engine: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    parallel: ParallelConfig = MISSING
    cluster: ClusterField = MISSING
    data: RLDataConfig = field(default_factory=RLDataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: RLTrainerConfig = field(default_factory=RLTrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    colocation: ColocationConfig = field(default_factory=ColocationConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    tool_servers: ToolServersConfig = field(default_factory=ToolServersConfig)
    plan: dict[str, Any] = field(default_factory=dict)
    val: ValConfig = field(default_factory=ValConfig)
    logger: list[str] = field(default_factory=lambda: ["console"])
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    reward_fn: Any = None  # a plug-in ({_target_: ...}), imported when the job builds its graders

    def __post_init__(self) -> None:
        check_loggers(self.logger)
        check_plan_options(self.plan)
        d = self.data
        require(bool(d.presets or d.files), "data.files", d.files, "RL prompts: name data.presets or data.files")
        check_context_length(self.model, d.max_prompt_len, self.rollout.longest_response)
        self.cluster = cluster_schema(self.cluster)
        m, p, a, r = self.model, self.parallel, self.algorithm, self.rollout
        groups = math.gcd(m.num_attention_heads, m.num_query_groups)
        require(
            groups % p.tp == 0,
            "parallel.tp",
            p.tp,
            f"must divide the attention and KV heads of {m.name}; valid: {divisors(groups)}",
        )
        require(m.num_layers % p.pp == 0, "parallel.pp", p.pp, f"valid: {divisors(m.num_layers)}")
        dp = self.cluster.data_parallel(p.model_parallel)
        if self.trainer.max_tokens_per_micro_batch is None:
            per_pass = dp * self.trainer.micro_batch_size
            require(
                (a.mini_batch_size * r.n) % per_pass == 0,
                "algorithm.mini_batch_size",
                a.mini_batch_size,
                f"x rollout.n = {a.mini_batch_size * r.n} samples must be a multiple of dp x "
                f"trainer.micro_batch_size = {dp} x {self.trainer.micro_batch_size}",
            )
        else:
            check_token_budget(self.trainer.max_tokens_per_micro_batch, d.max_prompt_len, r.longest_response, p.pp)
            require(
                a.mini_batch_size * r.n >= dp,
                "algorithm.mini_batch_size",
                a.mini_batch_size,
                f"x rollout.n = {a.mini_batch_size * r.n} samples must give each of dp = {dp} ranks a sample",
            )
        needed = collective_timeout_min(
            rollout_wait_s({"n": r.n, "timeout_s": r.timeout_s, "concurrency": r.concurrency}, a.gen_batch_size)
        )
        require(
            p.collective_timeout_min is None or p.collective_timeout_min >= needed,
            "parallel.collective_timeout_min",
            p.collective_timeout_min,
            f"ranks wait at a collective while another rank's rollouts run (rollout.timeout_s={r.timeout_s} per "
            f"wave): at least {needed} minutes, or null (sized from the rollout)",
        )
        require(
            not r.partial.enable or has_off_policy_correction(a),
            "rollout.partial.enable",
            r.partial.enable,
            "partial rollouts train tokens sampled under older weights: set an off-policy correction "
            "(algorithm.tis_cap, e.g. 2.0; algorithm.icepop_low/high, e.g. 0.5/5; or algorithm.geo_mask_low/high), "
            "or rollout.partial.enable=false",
        )
        require(
            not (r.partial.enable and r.environment == "simulated"),
            "rollout.partial.enable",
            r.partial.enable,
            "false with rollout.environment=simulated (the simulated observations come from the policy's engine, "
            "which a pause would cut short)",
        )
        if a.adv_estimator == "gae":
            require(r.n >= 1, "rollout.n", r.n, ">= 1")
        elif a.filter_groups or a.adv_estimator in ("grpo", "drgrpo"):
            require(r.n >= 2, "rollout.n", r.n, "GRPO compares samples of a group: >= 2")

    @property
    def checkpoint(self) -> CheckpointConfig:
        """The checkpoint settings (:class:`CheckpointConfig`)."""
        t = self.trainer
        return CheckpointConfig(self.run_dir, self.resume, t.save_interval, t.keep_last, t.export_hf,
                                self.cluster.signal_delay_s)  # fmt: skip

    @property
    def policy(self) -> PolicyConfig:
        """The trainer side's settings (:class:`PolicyConfig`)."""
        r = self.rollout
        return PolicyConfig(self.algorithm, self.trainer, self.optim, self.parallel, self.critic, r.n, r.temperature,
                            self.model.lora)  # fmt: skip

    @property
    def actor(self) -> ActorConfig:
        """The rollout side's settings (:class:`ActorConfig`)."""
        return ActorConfig(self.rollout, self.reward, self.judge, self.colocation, self.engine, self.tools,
                           self.tool_servers, self.reward_fn, self.trainer.precision,
                           self.run_dir, self.data_dir, self.model.lora)  # fmt: skip

    @property
    def validation(self) -> ValidationConfig:
        """The validation settings (:class:`ValidationConfig`)."""
        t = self.trainer
        return ValidationConfig(t.val_before_train, t.test_freq, list(t.val_benchmarks),
                                list(self.val.benchmark_files), self.val, self.data_dir)  # fmt: skip


def rl_config(cfg: DictConfig | Mapping[str, Any] | RLConfig) -> RLConfig:
    """The composed ``conf/rl.yaml`` as the job function receives it (Hydra's ``DictConfig``, or plain dicts and
    lists) as a checked :class:`RLConfig` (interpolations resolved); an :class:`RLConfig` as is (``jobs.rl``'s
    ``load_cfg``, :func:`~afm_core.config.checks.job_config`).

    Raises:
        ConfigError: as :func:`afm_core.config.check_config`.
    """
    return job_config(RLConfig, cfg)
