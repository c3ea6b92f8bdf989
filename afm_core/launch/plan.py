"""The dry run of an SFT or RL job: per-rank GPU memory, whether it fits, the weight-sync plan and the checkpoint
cost, computed before the queue (``python -m jobs.plan``; every ``cluster=slurm`` submission runs it first:
:mod:`afm_core.launch.plan_gate`).

Model states come from the model built on the meta device in a fake process group of the job's world size, and
activations from the per-layer formula (:mod:`afm_core.engine.memory`). For RL the colocated vLLM engine adds its
share: at start vLLM claims ``engine.gpu_memory_utilization`` of each GPU (weights ``2 N / engine TP`` in bf16, the
rest KV cache, which must hold at least one sequence of ``max_model_len`` tokens, vLLM's own start check), and
while the trainer runs it sleeps (``colocation.sleep_level`` 1: weights to host memory, KV cache dropped;
vLLM docs, "Sleep Mode"). The peak per GPU is the larger of the generation phase (trainer states + the engine)
and the training phase (trainer states + activations + what the sleeping engine keeps), plus
:data:`~afm_core.launch.plan_estimates.GPU_OVERHEAD_BYTES`.

A checkpoint holds the parameters in the training dtype and the optimizer's fp32 master weights and two Adam
moments (14 bytes per parameter in bf16, 12 in fp32); its write time is its size over the write speed per node
(``cluster.checkpoint_write_gb_s`` when set, else measured: :func:`afm_core.launch.plan_probe.write_speed`, in a
thread while the model states are built), and it must fit in the ``--signal=USR2@cluster.signal_delay_s`` lead time.

With LoRA (``model.lora.rank`` > 0) the planned layout is the adapter one: the base frozen in the training dtype
(no gradients, no master weights, no Adam moments), the adapters trained (``r * (in + out)`` per targeted linear,
:func:`~afm_core.launch.plan_estimates.lora_adapter_params`) and their saved tensors added to the activations,
on megatron's local layer spec (the one :mod:`afm_core.models.lora` adapts). ``lora`` in the plan sets the full
layout of the same parallel settings beside it (per-GPU peaks and their ratio), the weight sync's bytes (the
PEFT adapter alone against every HF weight) and the adapter's export size; the KL reference is no second copy
(the base with the adapters disabled), and the checkpoint holds the adapters and their optimizer state only.
Without adapters, an RL job with ``algorithm.kl_coef`` > 0 holds the frozen reference policy's copy of the
parameters on every GPU (:func:`~afm_core.launch.plan_estimates.add_reference`).

The parts: this module composes and checks a job's config (:func:`compose`, :func:`plan_config`: the job's
checked :class:`~afm_core.config.sft.SFTConfig` or :class:`~afm_core.config.rl.RLConfig`, as ``jobs.sft`` and
``jobs.rl`` check it), reads it (:func:`layout_of`, :func:`hf_config_of`) and assembles the plan
(:func:`make_plan`, :func:`suggest`), handing each estimate the groups it reads;
:mod:`~afm_core.launch.plan_estimates` holds the memory and size models (arithmetic on plain values),
:mod:`~afm_core.launch.plan_probe` the disk write probe, :mod:`~afm_core.launch.plan_render` the table and
``plan.json``, :mod:`~afm_core.launch.plan_gate` the refusal before ``sbatch``. It is one module over 400 lines
because it is one thing, the assembly of a plan from a checked config: every number it puts in comes from the
estimates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from afm_core.config import ConfigError, register_schemas
from afm_core.config.checks import instantiate
from afm_core.config.cluster import DEFAULT_GPU_MEMORY_GB, ClusterConfig, SlurmClusterConfig
from afm_core.config.lora import LoRAConfig
from afm_core.config.rl import RLConfig
from afm_core.config.sft import ModelConfig, ParallelConfig, SFTConfig
from afm_core.launch.executor import visible_gpus
from afm_core.launch.plan_estimates import (
    GPU_OVERHEAD_BYTES,
    PARALLEL_FIELDS,
    REPORTED_GPUS,
    Layout,
    add_reference,
    as_gib,
    checkpoint_bytes,
    checkpoint_estimate,
    gpu_total_bytes,
    host_plan,
    lora_adapter_params,
    lora_sync_summary,
    numel,
    training_plan,
    vllm_plan,
    weight_sync_plan,
)
from afm_core.launch.plan_probe import write_speed
from afm_core.models.arch import ModelArch, arch_from_hf_config, hf_config_from_arch
from afm_core.models.presets import load_preset
from afm_core.utils.hardware import bf16_is_fast
from afm_core.utils.paths import repo_root

APPS = ("sft", "rl")
#: The checked config of a job the plan reads, by app.
SCHEMAS: dict[str, type[SFTConfig] | type[RLConfig]] = {"sft": SFTConfig, "rl": RLConfig}

#: ``data.files`` of an RL config planned without prompts (the schema asks for some; the plan never opens them).
UNREAD_PROMPTS = "<prompts: not read by jobs.plan>"

JobConfig = SFTConfig | RLConfig


def compose(app: str, overrides: Sequence[str]) -> DictConfig:
    """``conf/<app>.yaml`` composed with Hydra ``overrides`` (``run_dir`` left unresolved), the typed schemas
    registered first (:func:`afm_core.config.register_schemas`)."""
    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        return hydra_compose(config_name=app, overrides=list(overrides))


def plan_config(app: str, overrides: Sequence[str]) -> JobConfig:
    """The checked config of an ``app`` job (:data:`SCHEMAS`) composed with ``overrides``, as ``jobs.sft`` /
    ``jobs.rl`` check it before submitting. Composed outside a Hydra run, ``run_dir``'s default
    ``${hydra:runtime.output_dir}`` has no value: the plan then takes the working folder (where its write probe
    measures; a ``run_dir=`` override is kept). The plan reads no prompts: an RL recipe that leaves them to the
    command line (``data.files``, ``data.presets``) is planned with :data:`UNREAD_PROMPTS` in their place.

    Raises:
        afm_core.config.ConfigError: a value the schema refuses (a ValueError; the message names the key).
    """
    plain = OmegaConf.to_container(compose(app, overrides), resolve=False)
    assert isinstance(plain, dict)
    if "${" in str(plain.get("run_dir")):
        plain["run_dir"] = "."
    data = plain.get("data") or {}
    if app == "rl" and not (data.get("presets") or data.get("files")):
        plain["data"] = {**data, "files": [UNREAD_PROMPTS]}
    return instantiate(SCHEMAS[app], plain)


def app_of(job: JobConfig) -> str:
    """``rl`` for an :class:`RLConfig`, else ``sft``."""
    return "rl" if isinstance(job, RLConfig) else "sft"


def infer_app(overrides: Sequence[str]) -> str:
    """``rl`` when the ``recipe=`` override names a recipe with ``rollout`` or ``algorithm`` settings, else ``sft``."""
    for item in overrides:
        if item.startswith("recipe="):
            path = repo_root() / "conf" / "recipe" / f"{item.split('=', 1)[1]}.yaml"
            if path.is_file():
                keys = yaml.safe_load(path.read_text()) or {}
                if "rollout" in keys or "algorithm" in keys:
                    return "rl"
    return "sft"


def layout_of(job: JobConfig, parallel: ParallelConfig | None = None) -> Layout:
    """The plan's view of a checked SFT or RL config, with ``parallel`` in place of ``job.parallel`` when given
    (a layout :func:`suggest` tries). RL's micro batches are ``trainer.micro_batch_size`` trajectories of
    ``data.max_prompt_len`` + the largest stage's ``max_response_len`` tokens, or, with
    ``trainer.max_tokens_per_micro_batch``, that many tokens packed (as many micro batches as a mini-batch of
    full-length trajectories fills).

    Raises:
        afm_core.config.ConfigError: the cluster's ranks are not a multiple of ``parallel``'s ``tp * pp``.
    """
    cluster, p = job.cluster, parallel or job.parallel
    world = p.model_parallel * cluster.data_parallel(p.model_parallel)
    slurm = cluster if isinstance(cluster, SlurmClusterConfig) else None
    gpus_per_node = slurm.gpus_per_node if slurm else visible_gpus()
    on_gpu = gpus_per_node > 0
    dp = world // (p.tp * p.pp * p.cp)
    mbs = job.trainer.micro_batch_size
    max_tokens: int | None = None
    if isinstance(job, RLConfig):
        t = job.trainer
        seq_length = job.data.max_prompt_len + job.rollout.longest_response
        samples = job.algorithm.mini_batch_size * job.rollout.n
        num_microbatches = max(1, samples // (dp * mbs))
        if t.max_tokens_per_micro_batch:  # micro batches by tokens: at most max_tokens packed, as many as needed
            max_tokens = t.max_tokens_per_micro_batch
            num_microbatches = max(1, -(-samples * seq_length // (dp * max_tokens)))
    else:
        seq_length = job.trainer.seq_length
        num_microbatches = max(1, job.trainer.global_batch_size // (dp * mbs))
    precision = job.trainer.precision
    lora = job.model.lora
    return Layout(
        app=app_of(job),
        world_size=world,
        nodes=slurm.nodes if slurm else 1,
        gpus_per_node=gpus_per_node,
        on_gpu=on_gpu,
        **{name: getattr(p, name) for name in PARALLEL_FIELDS},
        bf16=precision == "bf16" or (precision == "auto" and bf16_is_fast(on_gpu)),  # a CPU job: this host's CPU
        seq_length=seq_length,
        micro_batch_size=mbs,
        num_microbatches=num_microbatches,
        gpu_gb=float(slurm.gpu_memory_gb if slurm else DEFAULT_GPU_MEMORY_GB),  # a local cluster names no size
        transformer_engine=on_gpu and not lora.enabled,  # LoRA adapts the local spec's linears
        max_tokens_per_micro_batch=max_tokens,
        lora_rank=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        lora_targets=tuple(lora.target_modules) if lora.enabled else (),
    )


def hf_config_of(model: ModelConfig | Mapping[str, Any]) -> Any:
    """The transformers config of a ``model`` preset (the checked group, or its plain mapping): its
    ``config.json`` when ``hf_path`` has one, else the preset's architecture."""
    preset = dict(model) if isinstance(model, Mapping) else dataclasses.asdict(model)
    hf_path = preset.get("hf_path")
    if hf_path and (Path(hf_path) / "config.json").is_file():
        from transformers import AutoConfig  # heavy (seconds): only a preset with local HF files reads it

        return AutoConfig.from_pretrained(hf_path, local_files_only=True)
    return hf_config_from_arch(load_preset(preset).arch)


