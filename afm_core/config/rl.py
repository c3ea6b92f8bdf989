"""The schema of ``conf/rl.yaml`` (``python -m jobs.rl``): data, rollout, reward, algorithm, critic, trainer and the
shared groups (model, parallel, optim, cluster), with the checks across them.

The value ranges are those DAPO and verl use (Yu et al. 2025, "DAPO", eq. 10-11: ``clip_ratio_low/high`` in
``(0, 1)`` ... decoupled clip bounds ``1 - eps_low``, ``1 + eps_high``; dual clip ``c > 1``, Ye et al. 2020;
verl ``verl/trainer/config/actor/actor.yaml`` ``clip_ratio_c`` default 3.0). Dynamic sampling keeps a group when
its ``algorithm.filter_groups_metric`` varies over the group's samples: ``acc`` (the task's 0/1 correctness, DAPO
eq. 11 and verl's recipe ``algorithm.filter_groups.metric=acc``) or ``score`` (the shaped reward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING

from afm_core.config.checks import at_least_one, divisors, instantiate, require
from afm_core.config.cluster import ClusterConfig, cluster_schema
from afm_core.config.engine import VLLMEngineConfig
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
REWARD_MODES = ("score_x_format", "score", "score_minus_format_penalty")
ENVIRONMENTS = ("real", "simulated")
TOOL_SERVER_START = ("auto", "always", "never")  # afm_core.tools.job_servers
COLOCATION_MODES = ("auto", "inprocess", "async")  # colocation.mode: afm_core.rl.colocation
#: algorithm.filter_groups_metric -> the field of the sample (afm_core.rl.grading.Sample) a kept group varies in
FILTER_METRICS = {"acc": "score", "score": "reward"}
#: algorithm.loss_agg_mode: verl ``verl/trainer/ppo/core_algos.py::agg_loss`` (afm_core.rl.losses.policy_loss,
#: which holds the same tuples: it imports no config)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
#: algorithm.kl_loss_type: verl ``core_algos.py::kl_penalty_forward`` names, aliases included (k1 = kl, k2 = mse,
#: k3 = low_var_kl); verl's straight-through ``+`` variants and ``full`` are not offered
KL_LOSS_TYPES = ("low_var_kl", "k3", "k1", "kl", "k2", "mse", "abs")


def _positive(key: str, value: Any) -> None:
    require(value is not None and value > 0, key, value, "a positive number")


@dataclass
class RLDataConfig:
    presets: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    skip: int = 0
    limit: int | None = None
    max_calculator_steps: int | None = None
    max_prompt_len: int = 1024

    def __post_init__(self) -> None:
        require(self.skip >= 0, "data.skip", self.skip, "an integer >= 0")
        if self.limit is not None:
            at_least_one("data.limit", self.limit)
        at_least_one("data.max_prompt_len", self.max_prompt_len)


@dataclass
class SimulatorConfig:
    model: str | None = None
    max_tokens: int = 256
    temperature: float | None = None

    def __post_init__(self) -> None:
        at_least_one("rollout.simulator.max_tokens", self.max_tokens)
        if self.temperature is not None:
            require(self.temperature >= 0, "rollout.simulator.temperature", self.temperature, ">= 0, or null")


STALE_ACTIONS = ("mask", "drop")  # rollout.partial.stale: afm_core.rl.rollout_buffer
STOP_ACTIONS = ("keep", "restart")  # rollout.partial.on_stop: afm_core.rl.train_batch


@dataclass
class PartialConfig:
    """``rollout.partial``: partial rollouts, the staleness bound and what a stop during generation keeps
    (:mod:`afm_core.rl.rollout_buffer`, :mod:`afm_core.rl.train_batch`).

    Attributes:
        enable: a generation round stops once the dynamic sampler can fill the train batch (or
            ``max_tokens_per_step`` is spent); its unfinished trajectories are paused into the rollout buffer and
            continued first, oldest first, in the next rollout step under the new weights.
        max_staleness: the largest lag (policy versions between a token's sampling and its training) allowed.
        stale: what happens past it: ``mask`` (the token leaves the loss) or ``drop`` (the trajectory is
            regenerated from its prompt when it would be resumed).
        max_tokens_per_step: a round also stops once this many tokens were sampled in the rollout step (per
            engine); None: no token budget.
        on_stop: a stop (USR2, preemption) during generation: ``keep`` (the round's finished groups go to the
            sampler, its trajectories in flight are paused into the buffer, both saved in the checkpoint and
            continued on resume) or ``restart`` (the round is thrown away and the state from before it saved:
            a resumed run is bitwise the uninterrupted one; for tests and debugging). With
            ``rollout.environment=simulated`` a stop restarts the round (the simulated observations come from the
            policy's own engine, which a pause would cut short).
    """

    enable: bool = False
    max_staleness: int = 1
    stale: str = "mask"
    max_tokens_per_step: int | None = None
    on_stop: str = "keep"

    def __post_init__(self) -> None:
        p = "rollout.partial."
        require(self.max_staleness >= 0, p + "max_staleness", self.max_staleness, "an integer >= 0")
        require(self.stale in STALE_ACTIONS, p + "stale", self.stale, "mask or drop")
        require(self.on_stop in STOP_ACTIONS, p + "on_stop", self.on_stop, "keep or restart")
        if self.max_tokens_per_step is not None:
            at_least_one(p + "max_tokens_per_step", self.max_tokens_per_step)


@dataclass
class ContextStage:
    max_response_len: int = MISSING
    until_step: int | None = None


@dataclass
class RolloutConfig:
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_len: int = 4096
    context_schedule: list[ContextStage] = field(default_factory=list)
    max_turns: int = 16
    max_tool_calls: int = 8
    timeout_s: float = 600
    concurrency: int = 64
    environment: str = "real"
    simulator: SimulatorConfig = field(default_factory=SimulatorConfig)
    partial: PartialConfig = field(default_factory=PartialConfig)

    def __post_init__(self) -> None:
        for key in ("n", "max_response_len", "max_turns", "concurrency"):
            at_least_one(f"rollout.{key}", getattr(self, key))
        require(self.max_tool_calls >= 0, "rollout.max_tool_calls", self.max_tool_calls, "an integer >= 0")
        require(self.temperature >= 0, "rollout.temperature", self.temperature, ">= 0")
        require(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "in (0, 1]")
        require(self.top_k == -1 or self.top_k >= 1, "rollout.top_k", self.top_k, "-1 (off) or >= 1")
        _positive("rollout.timeout_s", self.timeout_s)
        require(self.environment in ENVIRONMENTS, "rollout.environment", self.environment, "real or simulated")
        last = 0  # a stage runs for the rollout steps from the previous stage's until_step to its own (exclusive)
        for i, stage in enumerate(self.context_schedule):
            key = f"rollout.context_schedule[{i}]"
            at_least_one(f"{key}.max_response_len", stage.max_response_len)
            if stage.until_step is not None:
                valid = f"increasing: above the previous stage's ({last})" if i else "an integer >= 1"
                require(stage.until_step > last, f"{key}.until_step", stage.until_step, valid)
                last = stage.until_step
            else:
                require(i == len(self.context_schedule) - 1, f"{key}.until_step", None, "only the last stage has none")

    @property
    def longest_response(self) -> int:
        """The largest stage's ``max_response_len`` (tokens): ``max_response_len`` is the only stage when the
        schedule is empty, and unused otherwise (as ``afm_core.rl.schedule.build_stages`` reads them)."""
        return (
            max(s.max_response_len for s in self.context_schedule) if self.context_schedule else self.max_response_len
        )


@dataclass
class RewardConfig:
    mode: str = "score_x_format"
    format_penalty: float = 1.0
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    test_timeout_s: float = 10

    def __post_init__(self) -> None:
        require(self.mode in REWARD_MODES, "reward.mode", self.mode, f"one of {', '.join(REWARD_MODES)}")
        require(self.format_penalty >= 0, "reward.format_penalty", self.format_penalty, ">= 0")
        require(self.overlong_buffer_len >= 0, "reward.overlong_buffer_len", self.overlong_buffer_len, ">= 0 tokens")
        require(
            self.overlong_penalty_factor >= 0, "reward.overlong_penalty_factor", self.overlong_penalty_factor, ">= 0"
        )
        _positive("reward.test_timeout_s", self.test_timeout_s)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    train_batch_size: int = 16
    gen_batch_size: int = 16
    mini_batch_size: int = 8
    ppo_epochs: int = 1
    filter_groups: bool = True
    filter_groups_metric: str = "acc"
    max_num_gen_batches: int = 10
    allow_partial: bool = False
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float | None = None
    tis_cap: float | None = None
    icepop_low: float | None = None
    icepop_high: float | None = None
    geo_mask_low: float | None = None
    geo_mask_high: float | None = None
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    kl_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
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
        for key in ("clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, key)
            require(0 < value < 1, a + key, value, "in (0, 1): the PPO ratio is clipped to [1 - low, 1 + high]")
        if self.clip_ratio_c is not None:
            require(self.clip_ratio_c > 1, a + "clip_ratio_c", self.clip_ratio_c, "> 1 (dual clip), or null")
        if self.tis_cap is not None:
            require(self.tis_cap >= 1, a + "tis_cap", self.tis_cap, ">= 1, or null")
        for name in ("icepop", "geo_mask"):  # windows on pi_old / pi_rollout: per token; a sequence's geometric mean
            low, high = getattr(self, name + "_low"), getattr(self, name + "_high")
            if (low is None) != (high is None):
                unset, other = ("_low", "_high") if low is None else ("_high", "_low")
                require(False, a + name + unset, None, f"set with {a}{name}{other}: a window has both bounds")
            if low is not None:
                require(0 <= low <= 1, a + name + "_low", low, "in [0, 1]: the window holds ratio 1 (on-policy)")
                require(high >= 1 and high > low, a + name + "_high", high, f">= 1 and > {a}{name}_low={low}")
        require(
            self.loss_agg_mode in LOSS_AGG_MODES,
            a + "loss_agg_mode",
            self.loss_agg_mode,
            f"one of {', '.join(LOSS_AGG_MODES)}",
        )
        if self.loss_agg_mode == "seq-mean-token-sum-norm":
            require(
                self.loss_scale_factor is not None and self.loss_scale_factor > 0,
                a + "loss_scale_factor",
                self.loss_scale_factor,
                "a positive constant with loss_agg_mode=seq-mean-token-sum-norm (Dr. GRPO's: the generation "
                "budget in tokens, the stage's max_response_len, which verl's default worker divides by)",
            )
        else:
            require(
                self.loss_scale_factor is None,
                a + "loss_scale_factor",
                self.loss_scale_factor,
                "null unless loss_agg_mode=seq-mean-token-sum-norm (the only mode that reads it)",
            )
        require(
            self.kl_loss_type in KL_LOSS_TYPES,
            a + "kl_loss_type",
            self.kl_loss_type,
            f"one of {', '.join(KL_LOSS_TYPES)}",
        )
        for key in ("entropy_coeff", "kl_coef"):
            require(getattr(self, key) >= 0, a + key, getattr(self, key), ">= 0")
        for key in ("gamma", "lam"):
            require(0 <= getattr(self, key) <= 1, a + key, getattr(self, key), "in [0, 1]")


def has_off_policy_correction(algorithm: AlgorithmConfig) -> bool:
    """Whether the policy loss corrects for rollouts sampled off the trainer's policy (pi_rollout != pi_old):
    token TIS (``algorithm.tis_cap``), IcePop's token mask (``algorithm.icepop_low/high``) or the sequence-level
    geometric-mean mask (``algorithm.geo_mask_low/high``); see :func:`afm_core.rl.losses.policy_loss`. Rollouts
    continued across weight updates (partial rollouts) are refused without one."""
    return algorithm.tis_cap is not None or algorithm.icepop_low is not None or algorithm.geo_mask_low is not None


@dataclass
class CriticOptimConfig:
    lr: float = 1.0e-5
    min_lr: float = 1.0e-5
    warmup_ratio: float = 0.0

    def __post_init__(self) -> None:
        _positive("critic.optim.lr", self.lr)
        require(0 <= self.min_lr <= self.lr, "critic.optim.min_lr", self.min_lr, f"in [0, critic.optim.lr={self.lr}]")
        require(0 <= self.warmup_ratio <= 1, "critic.optim.warmup_ratio", self.warmup_ratio, "in [0, 1]")


@dataclass
class CriticConfig:
    optim: CriticOptimConfig = field(default_factory=CriticOptimConfig)
    clip_range_value: float = 0.5
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        _positive("critic.clip_range_value", self.clip_range_value)
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


@dataclass
class ColocationConfig:
    mode: str = "auto"
    sleep_level: int = 1
    offload_trainer: bool | None = None

    def __post_init__(self) -> None:
        require(self.mode in COLOCATION_MODES, "colocation.mode", self.mode, f"one of {', '.join(COLOCATION_MODES)}")
        require(self.sleep_level in (0, 1, 2), "colocation.sleep_level", self.sleep_level, "0, 1 or 2")


@dataclass
class JudgeConfig:
    url: str | None = None
    model: str | None = None
    api_key_env: str | None = None

    def __post_init__(self) -> None:
        require(
            self.url is None or bool(self.model), "judge.model", self.model, "the judge's model name (judge.url is set)"
        )


@dataclass
class ToolServersConfig:
    start: str = "auto"
    wait_s: float = 0
    servers: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(self.start in TOOL_SERVER_START, "tool_servers.start", self.start, "auto, always or never")
        require(self.wait_s >= 0, "tool_servers.wait_s", self.wait_s, "seconds >= 0")


def check_context_length(model: Any, max_prompt_len: int, longest_response: int) -> None:
    """The rollout engine's context, ``data.max_prompt_len`` + the largest stage's ``max_response_len`` (vLLM's
    ``max_model_len``), must fit the model's positions: vLLM refuses a longer ``max_model_len`` at start, after the
    queue (it allows more only with RoPE scaling such as YaRN, which the Megatron conversion does not reproduce:
    :func:`afm_core.models.arch.hf_rope_scaling`).

    Raises:
        ConfigError: naming the three numbers and what to lower.
    """
    limit = int(model.max_position_embeddings)
    total = max_prompt_len + longest_response
    require(
        total <= limit,
        "rollout.max_response_len",
        longest_response,
        f"data.max_prompt_len + the largest stage's max_response_len = {max_prompt_len} + {longest_response} = "
        f"{total} tokens (vLLM max_model_len) > model.max_position_embeddings = {limit} of {model.name}; lower "
        f"rollout.max_response_len / rollout.context_schedule to at most {limit - max_prompt_len} or "
        f"data.max_prompt_len",
    )


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
        return PolicyConfig(self.algorithm, self.trainer, self.optim, self.parallel, self.critic, r.n, r.temperature)

    @property
    def actor(self) -> ActorConfig:
        """The rollout side's settings (:class:`ActorConfig`)."""
        return ActorConfig(self.rollout, self.reward, self.judge, self.colocation, self.engine, self.tools,
                           self.tool_servers, self.reward_fn, self.trainer.precision,
                           self.run_dir, self.data_dir)  # fmt: skip

    @property
    def validation(self) -> ValidationConfig:
        """The validation settings (:class:`ValidationConfig`)."""
        t = self.trainer
        return ValidationConfig(t.val_before_train, t.test_freq, list(t.val_benchmarks),
                                list(self.val.benchmark_files), self.val, self.data_dir)  # fmt: skip


def rl_config(cfg: Any) -> RLConfig:
    """The composed ``conf/rl.yaml`` as the job function receives it (Hydra's ``DictConfig``, or plain dicts and
    lists) as a checked :class:`RLConfig` (interpolations resolved); an :class:`RLConfig` as is.

    Raises:
        ConfigError: as :func:`afm_core.config.check_config`.
    """
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, RLConfig):
        return cfg
    return instantiate(
        RLConfig, OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    )
