"""The dry run of an SFT or RL job: per-rank GPU memory, whether it fits, the weight-sync plan and the checkpoint
cost, computed before the queue (``python -m jobs.plan``; every ``cluster=slurm`` submission runs it first).

Model states come from the model built on the meta device in a fake process group of the job's world size, and
activations from the per-layer formula (:mod:`afm_core.train.memory`). For RL the colocated vLLM engine adds its
share: at start vLLM claims ``engine.gpu_memory_utilization`` of each GPU (weights ``2 N / engine TP`` in bf16, the
rest KV cache, which must hold at least one sequence of ``max_model_len`` tokens, vLLM's own start check), and
while the trainer runs it sleeps (``colocation.sleep_level`` 1: weights to host memory, KV cache dropped;
vLLM docs, "Sleep Mode"). The peak per GPU is the larger of the generation phase (trainer states + the engine)
and the training phase (trainer states + activations + what the sleeping engine keeps), plus
:data:`~afm_core.train.memory.GPU_OVERHEAD_BYTES`.

A checkpoint holds the parameters in the training dtype and the optimizer's fp32 master weights and two Adam
moments (14 bytes per parameter in bf16, 12 in fp32); its write time is its size over the write speed per node
(``cluster.checkpoint_write_gb_s`` when set, else measured: :func:`write_speed`), and it must fit in the
``--signal=USR2@cluster.signal_delay_s`` lead time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from afm_core.utils.hardware import bf16_is_fast

if TYPE_CHECKING:
    from afm_core.train.memory import Activations, StageState

GIB = 1024**3
# CUDA context, NCCL and cuBLAS workspaces, allocator slack (not modelled). Measured on an H200 at world size 1
# (benchmarks/plan_vs_gpu.py, Qwen2.5-1.5B/3B at 4096 tokens): 2.84 GiB held outside torch's allocator plus 0.4-0.8
# GiB reserved above the allocated peak; NCCL communicators of larger worlds add to it.
GPU_OVERHEAD_BYTES = 4 * GIB

APPS = ("sft", "rl")
# Nominal GPU size (GB, as sold) -> the bytes torch reports as total memory (H100/A100 80GB: 81559 MiB;
# H200 141GB: 143771 MiB). Other sizes are taken as GiB.
GPU_TOTAL_BYTES = {80: 81559 * 2**20, 141: 143771 * 2**20}
REPORTED_GPUS = (80, 141)


def as_gib(value: float) -> float:
    return round(value / GIB, 2)


def gpu_total_bytes(nominal_gb: float) -> int:
    return GPU_TOTAL_BYTES.get(int(nominal_gb), int(nominal_gb * GIB))


def stage_table(stage: StageState, acts: Activations) -> dict[str, Any]:
    """One row of the plan's per-rank table (bytes and GiB)."""
    row = {**asdict(stage), "activations_bytes": acts.layers, "logits_bytes": acts.logits}
    row["train_bytes"] = stage.total + acts.total
    row["in_flight_micro_batches"] = acts.in_flight
    row["gib"] = {
        key: as_gib(value)
        for key, value in (
            ("params", stage.param_bytes),
            ("grads", stage.grad_bytes),
            ("optimizer", stage.optimizer_bytes),
            ("activations", acts.layers),
            ("logits", acts.logits),
            ("train", row["train_bytes"]),
        )
    }
    return row


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


@dataclass(frozen=True)
class Layout:
    """What the plan needs of a composed config, as plain values."""

    app: str
    world_size: int
    nodes: int
    gpus_per_node: int
    on_gpu: bool
    tp: int
    pp: int
    vpp: int | None
    cp: int
    sequence_parallel: bool
    recompute: str | None
    distributed_optimizer: bool
    bf16: bool
    seq_length: int
    micro_batch_size: int
    num_microbatches: int
    gpu_gb: float
    # GPU jobs run transformer-engine's layer spec and cross entropy (requirements/gpu.txt); False: a GPU install
    # without it (megatron's local spec and native fused cross entropy: afm_core.train.memory.activations)
    transformer_engine: bool = True

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)