def make_plan(job: JobConfig, parallel: ParallelConfig | None = None) -> dict[str, Any]:
    """The plan of a checked config (see the module docstring and :func:`afm_core.launch.plan_render.render`),
    with ``parallel`` in place of ``job.parallel`` when given. With ``model.lora`` on, ``lora`` sets the adapter
    layout beside the full layout of the same parallel settings (:func:`lora_plan`).

    Raises:
        ValueError / afm_core.config.ConfigError: the layout does not split the model or the world.
    """
    app = app_of(job)
    layout = layout_of(job, parallel)
    hf_config = hf_config_of(job.model)
    arch = arch_from_hf_config(hf_config)
    sync = weight_sync_plan(arch, layout.tp, layout.pp, layout.vpp)
    total_params = sum(numel(row["shape"]) for row in sync)
    lora = job.model.lora
    trained = lora_adapter_params(arch, lora.rank, lora.target_modules) if lora.enabled else total_params
    full_layout = dataclasses.replace(layout, lora_rank=0, lora_targets=(), transformer_engine=layout.on_gpu)
    with ThreadPoolExecutor(1) as pool:  # the disk's write probe (mostly waiting on fsync) while the model is built
        speed = pool.submit(write_speed, checkpoint_bytes(trained, layout.bf16), job.run_dir,
                            configured_write_speed(job.cluster))  # fmt: skip
        stages = training_plan(hf_config, layout)
        full_stages = training_plan(hf_config, full_layout) if lora.enabled else stages
        write = speed.result()
    engine = None
    if isinstance(job, RLConfig):
        engine = vllm_plan(arch, job.engine, job.colocation.sleep_level, layout.seq_length, total_params,
                           lora_params=trained if lora.enabled else 0)  # fmt: skip
        if job.algorithm.kl_coef > 0:  # the KL reference: a frozen copy, or with adapters the base itself
            add_reference(full_stages, 2 if layout.bf16 else 4)  # (full_stages is stages without adapters)
    plan: dict[str, Any] = {
        "app": app,
        "model": job.model.name,
        "total_params": total_params,
        "trained_params": trained,
        "layout": {**layout.__dict__, "dp": layout.dp},
        "stages": stages,
        "notes": [],
    }
    bucket = job.weight_sync.bucket_mb * 2**20 if isinstance(job, RLConfig) else 0
    phases, state_max = gpu_phases(stages, engine, bucket)
    verdicts = gpu_verdicts(phases, layout.seq_length, engine)
    if engine is not None:
        plan["vllm"] = engine
    plan["gpus"] = verdicts
    plan["target_gpu_gb"] = layout.gpu_gb
    target = verdicts.get(str(int(layout.gpu_gb)))
    if target is None:
        peak = max(max(v.values()) for v in phases.values()) + GPU_OVERHEAD_BYTES
        target = {"peak_bytes": peak, "fits": peak <= gpu_total_bytes(layout.gpu_gb), "why_not": []}
    plan["fits"] = bool(target["fits"]) if layout.on_gpu else None
    plan["weight_sync"] = sync if app == "rl" else []
    if lora.enabled:
        full_engine = None
        if isinstance(job, RLConfig):
            full_engine = vllm_plan(arch, job.engine, job.colocation.sleep_level, layout.seq_length, total_params)
        full_phases, _ = gpu_phases(full_stages, full_engine, bucket)
        full_gpus = gpu_verdicts(full_phases, layout.seq_length, full_engine)
        plan["lora"] = lora_plan(lora, arch, stages, verdicts, full_stages, full_gpus, sync)
        if layout.on_gpu:
            plan["notes"].append(
                "LoRA runs megatron's local layer spec (afm_core.models.lora adapts its linears, not "
                "transformer-engine's): the LoRA layout is planned with it, the full layout with transformer-engine"
            )
    if isinstance(job, RLConfig):
        plan["host"] = rl_host_plan(job, layout, state_max, engine["weights_bytes"] if engine else 0)
        if plan["host"]["note"]:
            plan["notes"].append(plan["host"]["note"])
    ckpt = checkpoint_plan(job.cluster, job.run_dir, layout, total_params, write, trained_params=trained)
    plan["checkpoint"] = ckpt
    if ckpt["lead_warning"]:
        plan["notes"].append(ckpt["lead_warning"])
    return plan


