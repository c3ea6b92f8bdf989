"""The schema of ``conf/sft.yaml``: trainer, optim, parallel and model groups, and the checks across them.

Each group's ``__post_init__`` checks its own ranges; :class:`SFTConfig` checks what spans groups: attention
heads and KV heads divisible by ``parallel.tp``, layers by ``parallel.pp * parallel.vpp`` (Megatron-core's
``TransformerConfig`` and ``get_num_layers_to_build`` fail on the same conditions, but only once the model is
built), and ``trainer.global_batch_size`` divisible by ``trainer.micro_batch_size * dp``.

At run time each rank of ``jobs.sft`` checks the job's config into an :class:`SFTConfig` (:func:`sft_config`);
``afm_core.train.sft.run_sft`` hands the SFT loop and its engine their view of it (:attr:`SFTConfig.loop`, a
:class:`LoopConfig`) and the data module, the model build and the distributed init their own groups.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING

from afm_core.config.checks import ConfigError, divisors, job_config, require
from afm_core.config.cluster import cluster_schema
from afm_core.config.data import DataConfig
from afm_core.config.lora import LoRAConfig
from afm_core.config.tracking import ProfileConfig, TrackingConfig, check_loggers
from afm_core.config.trainer import TrainerBaseConfig

ENGINES = ("megatron", "deepspeed")
OBJECTIVES = ("sft", "contrastive")  # afm_core.train.objective
CONTRASTIVE_REDUCTIONS = ("sum", "mean")  # afm_core.train.contrastive: log P(branch) summed or averaged
LR_SCHEDULES = ("cosine", "constant")
RECOMPUTE = (None, "selective", "full")


def check_plan_options(plan: dict[str, Any]) -> None:
    """``plan`` (added with ``+plan.force=true``): only ``force``, a bool."""
    for key, value in plan.items():
        require(key == "force", f"plan.{key}", value, "the only plan option is plan.force")
        require(isinstance(value, bool), "plan.force", value, "true or false")


def _at_least(key: str, value: Any, low: float) -> None:
    require(value >= low, key, value, f"must be >= {low}")


@dataclass
class TrainerConfig(TrainerBaseConfig):
    """SFT's ``trainer``: the shared fields (:class:`~afm_core.config.trainer.TrainerBaseConfig`) and these."""

    engine: str = "megatron"
    objective: str = "sft"
    deepspeed_config: str | None = None
    max_steps: int | None = None
    epochs: float | None = None
    seq_length: int = 1024
    global_batch_size: int = 1
    log_interval: int = 1
    eval_interval: int = 1
    eval_sequences: int = 1
    progress: bool = True
    compile: bool | None = None
    compile_layers: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.engine in ENGINES, "trainer.engine", self.engine, f"one of {', '.join(ENGINES)}")
        require(self.objective in OBJECTIVES, "trainer.objective", self.objective, f"one of {', '.join(OBJECTIVES)}")
        require(self.seq_length > 0, "trainer.seq_length", self.seq_length, "a positive integer (tokens)")
        for key in ("global_batch_size", "log_interval", "eval_interval", "eval_sequences"):
            _at_least(f"trainer.{key}", getattr(self, key), 1)
        require(
            self.global_batch_size % self.micro_batch_size == 0,
            "trainer.global_batch_size",
            self.global_batch_size,
            f"a multiple of trainer.micro_batch_size={self.micro_batch_size}",
        )
        require(
            self.max_steps is not None or self.epochs is not None,
            "trainer.max_steps",
            self.max_steps,
            "set trainer.max_steps or trainer.epochs",
        )
        if self.max_steps is not None:
            _at_least("trainer.max_steps", self.max_steps, 1)
        if self.epochs is not None:
            require(self.epochs > 0, "trainer.epochs", self.epochs, "a positive number, or null")


@dataclass
class OptimConfig:
    lr: float = 1.0e-4
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1.0e-8
    warmup_ratio: float = 0.0
    lr_schedule: str = "cosine"

    def __post_init__(self) -> None:
        require(self.lr > 0, "optim.lr", self.lr, "a positive learning rate")
        require(0 <= self.min_lr <= self.lr, "optim.min_lr", self.min_lr, f"in [0, optim.lr={self.lr}]")
        _at_least("optim.weight_decay", self.weight_decay, 0.0)
        for key in ("adam_beta1", "adam_beta2"):
            value = getattr(self, key)
            require(0 <= value < 1, f"optim.{key}", value, "in [0, 1)")
        require(self.adam_eps > 0, "optim.adam_eps", self.adam_eps, "a positive number")
        require(0 <= self.warmup_ratio <= 1, "optim.warmup_ratio", self.warmup_ratio, "in [0, 1] (of the steps)")
        require(
            self.lr_schedule in LR_SCHEDULES, "optim.lr_schedule", self.lr_schedule, f"one of {', '.join(LR_SCHEDULES)}"
        )