def layout_of(cfg: Mapping[str, Any], app: str) -> Layout:
    """The plan's view of a composed ``conf/sft.yaml`` or ``conf/rl.yaml`` (a plain mapping)."""
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
    else:
        seq_length = int(t["seq_length"])
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


def training_plan(hf_config: Any, layout: Layout) -> list[dict[str, Any]]:
    """Per pipeline stage: the model states (built on meta) and the activations of one rank."""
    import torch

    from afm_core.models.arch import arch_from_hf_config
    from afm_core.train.memory import activations, model_state

    arch = arch_from_hf_config(hf_config)
    dtype = torch.bfloat16 if layout.bf16 else torch.float32
    states = model_state(
        hf_config,
        world_size=layout.world_size,
        tp=layout.tp,
        pp=layout.pp,
        vpp=layout.vpp,
        cp=layout.cp,
        params_dtype=dtype,
        distributed_optimizer=layout.distributed_optimizer,
        on_gpu=layout.on_gpu,
    )
    rows = []
    for stage in states:
        acts = activations(
            arch,
            stage,
            pp=layout.pp,
            vpp=layout.vpp,
            tp=layout.tp,
            cp=layout.cp,
            seq_length=layout.seq_length,
            micro_batch_size=layout.micro_batch_size,
            num_microbatches=layout.num_microbatches,
            sequence_parallel=layout.sequence_parallel,
            recompute=layout.recompute,
            element_size=2 if layout.bf16 else 4,
            on_gpu=layout.on_gpu,
            transformer_engine=layout.transformer_engine,
        )
        rows.append(stage_table(stage, acts))
    return rows