def gpu_phases(
    stages: list[dict[str, Any]], engine: dict[str, Any] | None, bucket_bytes: int
) -> tuple[dict[str, dict[str, int]], int]:
    """Per reported GPU size, the bytes of each phase of a step (SFT: training; RL: generation, weight sync and
    training, the module docstring), and the largest rank's model states (with the KL reference's copy)."""
    state_max = max(row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"] + row.get("reference_bytes", 0)
                    for row in stages)  # fmt: skip
    train_max = max(row["train_bytes"] for row in stages)
    if engine is None:
        return {str(gb): {"training": train_max} for gb in REPORTED_GPUS}, state_max
    phases = {}
    for gb in REPORTED_GPUS:
        e = engine["per_gpu"][str(gb)]
        phases[str(gb)] = {
            "generation": state_max + e["claimed_bytes"],
            "weight_sync": state_max + engine["weights_bytes"] + bucket_bytes,
            "training": train_max + e["asleep_bytes"],
        }
    return phases, state_max


def gpu_verdicts(
    phases: dict[str, dict[str, int]], max_model_len: int, engine: dict[str, Any] | None
) -> dict[str, dict[str, Any]]:
    """Per reported GPU size: the peak (the largest phase + :data:`GPU_OVERHEAD_BYTES`), whether it fits and why
    not (the peak over the GPU's memory; an engine whose KV cache cannot hold one sequence of ``max_model_len``)."""
    verdicts = {}
    for gb in REPORTED_GPUS:
        peak = max(phases[str(gb)].values()) + GPU_OVERHEAD_BYTES
        reasons = []
        if peak > gpu_total_bytes(gb):
            reasons.append(f"peak {as_gib(peak)} GiB > {as_gib(gpu_total_bytes(gb))} GiB")
        if engine is not None and engine["per_gpu"][str(gb)]["sequences_at_max_model_len"] < 1:
            reasons.append(f"vLLM's KV cache cannot hold one sequence of max_model_len {max_model_len}")
        verdicts[str(gb)] = {
            "peak_bytes": peak,
            "peak_gib": as_gib(peak),
            "gpu_gib": as_gib(gpu_total_bytes(gb)),
            "phases_gib": {k: as_gib(v) for k, v in phases[str(gb)].items()},
            "fits": not reasons,
            "why_not": reasons,
        }
    return verdicts