@dataclass
class ParallelConfig:
    """``dp = world_size / (tp * pp)``. ``cp`` (context parallelism) is not implemented: nothing slices the
    sequence per CP rank, so only ``cp=1`` is accepted and ``conf/parallel`` does not list it."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False
    recompute: str | None = None
    distributed_optimizer: bool = False
    cp: int = 1
    collective_timeout_min: int | None = None

    def __post_init__(self) -> None:
        _at_least("parallel.tp", self.tp, 1)
        _at_least("parallel.pp", self.pp, 1)
        require(
            self.cp == 1,
            "parallel.cp",
            self.cp,
            "context parallelism is not implemented (no per-rank sequence slicing); the only valid value is 1",
        )
        if self.vpp is not None:
            _at_least("parallel.vpp", self.vpp, 1)
            require(
                self.pp > 1,
                "parallel.vpp",
                self.vpp,
                "virtual pipeline stages need parallel.pp > 1; valid: null with pp=1",
            )
        require(self.recompute in RECOMPUTE, "parallel.recompute", self.recompute, "null, selective or full")
        if self.collective_timeout_min is not None:
            _at_least("parallel.collective_timeout_min", self.collective_timeout_min, 1)

    @property
    def model_parallel(self) -> int:
        """Ranks per model replica: ``tp * pp``."""
        return self.tp * self.pp


def _model_post_init(self: Any) -> None:
    from afm_core.models.presets import PresetError, load_preset

    try:
        load_preset(asdict(self))
    except PresetError as err:
        raise ConfigError(str(err)) from None


def _model_config_schema() -> type:
    """``ModelConfig``: a ``conf/model`` preset, its keys derived from the one declaration of the architecture
    (:class:`afm_core.models.arch.ModelArch`: each field with its type; ``rope_scaling`` as ``Any``) after
    ``name``, ``source`` and ``hf_path``, then ``lora`` (:class:`~afm_core.config.lora.LoRAConfig`: the run's
    adapters, off by default). The value checks are :func:`afm_core.models.presets.load_preset`'s."""
    from afm_core.models.arch import ARCH_FIELD_TYPES, ARCH_FIELDS

    specs: list[tuple[str, Any, Any]] = [
        ("name", str, field(default=MISSING)),
        ("source", str, field(default=MISSING)),
        ("hf_path", str | None, field(default=None)),
    ]
    for name in ARCH_FIELDS:
        kind = ARCH_FIELD_TYPES[name]
        if kind in (int, float, bool, str):
            specs.append((name, kind, field(default=MISSING)))
        else:  # rope_scaling: a mapping or null
            specs.append((name, Any, field(default=None)))
    specs.append(("lora", LoRAConfig, field(default_factory=LoRAConfig)))  # the run's adapters, not the preset's
    schema = make_dataclass(
        "ModelConfig",
        specs,
        namespace={"__post_init__": _model_post_init, "__doc__": _model_config_schema.__doc__},
    )
    schema.__module__ = __name__
    return schema


if TYPE_CHECKING:
    ModelConfig = Any
else:
    ModelConfig = _model_config_schema()


@dataclass
class ContrastiveConfig:
    """``contrastive``: AutoCoA stage 1 (``trainer.objective=contrastive``, :mod:`afm_core.train.contrastive`)."""

    aux_sft_coef: float = 0.2
    reduction: str = "sum"
    max_pairs: int | None = 1500
    max_heldout_pairs: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _at_least("contrastive.aux_sft_coef", self.aux_sft_coef, 0.0)
        require(
            self.reduction in CONTRASTIVE_REDUCTIONS,
            "contrastive.reduction",
            self.reduction,
            f"one of {', '.join(CONTRASTIVE_REDUCTIONS)}",
        )
        for key in ("max_pairs", "max_heldout_pairs"):
            if getattr(self, key) is not None:
                _at_least(f"contrastive.{key}", getattr(self, key), 1)


@dataclass
class LoopConfig:
    """What the SFT loop and its engine read (:attr:`SFTConfig.loop`): :class:`afm_core.train.loop.SFTLoop`,
    Megatron's :class:`~afm_core.train.trainer.SFTTrainer`, DeepSpeed's ``DeepSpeedSFTTrainer`` and
    ``train_deepspeed``. Built from a whole run's config by :attr:`SFTConfig.loop`; a test or a benchmark that
    trains a model of its own checks just these groups (:func:`afm_core.config.check_config` with this class).

    Attributes:
        model: the ``model`` preset; its architecture gives the step's model FLOPs and MFU
            (:mod:`afm_core.engine.flops`); None: not measured (``tflops`` and ``mfu`` logged as None).
        logged: the run's whole config as the tracking backends record it (``tracking.json``, read back by
            ``jobs.export``); empty: these groups.
    """

    trainer: TrainerConfig = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    contrastive: ContrastiveConfig = field(default_factory=ContrastiveConfig)
    model: ModelConfig | None = None
    logger: list[str] = field(default_factory=lambda: ["console"])
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    logged: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_loggers(self.logger)