def vllm_plan(hf_config: Any, cfg: Mapping[str, Any], max_model_len: int, total_params: int) -> dict[str, Any]:
    """The colocated engine's bytes per GPU: weights, KV cache per token and the sequences of ``max_model_len``
    its share of each reported GPU size holds, and what sleeping frees."""
    from afm_core.models.arch import arch_from_hf_config

    arch = arch_from_hf_config(hf_config)
    etp = int(cfg["engine"].get("tensor_parallel_size", 1))
    util = float(cfg["engine"].get("gpu_memory_utilization", 0.85))
    level = int((cfg.get("colocation") or {}).get("sleep_level", 1))
    kv_heads = -(-arch.num_query_groups // etp)  # vLLM replicates KV heads when etp > groups
    kv_per_token = 2 * arch.num_layers * kv_heads * arch.head_dim * 2  # K and V, bf16
    weights = 2 * total_params // etp
    per_gpu = {}
    for gb in REPORTED_GPUS:
        claimed = int(util * gpu_total_bytes(gb))
        kv = max(0, claimed - weights)
        per_gpu[str(gb)] = {
            "claimed_bytes": claimed,
            "kv_cache_bytes": kv,
            "sequences_at_max_model_len": kv // (kv_per_token * max_model_len),
            "asleep_bytes": 0 if level >= 1 else claimed,
        }
    return {
        "tensor_parallel_size": etp,
        "gpu_memory_utilization": util,
        "max_model_len": max_model_len,
        "weights_bytes": weights,
        "kv_bytes_per_token": kv_per_token,
        "sleep_level": level,
        "sleep_frees": "weights (to host) and KV cache"
        if level == 1
        else "weights and KV cache"
        if level
        else "nothing",
        "per_gpu": per_gpu,
    }


def host_plan(cfg: Mapping[str, Any], layout: Layout, trainer_state_bytes: int, engine_weights_bytes: int) -> dict:
    """Host memory per node that colocation adds on a GPU job (:mod:`afm_core.rl.colocation`): while vLLM generates,
    each GPU's trainer parameters, gradients and optimizer state wait in host memory (``colocation.offload_trainer``;
    null: whenever the engine sleeps); while the trainer runs, a level-1 sleeping engine keeps its weights there.
    ``note`` says when the larger phase exceeds ``cluster.mem`` (Slurm's per-node ``--mem``), else None."""
    from afm_core.rl.colocation import select_colocation

    colocation = select_colocation(
        cfg.get("colocation"), cfg["engine"], on_gpu=layout.on_gpu, rank=0, world_size=layout.world_size
    )
    gpus = max(1, layout.gpus_per_node) if layout.on_gpu else 0
    phases = {
        "generation": gpus * trainer_state_bytes if colocation.offload_trainer else 0,
        "training": gpus * engine_weights_bytes if colocation.sleeps and colocation.sleep_level == 1 else 0,
    }
    peak = max(phases.values())
    limit = _slurm_mem_bytes(cfg["cluster"].get("mem"))
    note = None
    if limit is not None and peak > limit:
        what = "trainer state while vLLM generates" if peak == phases["generation"] else "vLLM weights while training"
        note = (
            f"colocation keeps {as_gib(peak)} GiB per node in host memory ({what}) > cluster.mem="
            f"{cfg['cluster']['mem']}: raise cluster.mem or set colocation.offload_trainer=false"
        )
    return {"per_node_bytes": phases, "peak_gib": as_gib(peak), "mem_limit_bytes": limit, "note": note}


def _slurm_mem_bytes(mem: Any) -> int | None:
    """Bytes of a Slurm ``--mem`` value (``64G``, ``512000``: MB by default, suffixes K/M/G/T), None when unset or 0
    (0: all of the node's memory)."""
    if mem in (None, "", 0, "0"):
        return None
    text = str(mem).strip().upper()
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    scale = units.get(text[-1])
    return int(float(text[:-1] if scale else text) * (scale or 2**20))


def weight_sync_plan(hf_config: Any, tp: int, pp: int, vpp: int | None) -> list[dict[str, Any]]:
    """Every HF tensor once: name, shape, the pipeline stage that owns it and how its TP shards are split (the
    gather in :func:`afm_core.models.bridge.export_hf_weights`: TP all-gather, then a broadcast from the owning
    stage over the PP group; TP rank 0 of that stage holds the full tensor first).

    ``tp_split``: 0 (rows: q/k/v, gate/up, embedding and output vocab), 1 (columns: o_proj, down_proj) or None
    (replicated: norms). Layers go to stages as megatron splits them (``num_layers / (pp * vpp)`` per chunk,
    chunk ``c`` of stage ``s`` holding block ``c * pp + s``).
    """
    from afm_core.models.arch import arch_from_hf_config

    arch = arch_from_hf_config(hf_config)
    h, f, d = arch.hidden_size, arch.ffn_hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    chunks = vpp or 1
    per_chunk = arch.num_layers // (pp * chunks)

    def stage_of(layer: int) -> int:
        return (layer // per_chunk) % pp

    rows: list[dict[str, Any]] = [
        {"name": "model.embed_tokens.weight", "shape": [arch.vocab_size, h], "pp_rank": 0, "tp_split": 0}
    ]
    for i in range(arch.num_layers):
        p, prefix = stage_of(i), f"model.layers.{i}."
        tensors: list[tuple[str, list[int], int | None]] = [
            ("input_layernorm.weight", [h], None),
            ("self_attn.q_proj.weight", [q, h], 0),
            ("self_attn.k_proj.weight", [kv, h], 0),
            ("self_attn.v_proj.weight", [kv, h], 0),
        ]
        if arch.qkv_bias:
            tensors += [("self_attn.q_proj.bias", [q], 0), ("self_attn.k_proj.bias", [kv], 0)]
            tensors += [("self_attn.v_proj.bias", [kv], 0)]
        tensors += [
            ("self_attn.o_proj.weight", [h, q], 1),
            ("post_attention_layernorm.weight", [h], None),
            ("mlp.gate_proj.weight", [f, h], 0),
            ("mlp.up_proj.weight", [f, h], 0),
            ("mlp.down_proj.weight", [h, f], 1),
        ]
        rows += [{"name": prefix + n, "shape": s, "pp_rank": p, "tp_split": t} for n, s, t in tensors]
    rows.append({"name": "model.norm.weight", "shape": [h], "pp_rank": pp - 1, "tp_split": None})
    if not arch.tied_embeddings:
        rows.append({"name": "lm_head.weight", "shape": [arch.vocab_size, h], "pp_rank": pp - 1, "tp_split": 0})
    for row in rows:
        row["sender"] = f"pp{row['pp_rank']}/tp{'0' if row['tp_split'] is None else f'0..{tp - 1}'}"
    return rows


def numel(shape: Sequence[int]) -> int:
    out = 1
    for n in shape:
        out *= int(n)
    return out


def make_plan(cfg: Mapping[str, Any], app: str) -> dict[str, Any]:
    """The plan of a composed config (plain mapping): see the module docstring and :func:`render`.

    Raises:
        ValueError / afm_core.launch.executor.ClusterConfigError: the layout does not split the model or the world.
    """
    layout = layout_of(cfg, app)
    hf_config = hf_config_of(cfg["model"])
    stages = training_plan(hf_config, layout)
    sync = weight_sync_plan(hf_config, layout.tp, layout.pp, layout.vpp)
    total_params = sum(numel(row["shape"]) for row in sync)
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
    ckpt = checkpoint_plan(cfg, layout, total_params)
    plan["checkpoint"] = ckpt
    if ckpt["lead_warning"]:
        plan["notes"].append(ckpt["lead_warning"])
    return plan


def checkpoint_plan(cfg: Mapping[str, Any], layout: Layout, total_params: int) -> dict[str, Any]:
    """The checkpoint's size (bytes; GB = 1e9 bytes) and write time (seconds, at the write speed of
    :func:`write_speed`), and ``lead_warning``: a note when ``--signal=USR2@cluster.signal_delay_s`` is shorter than
    the write (a stop then loses the checkpoint), else None. An RL stop during generation costs the write alone (the
    rollouts are aborted); one during training also waits for the step's end, which ``jobs.rl`` measures and warns
    about after each checkpoint (:class:`afm_core.rl.checkpoint.StopLead`)."""
    per_param = (2 if layout.bf16 else 4) + 12 - (0 if layout.bf16 else 4)  # params + fp32 master (bf16) + m, v
    size = total_params * per_param
    speed, source = write_speed(cfg, size)
    write_s = size / (speed * 1e9 * layout.nodes)
    lead = int(cfg["cluster"].get("signal_delay_s", 0))
    warning = None
    if write_s > lead:
        warning = (
            f"checkpoint write ~{write_s:.0f} s ({size / 1e9:.0f} GB at {speed:.3g} GB/s per node, {source}) > "
            f"--signal=USR2@{lead}: set cluster.signal_delay_s >= {int(write_s * 1.5) + 60}"
        )
    return {
        "bytes": size,
        "gb": round(size / 1e9, 1),
        "hf_export_gb": round(total_params * 2 / 1e9, 1),
        "write_gb_s_per_node": speed,
        "write_speed_source": source,
        "write_s": write_s,
        "signal_lead_s": lead,
        "lead_warning": warning,
    }


def write_speed(cfg: Mapping[str, Any], checkpoint_bytes: int) -> tuple[float, str]:
    """GB/s one node writes to the run dir's file system, and where the figure comes from: ``cluster.
    checkpoint_write_gb_s`` when set ("configured"); else the run's own latest checkpoint when the run dir has one
    (a resubmitted or requeued run: :func:`afm_core.train.checkpoint_dirs.measured_write_speed`); else a probe
    (:func:`probe_write_speed`) of ``min(plan.write_probe_mib, checkpoint size)`` MiB into the run dir's nearest
    existing folder. The probe writes from one process of the submitting node; a node's ranks write in parallel,
    so on a parallel file system it is a lower bound (the lead it asks for errs long)."""
    from afm_core.train.checkpoint_dirs import measured_write_speed

    configured = cfg["cluster"].get("checkpoint_write_gb_s")
    if configured:
        return float(configured), "configured"
    run_dir = _existing_run_dir(cfg)
    measured = measured_write_speed(run_dir / "checkpoints")
    if measured is not None:
        return measured["gb_s_per_node"], f"measured by this run's {measured['checkpoint']}"
    probe_mib = int((cfg.get("plan") or {}).get("write_probe_mib", 256))
    size_mib = max(1, min(probe_mib, checkpoint_bytes // 2**20))
    directory = _nearest_existing(run_dir)
    return probe_write_speed(directory, size_mib), f"measured: {size_mib} MiB written and fsynced to {directory}"


def _existing_run_dir(cfg: Mapping[str, Any]) -> Path:
    """The run dir when it is a path (``jobs.plan`` composes without Hydra's run, leaving ``${hydra:...}``)."""
    run_dir = str(cfg.get("run_dir") or ".")
    return Path("." if "${" in run_dir else run_dir)


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.is_dir():
        path = path.parent
    return path


def probe_write_speed(directory: str | Path, size_mib: int, block_mib: int = 8) -> float:
    """GB/s (1e9 bytes) of writing ``size_mib`` MiB of random bytes (incompressible) to a temporary file in
    ``directory`` and fsyncing it, as a checkpoint is written (:func:`afm_core.utils.atomic.atomic_path`); the file is
    removed. Raises ``OSError`` when ``directory`` is not writable or full."""
    import os
    import tempfile
    import time

    block = os.urandom(min(size_mib, block_mib) * 2**20)
    left = size_mib * 2**20
    fd, name = tempfile.mkstemp(prefix=".afm-write-probe-", dir=directory)
    try:
        start = time.perf_counter()
        while left > 0:
            left -= os.write(fd, block[: min(left, len(block))])
        os.fsync(fd)
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(name)
    return size_mib * 2**20 / max(seconds, 1e-6) / 1e9


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


def render(plan: Mapping[str, Any]) -> str:
    """The plan as the table ``jobs.plan`` prints."""
    lay = plan["layout"]
    lines = [
        f"plan: {plan['app']} {plan['model']} ({plan['total_params'] / 1e9:.2f}B params), world {lay['world_size']} "
        f"= tp {lay['tp']} x pp {lay['pp']} x cp {lay['cp']} x dp {lay['dp']}, "
        f"{'bf16' if lay['bf16'] else 'fp32'} on {'GPU' if lay['on_gpu'] else 'CPU'}, seq {lay['seq_length']} x "
        f"micro batch {lay['micro_batch_size']}, {lay['num_microbatches']} micro batches/step, recompute "
        f"{lay['recompute']}, sequence parallel {lay['sequence_parallel']}, distributed optimizer "
        f"{lay['distributed_optimizer']}",
        f"  {'rank':>10} {'layers':>6} {'params':>9} {'grads':>9} {'optimizer':>9} {'activ.':>9} {'logits':>9} "
        f"{'train':>9}  GiB",
    ]
    for row in plan["stages"]:
        g = row["gib"]
        lines.append(
            f"  {'pp' + str(row['pp_rank']) + ' tp*':>10} {row['layers']:>6} {g['params']:>9.2f} {g['grads']:>9.2f} "
            f"{g['optimizer']:>9.2f} {g['activations']:>9.2f} {g['logits']:>9.2f} {g['train']:>9.2f}"
        )
    if "vllm" in plan:
        v = plan["vllm"]
        lines.append(
            f"  vLLM: TP {v['tensor_parallel_size']}, weights {as_gib(v['weights_bytes'])} GiB/GPU, KV "
            f"{v['kv_bytes_per_token'] / 2**10:.0f} KiB/token, max_model_len {v['max_model_len']}, "
            f"gpu_memory_utilization {v['gpu_memory_utilization']}; sleep level {v['sleep_level']} frees "
            f"{v['sleep_frees']}"
        )
        for gb, e in v["per_gpu"].items():
            lines.append(
                f"    {gb} GB GPU: claims {as_gib(e['claimed_bytes'])} GiB, KV {as_gib(e['kv_cache_bytes'])} GiB = "
                f"{e['sequences_at_max_model_len']} sequences of max_model_len"
            )
        lines.append(f"  weight sync: {len(plan['weight_sync'])} HF tensors, each sent once (see plan.json)")
    for gb, verdict in plan["gpus"].items():
        phases = ", ".join(f"{k} {v}" for k, v in verdict["phases_gib"].items())
        state = "fits" if verdict["fits"] else "does not fit (" + "; ".join(verdict["why_not"]) + ")"
        lines.append(
            f"  {gb} GB GPU ({verdict['gpu_gib']} GiB): peak {verdict['peak_gib']} GiB ({phases}, + "
            f"{as_gib(GPU_OVERHEAD_BYTES)} overhead): {state}"
        )
    if plan.get("host"):
        h = plan["host"]
        lines.append(
            f"  host memory per node for colocation: {h['peak_gib']} GiB ("
            + ", ".join(f"{k} {as_gib(v)}" for k, v in h["per_node_bytes"].items())
            + ")"
        )
    c = plan["checkpoint"]
    write = f"~{c['write_s']:.0f} s at {c['write_gb_s_per_node']:.3g} GB/s per node, {c['write_speed_source']}"
    lines.append(f"  checkpoint: {c['gb']} GB with optimizer state ({write}); HF export {c['hf_export_gb']} GB")
    lines += [f"  note: {note}" for note in plan["notes"]]
    if plan["fits"] is not None:
        lines.append(f"verdict: {'fits' if plan['fits'] else 'does not fit'} on {plan['target_gpu_gb']:g} GB GPUs")
    if plan.get("suggestion"):
        lines.append("  would fit: " + " ".join(plan["suggestion"]))
    return "\n".join(lines)


def write_plan(plan: Mapping[str, Any], path: str | Path) -> Path:
    from afm_core.utils.atomic import atomic_write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(plan, indent=1, default=str) + "\n")
    return path


class PlanRefused(RuntimeError):
    """The job does not fit its GPUs (the message names the numbers and the overrides that would fit)."""


def check_before_submit(cfg: Any, app: str) -> dict[str, Any] | None:
    """Run the plan for a ``cluster=slurm`` job (None for local jobs) and refuse one that does not fit.

    ``+plan.force=true`` submits anyway. The plan is written to ``RUN_DIR/plan.json`` and printed.

    Raises:
        PlanRefused: the plan says "does not fit"; the message has the plan table and suggested overrides.
    """
    from omegaconf import DictConfig, OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    if plain["cluster"]["name"] != "slurm":
        return None
    force = bool((plain.get("plan") or {}).get("force", False))
    plan = make_plan(plain, app)
    if plan["fits"] is False:
        plan["suggestion"] = suggest(plain, app)
    write_plan(plan, Path(plain["run_dir"]) / "plan.json")
    print(render(plan), flush=True)
    if plan["fits"] is False and not force:
        fix = " ".join(plan["suggestion"]) if plan.get("suggestion") else "no layout of these GPUs fits"
        raise PlanRefused(
            f"does not fit on {plan['target_gpu_gb']:g} GB GPUs "
            f"({'; '.join(plan['gpus'].get(str(int(plan['target_gpu_gb'])), {}).get('why_not', []))}); "
            f"would fit: {fix}; +plan.force=true submits anyway"
        )
    return plan