def lora_plan(
    lora: LoRAConfig,
    arch: ModelArch,
    stages: list[dict[str, Any]],
    lora_gpus: dict[str, dict[str, Any]],
    full_stages: list[dict[str, Any]],
    full_gpus: dict[str, dict[str, Any]],
    sync: list[dict[str, Any]],
) -> dict[str, Any]:
    """The adapter layout against the full one of the same parallel settings: the adapters' parameters (the
    model's, and the largest rank's), per reported GPU size both peaks and their ratio, the full layout's stages and
    verdicts (with the KL reference's frozen copy, which the adapter layout does without: its reference is the base
    under :func:`afm_core.models.lora.adapters_disabled`), the weight sync's bytes
    (:func:`~afm_core.launch.plan_estimates.lora_sync_summary`) and the adapter's export size (bf16, MB)."""
    adapter_params = lora_adapter_params(arch, lora.rank, lora.target_modules)
    total = sum(numel(row["shape"]) for row in sync)
    per_gpu = {
        gb: {
            "lora_peak_gib": lora_gpus[gb]["peak_gib"],
            "full_peak_gib": full_gpus[gb]["peak_gib"],
            "ratio": round(lora_gpus[gb]["peak_bytes"] / full_gpus[gb]["peak_bytes"], 3),
            "full_fits": full_gpus[gb]["fits"],
        }
        for gb in lora_gpus
    }
    return {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "target_modules": list(lora.target_modules),
        "adapter_params": adapter_params,
        "adapter_fraction": adapter_params / total,
        "rank_adapter_params": max(row["adapter_params"] for row in stages),
        "full_reference_gib": as_gib(max(row.get("reference_bytes", 0) for row in full_stages)),
        "per_gpu": per_gpu,
        "full_stages": full_stages,
        "full_gpus": full_gpus,
        "weight_sync": lora_sync_summary(arch, lora.rank, lora.target_modules, sync),
        "adapter_export_mb": round(2 * adapter_params / 1e6, 1),
    }