@dataclass
class SFTConfig:
    """``conf/sft.yaml`` as composed (model, data, parallel, cluster, trainer, optim)."""

    run_dir: str = MISSING
    resume: str | None = None
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    parallel: ParallelConfig = MISSING
    cluster: Any = MISSING  # conf/cluster/<name>.yaml: checked against its schema by name (config.cluster)
    trainer: TrainerConfig = MISSING
    optim: OptimConfig = MISSING
    contrastive: ContrastiveConfig = field(default_factory=ContrastiveConfig)
    logger: list[str] = field(default_factory=lambda: ["console"])
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    plan: dict[str, Any] = field(default_factory=dict)  # +plan.force=true: submit what the plan says does not fit

    def __post_init__(self) -> None:
        check_plan_options(self.plan)
        self.cluster = cluster_schema(self.cluster)
        check_loggers(self.logger)
        m, p, t = self.model, self.parallel, self.trainer
        groups = math.gcd(m.num_attention_heads, m.num_query_groups)
        require(
            groups % p.tp == 0,
            "parallel.tp",
            p.tp,
            f"must divide model.num_attention_heads={m.num_attention_heads} and model.num_query_groups="
            f"{m.num_query_groups} ({m.name}); valid: {divisors(groups)}",
        )
        require(
            m.num_layers % p.pp == 0,
            "parallel.pp",
            p.pp,
            f"must divide model.num_layers={m.num_layers} ({m.name}); valid: {divisors(m.num_layers)}",
        )
        if p.vpp is not None:
            per_stage = m.num_layers // p.pp
            require(
                per_stage % p.vpp == 0,
                "parallel.vpp",
                p.vpp,
                f"must divide the {per_stage} layers per pipeline stage; valid: {divisors(per_stage)}",
            )
        if t.objective == "contrastive":
            require(
                t.engine == "megatron" and self.data.pack,
                "trainer.objective",
                t.objective,
                "the contrastive pairs need trainer.engine=megatron and data.pack=true (a pair's two documents "
                "share a packed sequence)",
            )
        if t.engine == "deepspeed":
            require(
                p.tp == 1 and p.pp == 1,
                "parallel.tp",
                p.tp,
                "trainer.engine=deepspeed is data parallel only (ZeRO-3): parallel.tp=1 and parallel.pp=1",
            )
        if m.lora.enabled:
            require(
                t.engine == "megatron" and not p.sequence_parallel,
                "model.lora.rank",
                m.lora.rank,
                "LoRA runs on trainer.engine=megatron without parallel.sequence_parallel (afm_core.models.lora)",
            )
        if t.compile_layers and t.engine == "megatron":  # the trainer refuses it off CUDA; here before the queue
            require(
                self.cluster.gpus_per_node != 0,
                "trainer.compile_layers",
                t.compile_layers,
                "compiled layers run on CUDA only, and cluster.gpus_per_node=0 makes this a CPU job: set the GPUs "
                "per node, or trainer.compile_layers=false",
            )
        dp = self.cluster.data_parallel(p.model_parallel)
        per_pass = t.micro_batch_size * dp
        require(
            t.global_batch_size % per_pass == 0,
            "trainer.global_batch_size",
            t.global_batch_size,
            f"must be a multiple of trainer.micro_batch_size * dp = {t.micro_batch_size} * {dp} = {per_pass}",
        )

    @property
    def dp(self) -> int:
        """Data-parallel ranks of the job."""
        return self.cluster.data_parallel(self.parallel.model_parallel)

    @property
    def loop(self) -> LoopConfig:
        """The SFT loop's and its engine's view (:class:`LoopConfig`): this config's groups of the same names,
        logging this whole config."""
        groups = {f.name: getattr(self, f.name) for f in fields(LoopConfig) if f.name != "logged"}
        return LoopConfig(**groups, logged=asdict(self))


def sft_config(cfg: Any) -> SFTConfig:
    """The composed ``conf/sft.yaml`` as the job function receives it (Hydra's ``DictConfig``, or plain dicts and
    lists) as a checked :class:`SFTConfig` (interpolations resolved); an :class:`SFTConfig` as is. ``jobs.sft``'s
    ranks call it (``load_cfg``, :class:`afm_core.launch.requeue.RequeueableJob`), as ``jobs.rl``'s call
    :func:`afm_core.config.rl.rl_config`.

    Raises:
        ConfigError: as :func:`afm_core.config.check_config`.
    """
    return job_config(SFTConfig, cfg)
