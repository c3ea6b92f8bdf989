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

The parts: this module reads a composed config (:func:`compose`, :func:`layout_of`, :func:`hf_config_of`) and
assembles the plan (:func:`make_plan`, :func:`suggest`); :mod:`~afm_core.launch.plan_estimates` holds the memory
and size models (arithmetic on plain values), :mod:`~afm_core.launch.plan_probe` the disk write probe,
:mod:`~afm_core.launch.plan_render` the table and ``plan.json``, :mod:`~afm_core.launch.plan_gate` the refusal
before ``sbatch``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from afm_core.launch.plan_estimates import (
    GPU_OVERHEAD_BYTES,
    REPORTED_GPUS,
    Layout,
    as_gib,
    checkpoint_bytes,
    checkpoint_estimate,
    gpu_total_bytes,
    host_plan,
    numel,
    training_plan,
    vllm_plan,
    weight_sync_plan,
)
from afm_core.launch.plan_probe import write_speed
from afm_core.utils.hardware import bf16_is_fast

APPS = ("sft", "rl")


def compose(app: str, overrides: Sequence[str]) -> Any:
    """``conf/<app>.yaml`` composed with Hydra ``overrides`` (``run_dir`` left unresolved), the typed schemas
    registered first (:func:`afm_core.config.register_schemas`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from afm_core.config import register_schemas
    from afm_core.utils.paths import repo_root

    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        return hydra_compose(config_name=app, overrides=list(overrides))


def infer_app(overrides: Sequence[str]) -> str:
    """``rl`` when the ``recipe=`` override names a recipe with ``rollout`` or ``algorithm`` settings, else ``sft``."""
    import yaml

    from afm_core.utils.paths import repo_root

    for item in overrides:
        if item.startswith("recipe="):
            path = repo_root() / "conf" / "recipe" / f"{item.split('=', 1)[1]}.yaml"
            if path.is_file():
                keys = yaml.safe_load(path.read_text()) or {}
                if "rollout" in keys or "algorithm" in keys:
                    return "rl"
    return "sft"


def layout_of(cfg: Mapping[str, Any], app: str) -> Layout:
    """The plan's view of a composed ``conf/sft.yaml`` or ``conf/rl.yaml`` (a plain mapping). RL's micro batches are
    ``trainer.micro_batch_size`` trajectories of ``data.max_prompt_len`` + the largest stage's ``max_response_len``
    tokens, or, with ``trainer.max_tokens_per_micro_batch``, that many tokens packed (as many micro batches as a
    mini-batch of full-length trajectories fills)."""
    from afm_core.launch.executor import visible_gpus, world_size

    cluster, p, t = cfg["cluster"], cfg["parallel"], cfg["trainer"]
    world = world_size(cluster, p)
    slurm = cluster["name"] == "slurm"
    on_gpu = int(cluster.get("gpus_per_node") or 0) > 0 if slurm else visible_gpus() > 0
    tp, pp, cp = int(p["tp"]), int(p["pp"]), int(p.get("cp", 1))
    dp = world // (tp * pp * cp)
    mbs = int(t["micro_batch_size"])
    recompute, sp = p.get("recompute"), bool(p.get("sequence_parallel"))
    if app == "rl":
        r, a = cfg["rollout"], cfg["algorithm"]
        stages = [int(s["max_response_len"]) for s in r.get("context_schedule") or []]
        seq_length = int(cfg["data"]["max_prompt_len"]) + (max(stages) if stages else int(r["max_response_len"]))
        samples = int(a["mini_batch_size"]) * int(r["n"])
        num_microbatches = max(1, samples // (dp * mbs))
        max_tokens = t.get("max_tokens_per_micro_batch")
        if max_tokens:  # micro batches by tokens: at most max_tokens packed, as many as full-length samples need
            max_tokens = int(max_tokens)
            num_microbatches = max(1, -(-samples * seq_length // (dp * max_tokens)))
    else:
        seq_length, max_tokens = int(t["seq_length"]), None
        num_microbatches = max(1, int(t["global_batch_size"]) // (dp * mbs))
    precision = t.get("precision", "auto")
    return Layout(
        app=app,
        world_size=world,
        nodes=int(cluster.get("nodes", 1)) if slurm else 1,
        gpus_per_node=int(cluster.get("gpus_per_node") or 0) if slurm else visible_gpus(),
        on_gpu=on_gpu,
        tp=tp,
        pp=pp,
        vpp=p.get("vpp"),
        cp=cp,
        sequence_parallel=sp,
        recompute=recompute,
        distributed_optimizer=bool(p.get("distributed_optimizer")),
        bf16=precision == "bf16" or (precision == "auto" and bf16_is_fast(on_gpu)),  # a CPU job: this host's CPU
        seq_length=seq_length,
        micro_batch_size=mbs,
        num_microbatches=num_microbatches,
        gpu_gb=float(cluster.get("gpu_memory_gb") or 80),
        transformer_engine=on_gpu,
        max_tokens_per_micro_batch=max_tokens,
    )


def hf_config_of(model: Mapping[str, Any]) -> Any:
    """The transformers config of a ``model`` preset (its ``config.json`` when ``hf_path`` has one)."""
    from afm_core.models.arch import hf_config_from_arch
    from afm_core.models.presets import load_preset

    hf_path = model.get("hf_path")
    if hf_path and (Path(hf_path) / "config.json").is_file():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(hf_path, local_files_only=True)
    return hf_config_from_arch(load_preset(dict(model)).arch)


def make_plan(cfg: Mapping[str, Any], app: str) -> dict[str, Any]:
    """The plan of a composed config (plain mapping): see the module docstring and :func:`render`.

    Raises:
        ValueError / afm_core.launch.executor.ClusterConfigError: the layout does not split the model or the world.
    """
    layout = layout_of(cfg, app)
    hf_config = hf_config_of(cfg["model"])
    sync = weight_sync_plan(hf_config, layout.tp, layout.pp, layout.vpp)
    total_params = sum(numel(row["shape"]) for row in sync)
    with ThreadPoolExecutor(1) as pool:  # the disk's write probe (mostly waiting on fsync) while the model is built
        speed = pool.submit(write_speed, cfg, checkpoint_bytes(total_params, layout.bf16))
        stages = training_plan(hf_config, layout)
        write = speed.result()
    state_max = max(row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"] for row in stages)
    train_max = max(row["train_bytes"] for row in stages)
    plan: dict[str, Any] = {
        "app": app,
        "model": cfg["model"]["name"],
        "total_params": total_params,
        "layout": {**layout.__dict__, "dp": layout.dp},
        "stages": stages,
        "notes": [],
    }
    phases: dict[str, dict[str, int]] = {}
    if app == "rl":
        engine = vllm_plan(hf_config, cfg, layout.seq_length, total_params)
        plan["vllm"] = engine
        bucket = int(cfg.get("weight_sync", {}).get("bucket_mb", 512)) * 2**20
        for gb in REPORTED_GPUS:
            e = engine["per_gpu"][str(gb)]
            phases[str(gb)] = {
                "generation": state_max + e["claimed_bytes"],
                "weight_sync": state_max + engine["weights_bytes"] + bucket,
                "training": train_max + e["asleep_bytes"],
            }
    else:
        phases = {str(gb): {"training": train_max} for gb in REPORTED_GPUS}
    verdicts = {}
    for gb in REPORTED_GPUS:
        peak = max(phases[str(gb)].values()) + GPU_OVERHEAD_BYTES
        reasons = []
        if peak > gpu_total_bytes(gb):
            reasons.append(f"peak {as_gib(peak)} GiB > {as_gib(gpu_total_bytes(gb))} GiB")
        if app == "rl" and plan["vllm"]["per_gpu"][str(gb)]["sequences_at_max_model_len"] < 1:
            reasons.append(f"vLLM's KV cache cannot hold one sequence of max_model_len {layout.seq_length}")
        verdicts[str(gb)] = {
            "peak_bytes": peak,
            "peak_gib": as_gib(peak),
            "gpu_gib": as_gib(gpu_total_bytes(gb)),
            "phases_gib": {k: as_gib(v) for k, v in phases[str(gb)].items()},
            "fits": not reasons,
            "why_not": reasons,
        }
    plan["gpus"] = verdicts
    plan["target_gpu_gb"] = layout.gpu_gb
    target = verdicts.get(str(int(layout.gpu_gb)))
    if target is None:
        peak = max(max(v.values()) for v in phases.values()) + GPU_OVERHEAD_BYTES
        target = {"peak_bytes": peak, "fits": peak <= gpu_total_bytes(layout.gpu_gb), "why_not": []}
    plan["fits"] = bool(target["fits"]) if layout.on_gpu else None
    plan["weight_sync"] = sync if app == "rl" else []
    if app == "rl":
        plan["host"] = host_plan(cfg, layout, state_max, plan["vllm"]["weights_bytes"])
        if plan["host"]["note"]:
            plan["notes"].append(plan["host"]["note"])
    ckpt = checkpoint_plan(cfg, layout, total_params, write)
    plan["checkpoint"] = ckpt
    if ckpt["lead_warning"]:
        plan["notes"].append(ckpt["lead_warning"])
    return plan


def checkpoint_plan(
    cfg: Mapping[str, Any], layout: Layout, total_params: int, write: tuple[float, str] | None = None
) -> dict[str, Any]:
    """The checkpoint's size (bytes; GB = 1e9 bytes) and write time (seconds, at the write speed of
    :func:`~afm_core.launch.plan_probe.write_speed`), and ``lead_warning``: a note when
    ``--signal=USR2@cluster.signal_delay_s`` is shorter than the write (a stop then loses the checkpoint), else None
    (:func:`~afm_core.launch.plan_estimates.checkpoint_estimate`). An RL stop during generation costs the write alone
    (the rollouts are aborted); one during training also waits for the step's end, which ``jobs.rl`` measures and
    warns about after each checkpoint (:class:`afm_core.rl.checkpoint.StopLead`). ``write``: ``write_speed``'s
    result when the caller has it already."""
    speed, source = write or write_speed(cfg, checkpoint_bytes(total_params, layout.bf16))
    lead = int(cfg["cluster"].get("signal_delay_s", 0))
    return checkpoint_estimate(total_params, layout.bf16, layout.nodes, lead, speed, source)


def suggest(cfg: Mapping[str, Any], app: str, max_tries: int = 4) -> list[str] | None:
    """Overrides of ``parallel.*`` that make the job fit its GPUs, or None: the first of up to ``max_tries`` layouts
    (the largest TP within a node first, then the fewest pipeline stages) with full recompute, sequence parallelism
    and the distributed optimizer."""
    from afm_core.models.arch import arch_from_hf_config

    layout = layout_of(cfg, app)
    arch = arch_from_hf_config(hf_config_of(cfg["model"]))
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
        overrides = {
            "tp": tp,
            "pp": pp,
            "recompute": "full",
            "sequence_parallel": tp > 1 and layout.on_gpu,
            "distributed_optimizer": True,
        }
        trial = {**cfg, "parallel": {**cfg["parallel"], **overrides}}
        if make_plan(trial, app)["fits"]:
            return [f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items()]
    return None