def configured_write_speed(cluster: ClusterConfig) -> float | None:
    """``cluster.checkpoint_write_gb_s`` (Slurm's; a local cluster has none: measured)."""
    return cluster.checkpoint_write_gb_s if isinstance(cluster, SlurmClusterConfig) else None


def rl_host_plan(job: RLConfig, layout: Layout, trainer_state_bytes: int, engine_weights_bytes: int) -> dict:
    """:func:`~afm_core.launch.plan_estimates.host_plan` of an RL job: the colocation rank 0 would run
    (:func:`afm_core.rl.colocation.select_colocation`: whether the trainer's state is offloaded while vLLM
    generates, whether a sleeping engine keeps its weights in host memory) against Slurm's ``cluster.mem``."""
    from afm_core.rl.colocation import select_colocation  # imports torch.distributed: the RL plan needs it only

    colocation = select_colocation(job.colocation, job.engine.tensor_parallel_size, on_gpu=layout.on_gpu, rank=0,
                                   world_size=layout.world_size)  # fmt: skip
    cluster = job.cluster
    return host_plan(
        layout,
        trainer_state_bytes,
        engine_weights_bytes,
        offload_trainer=colocation.offload_trainer,
        engine_weights_on_host=colocation.sleeps and colocation.sleep_level == 1,
        mem=cluster.mem if isinstance(cluster, SlurmClusterConfig) else None,
    )


def checkpoint_plan(
    cluster: ClusterConfig,
    run_dir: str,
    layout: Layout,
    total_params: int,
    write: tuple[float, str] | None = None,
    *,
    trained_params: int | None = None,
) -> dict[str, Any]:
    """The checkpoint's size (bytes; GB = 1e9 bytes) and write time (seconds, at the write speed of
    :func:`~afm_core.launch.plan_probe.write_speed` into ``run_dir``), and ``lead_warning``: a note when
    ``--signal=USR2@cluster.signal_delay_s`` is shorter than the write (a stop then loses the checkpoint), else None
    (:func:`~afm_core.launch.plan_estimates.checkpoint_estimate`). An RL stop during generation costs the write alone
    (the rollouts are aborted); one during training also waits for the step's end, which ``jobs.rl`` measures and
    warns about after each checkpoint (:class:`afm_core.rl.checkpoint.StopLead`). ``write``: ``write_speed``'s
    result when the caller has it already; ``trained_params``: LoRA's adapters (a LoRA checkpoint holds them and
    their optimizer state only), None: every parameter."""
    size = checkpoint_bytes(total_params if trained_params is None else trained_params, layout.bf16)
    speed, source = write or write_speed(size, run_dir, configured_write_speed(cluster))
    return checkpoint_estimate(total_params, layout.bf16, layout.nodes, cluster.signal_delay_s, speed, source,
                               trained_params=trained_params)  # fmt: skip


def suggest(job: JobConfig, max_tries: int = 4) -> list[str] | None:
    """Overrides of ``parallel.*`` that make the job fit its GPUs, or None: the first of up to ``max_tries`` layouts
    (the largest TP within a node first, then the fewest pipeline stages) with full recompute, sequence parallelism
    and the distributed optimizer (sequence parallelism too, but not with LoRA adapters)."""
    layout = layout_of(job)
    arch = arch_from_hf_config(hf_config_of(job.model))
    groups = arch.num_query_groups
    candidates = [
        (tp, pp)
        for tp in range(1, max(1, layout.gpus_per_node) + 1)
        for pp in range(1, arch.num_layers + 1)
        if groups % tp == 0
        and arch.num_attention_heads % tp == 0
        and arch.num_layers % pp == 0
        and layout.world_size % (tp * pp) == 0
    ]
    candidates.sort(key=lambda c: (-c[0], c[1]))  # TP within a node first, then the fewest pipeline stages
    for tp, pp in candidates[:max_tries]:
        overrides: dict[str, Any] = {
            "tp": tp,
            "pp": pp,
            "recompute": "full",
            "sequence_parallel": tp > 1 and layout.on_gpu and not layout.lora_rank,  # LoRA does not cover it
            "distributed_optimizer": True,
        }
        try:
            trial = dataclasses.replace(job.parallel, **overrides)
        except ConfigError:  # a layout the schema refuses (virtual pipeline stages at pp=1) is never suggested
            continue
        if make_plan(job, trial)["fits"]:
            return [f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items()]
    return None
