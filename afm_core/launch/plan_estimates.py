"""The pure estimates of ``jobs.plan``: per-rank GPU memory, the colocated vLLM engine, host memory, the weight-sync
tensors and the checkpoint's size, from plain values (a :class:`Layout`, the model's
:class:`~afm_core.models.arch.ModelArch` or transformers config, the groups of the checked config each reads:
the ``engine`` group for the vLLM estimate, numbers for the rest).

Nothing here reads a file, probes a disk or sets up a process group when imported, and only
:func:`training_plan` does anything beyond arithmetic when called: it builds the model on the meta device in a fake
process group of the job's world size (:func:`afm_core.engine.memory.model_state`), touching no device and no
network. The activations come from the per-layer formula (:func:`afm_core.engine.memory.activations`).

Units: bytes unless a name says GiB (``2**30``) or GB (``1e9``, as disks and GPUs are sold). One module over 400
lines because it is one thing: the arithmetic ``jobs.plan`` composes (LoRA's adapter counts, saved tensors and
weight-sync tensors included), importable without torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from afm_core.config.engine import VLLMEngineConfig
    from afm_core.engine.memory import Activations, StageState
    from afm_core.models.arch import ModelArch

GIB = 1024**3
# CUDA context, NCCL and cuBLAS workspaces, allocator slack (not modelled). Measured on an H200 at world size 1
# (benchmarks/plan_vs_gpu.py, Qwen2.5-1.5B/3B at 4096 tokens): 2.84 GiB held outside torch's allocator plus 0.4-0.8
# GiB reserved above the allocated peak; NCCL communicators of larger worlds add to it.
GPU_OVERHEAD_BYTES = 4 * GIB

# Nominal GPU size (GB, as sold) -> the bytes torch reports as total memory (H100/A100 80GB: 81559 MiB;
# H200 141GB: 143771 MiB). Other sizes are taken as GiB.
GPU_TOTAL_BYTES = {80: 81559 * 2**20, 141: 143771 * 2**20}
REPORTED_GPUS = (80, 141)


def as_gib(value: float) -> float:
    return round(value / GIB, 2)


def gpu_total_bytes(nominal_gb: float) -> int:
    return GPU_TOTAL_BYTES.get(int(nominal_gb), int(nominal_gb * GIB))


#: The fields of :class:`Layout` that are the ``parallel`` group's settings, copied under the same names.
PARALLEL_FIELDS = ("tp", "pp", "vpp", "cp", "sequence_parallel", "recompute", "distributed_optimizer")


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
    # without it (megatron's local spec and native fused cross entropy: afm_core.engine.memory.activations)
    transformer_engine: bool = True
    # RL's trainer.max_tokens_per_micro_batch: a micro batch is at most this many tokens packed (one row of that
    # length to the activation formula) instead of micro_batch_size x seq_length; None: counted micro batches
    max_tokens_per_micro_batch: int | None = None
    # model.lora: the adapters' rank (0: full fine-tuning), alpha, dropout and targets; with adapters the base is
    # frozen and the local layer spec runs (afm_core.models.lora adapts megatron's linears, not transformer-engine's)
    lora_rank: int = 0
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ()

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def model_parallel(self) -> dict[str, Any]:
        """``tp``, ``pp``, ``vpp``, ``cp``: the sizes the memory model's state and activation terms both read."""
        return {"tp": self.tp, "pp": self.pp, "vpp": self.vpp, "cp": self.cp}


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


def training_plan(hf_config: Any, layout: Layout) -> list[dict[str, Any]]:
    """Per pipeline stage: the model states (built on meta) and the activations of one rank (of micro batches of
    ``micro_batch_size`` x ``seq_length`` tokens, or of ``max_tokens_per_micro_batch`` when set). With
    ``layout.lora_rank`` the adapters are applied to the meta model (the frozen base holds no gradients and no
    optimizer state) and their saved tensors (:func:`lora_activation_bytes`) join each layer's activations."""
    # torch, megatron (engine.memory) and the model modules load here, not when this module is imported: the
    # estimates import alone (tests/test_plan.py), and a plan that is only read costs no torch import
    import torch

    from afm_core.config.lora import LoRAConfig
    from afm_core.engine.memory import activations, model_state
    from afm_core.models.arch import arch_from_hf_config

    arch = arch_from_hf_config(hf_config)
    dtype = torch.bfloat16 if layout.bf16 else torch.float32
    element_size = 2 if layout.bf16 else 4
    lora = None
    adapter_bytes = 0  # per token and layer
    if layout.lora_rank:
        targets = list(layout.lora_targets)
        lora = LoRAConfig(rank=layout.lora_rank, alpha=layout.lora_alpha, dropout=layout.lora_dropout,
                          target_modules=targets)  # fmt: skip
        adapter_bytes = lora_activation_bytes(arch, layout.lora_rank, targets, element_size=element_size,
                                              tp=layout.tp, dropout=layout.lora_dropout)  # fmt: skip
    states = model_state(
        hf_config,
        world_size=layout.world_size,
        **layout.model_parallel,
        params_dtype=dtype,
        distributed_optimizer=layout.distributed_optimizer,
        on_gpu=layout.on_gpu,
        lora=lora,
    )
    seq_length, micro_batch_size = layout.seq_length, layout.micro_batch_size
    if layout.max_tokens_per_micro_batch:  # the packed micro batch of at most that many tokens
        seq_length, micro_batch_size = layout.max_tokens_per_micro_batch, 1
    rows = []
    for stage in states:
        acts = activations(
            arch,
            stage,
            **layout.model_parallel,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            num_microbatches=layout.num_microbatches,
            sequence_parallel=layout.sequence_parallel,
            recompute=layout.recompute,
            element_size=element_size,
            on_gpu=layout.on_gpu,
            transformer_engine=layout.transformer_engine,
            adapter_bytes_per_token=adapter_bytes,
        )
        rows.append(stage_table(stage, acts))
    return rows


def add_reference(stages: list[dict[str, Any]], element_size: int) -> None:
    """Add the RL KL reference to each row of :func:`training_plan` (in place): a frozen copy of the stage's
    parameters in the training dtype (``element_size`` bytes each; no gradients, no optimizer state), on the GPU in
    every phase (:class:`afm_core.rl.colocation.Handover` does not offload it)."""
    for row in stages:
        row["reference_bytes"] = row["params"] * element_size
        row["train_bytes"] += row["reference_bytes"]
        row["gib"]["reference"] = as_gib(row["reference_bytes"])
        row["gib"]["train"] = as_gib(row["train_bytes"])


def vllm_plan(
    arch: ModelArch,
    engine: VLLMEngineConfig,
    sleep_level: int,
    max_model_len: int,
    total_params: int,
    *,
    lora_params: int = 0,
) -> dict[str, Any]:
    """The colocated engine's bytes per GPU: weights, KV cache per token and the sequences of ``max_model_len``
    its share of each reported GPU size holds, and what sleeping frees. ``engine``: the RL job's ``engine`` group
    (``tensor_parallel_size``, ``gpu_memory_utilization``); ``sleep_level``: ``colocation.sleep_level``;
    ``lora_params``: the adapter's parameters the engine serves beside the base (bf16, split over its TP)."""
    etp = engine.tensor_parallel_size
    util = float(engine.gpu_memory_utilization)
    kv_heads = -(-arch.num_query_groups // etp)  # vLLM replicates KV heads when etp > groups
    kv_per_token = 2 * arch.num_layers * kv_heads * arch.head_dim * 2  # K and V, bf16
    weights = 2 * (total_params + lora_params) // etp
    per_gpu = {}
    for gb in REPORTED_GPUS:
        claimed = int(util * gpu_total_bytes(gb))
        kv = max(0, claimed - weights)
        per_gpu[str(gb)] = {
            "claimed_bytes": claimed,
            "kv_cache_bytes": kv,
            "sequences_at_max_model_len": kv // (kv_per_token * max_model_len),
            "asleep_bytes": 0 if sleep_level >= 1 else claimed,
        }
    return {
        "tensor_parallel_size": etp,
        "gpu_memory_utilization": util,
        "max_model_len": max_model_len,
        "weights_bytes": weights,
        "kv_bytes_per_token": kv_per_token,
        "sleep_level": sleep_level,
        "sleep_frees": "weights (to host) and KV cache"
        if sleep_level == 1
        else "weights and KV cache"
        if sleep_level
        else "nothing",
        "per_gpu": per_gpu,
    }


def host_plan(
    layout: Layout,
    trainer_state_bytes: int,
    engine_weights_bytes: int,
    *,
    offload_trainer: bool,
    engine_weights_on_host: bool,
    mem: str | None,
) -> dict[str, Any]:
    """Host memory per node that colocation adds on a GPU job (:mod:`afm_core.rl.colocation`): while vLLM generates,
    each GPU's trainer parameters, gradients and optimizer state wait in host memory (``offload_trainer``: the
    colocation's ``offload_trainer``); while the trainer runs, a level-1 sleeping engine keeps its weights there
    (``engine_weights_on_host``). ``note`` says when the larger phase exceeds ``mem`` (Slurm's per-node ``--mem``,
    ``cluster.mem``; None: not limited), else None."""
    gpus = max(1, layout.gpus_per_node) if layout.on_gpu else 0
    phases = {
        "generation": gpus * trainer_state_bytes if offload_trainer else 0,
        "training": gpus * engine_weights_bytes if engine_weights_on_host else 0,
    }
    peak = max(phases.values())
    limit = slurm_mem_bytes(mem)
    note = None
    if limit is not None and peak > limit:
        what = "trainer state while vLLM generates" if peak == phases["generation"] else "vLLM weights while training"
        note = (
            f"colocation keeps {as_gib(peak)} GiB per node in host memory ({what}) > cluster.mem="
            f"{mem}: raise cluster.mem or set colocation.offload_trainer=false"
        )
    return {"per_node_bytes": phases, "peak_gib": as_gib(peak), "mem_limit_bytes": limit, "note": note}


def slurm_mem_bytes(mem: str | int | None) -> int | None:
    """Bytes of a Slurm ``--mem`` value (``64G``, ``512000``: MB by default, suffixes K/M/G/T), None when unset or 0
    (0: all of the node's memory)."""
    if mem in (None, "", 0, "0"):
        return None
    text = str(mem).strip().upper()
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    scale = units.get(text[-1])
    return int(float(text[:-1] if scale else text) * (scale or 2**20))


def weight_sync_plan(arch: ModelArch, tp: int, pp: int, vpp: int | None) -> list[dict[str, Any]]:
    """Every HF tensor of a model of ``arch`` once: name, shape, the pipeline stage that owns it and how its TP
    shards are split (the gather in :func:`afm_core.models.hf_weights.export_hf_weights`: TP all-gather, then a
    broadcast from the owning stage over the PP group; TP rank 0 of that stage holds the full tensor first).

    ``tp_split``: 0 (rows: q/k/v, gate/up, embedding and output vocab), 1 (columns: o_proj, down_proj) or None
    (replicated: norms, Qwen3's q/k norms). Layers go to stages as megatron splits them (``num_layers / (pp * vpp)``
    per chunk, chunk ``c`` of stage ``s`` holding block ``c * pp + s``).
    """
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
        if arch.qk_layernorm:  # Qwen3: one RMSNorm gain over head_dim each for q and k
            tensors += [("self_attn.q_norm.weight", [d], None), ("self_attn.k_norm.weight", [d], None)]
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


def checkpoint_bytes(total_params: int, bf16: bool) -> int:
    """The bytes of a checkpoint with optimizer state: the parameters in the training dtype, the fp32 master
    weights (bf16 only) and AdamW's two fp32 moments: 14 bytes per parameter in bf16, 12 in fp32."""
    per_param = (2 if bf16 else 4) + 12 - (0 if bf16 else 4)  # params + fp32 master (bf16) + m, v
    return total_params * per_param


def checkpoint_estimate(
    total_params: int,
    bf16: bool,
    nodes: int,
    signal_lead_s: int,
    write_gb_s_per_node: float,
    source: str,
    *,
    trained_params: int | None = None,
) -> dict[str, Any]:
    """The checkpoint's size (bytes; GB = 1e9 bytes), its write time (seconds, ``nodes`` writing in parallel at
    ``write_gb_s_per_node`` each) and ``lead_warning``: a note when the ``--signal=USR2@signal_lead_s`` lead is
    shorter than the write (a stop then loses the checkpoint), else None. ``source`` says where the speed comes
    from (:func:`afm_core.launch.plan_probe.write_speed`). ``trained_params``: with LoRA the adapters, whose
    tensors and AdamW state are all a LoRA checkpoint holds (:mod:`afm_core.engine.checkpoint`; the frozen base is
    the HF checkpoint it started from); None: every parameter."""
    size = checkpoint_bytes(total_params if trained_params is None else trained_params, bf16)
    write_s = size / (write_gb_s_per_node * 1e9 * nodes)
    warning = None
    if write_s > signal_lead_s:
        warning = (
            f"checkpoint write ~{write_s:.0f} s ({size / 1e9:.0f} GB at {write_gb_s_per_node:.3g} GB/s per node, "
            f"{source}) > --signal=USR2@{signal_lead_s}: set cluster.signal_delay_s >= {int(write_s * 1.5) + 60}"
        )
    return {
        "bytes": size,
        "gb": round(size / 1e9, 1),
        "hf_export_gb": round(total_params * 2 / 1e9, 1),
        "write_gb_s_per_node": write_gb_s_per_node,
        "write_speed_source": source,
        "write_s": write_s,
        "signal_lead_s": signal_lead_s,
        "lead_warning": warning,
    }


# --- LoRA (issue 53): adapters on the frozen base; Hu et al. 2021, eq. 3 -----------------------------------------

#: The LoRA targets whose base is column-parallel (output rows split over TP: the adapter's ``B`` is split, ``A``
#: replicated); the others (``linear_proj``, ``linear_fc2``) are row-parallel (``A`` split by input columns, ``B``
#: replicated), as :mod:`afm_core.models.lora` shards them.
LORA_COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")

#: The HF (PEFT) modules of each Megatron target, with their output rows in the fused Megatron weight: q/k/v
#: (``linear_qkv``) and gate/up (``linear_fc1``) each get their own copy of ``A`` in PEFT's layout.
LORA_HF_MODULES = {
    "linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "linear_proj": ("self_attn.o_proj",),
    "linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "linear_fc2": ("mlp.down_proj",),
}


def lora_linear_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """``(in, out)`` features of each LoRA target of one decoder layer, the fused Megatron linear (elements):
    ``linear_qkv`` ``(h, (n_q + 2 g) d)``, ``linear_proj`` ``(n_q d, h)``, ``linear_fc1`` ``(h, 2 f)`` (gate and up),
    ``linear_fc2`` ``(f, h)``."""
    h, f, d = arch.hidden_size, arch.ffn_hidden_size, arch.head_dim
    q, g = arch.num_attention_heads * d, arch.num_query_groups * d
    return {"linear_qkv": (h, q + 2 * g), "linear_proj": (q, h), "linear_fc1": (h, 2 * f), "linear_fc2": (f, h)}


def lora_adapter_params(
    arch: ModelArch, rank: int, target_modules: Sequence[str], *, tp: int = 1, layers: int | None = None
) -> int:
    """Adapter parameters of ``layers`` decoder layers (None: all of ``arch``) on one TP rank of ``tp``: per target
    ``r * in + r * out / tp`` for a column-parallel base (``A [r, in]`` replicated, ``B [out / tp, r]``) and
    ``r * in / tp + r * out`` for a row-parallel one (``A [r, in / tp]``, ``B [out, r]`` replicated); at ``tp=1``
    the model's ``sum r (in + out)``, what :func:`afm_core.models.lora.apply_lora` returns.

    Raises:
        ValueError: an unknown target, or a split ``tp`` does not divide.
    """
    shapes = lora_linear_shapes(arch)
    per_layer = 0
    for name in target_modules:
        if name not in shapes:
            raise ValueError(f"model.lora.target_modules: {name!r} is not one of {', '.join(shapes)}")
        fan_in, fan_out = shapes[name]
        split = fan_out if name in LORA_COLUMN_PARALLEL else fan_in
        if split % tp:
            raise ValueError(f"{name}: {split} features do not split over tp={tp}")
        per_layer += rank * (fan_in + fan_out // tp if name in LORA_COLUMN_PARALLEL else fan_in // tp + fan_out)
    return per_layer * (arch.num_layers if layers is None else layers)


def lora_sync_tensors(arch: ModelArch, rank: int, target_modules: Sequence[str]) -> list[dict[str, Any]]:
    """The adapter tensors a LoRA weight sync (or a PEFT export) sends, each once, by PEFT's names
    (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``, ``peft/tuners/lora/layer.py``):
    ``lora_A [r, in]`` and ``lora_B [out, r]`` of every HF module of the targets (:data:`LORA_HF_MODULES`; the
    fused q/k/v and gate/up ``A`` once per HF module, as PEFT and vLLM's LoRA loader hold them)."""
    h, f, d = arch.hidden_size, arch.ffn_hidden_size, arch.head_dim
    q, g = arch.num_attention_heads * d, arch.num_query_groups * d
    hf_shapes = {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, g),
        "self_attn.v_proj": (h, g),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, f),
        "mlp.up_proj": (h, f),
        "mlp.down_proj": (f, h),
    }
    rows = []
    for i in range(arch.num_layers):
        for target in target_modules:
            for module in LORA_HF_MODULES[target]:
                fan_in, fan_out = hf_shapes[module]
                prefix = f"base_model.model.model.layers.{i}.{module}."
                rows.append({"name": prefix + "lora_A.weight", "shape": [rank, fan_in]})
                rows.append({"name": prefix + "lora_B.weight", "shape": [fan_out, rank]})
    return rows


def lora_sync_summary(
    arch: ModelArch, rank: int, target_modules: Sequence[str], full_sync: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The LoRA weight sync against the full one, both in bf16 (the engine's dtype): ``tensors`` and ``bytes`` of
    the adapters (:func:`lora_sync_tensors`), ``full_tensors`` / ``full_bytes`` of every HF weight
    (``full_sync``: :func:`weight_sync_plan`'s rows) and ``ratio`` = bytes / full_bytes."""
    adapters = lora_sync_tensors(arch, rank, target_modules)
    lora_bytes = 2 * sum(numel(row["shape"]) for row in adapters)
    full_bytes = 2 * sum(numel(row["shape"]) for row in full_sync)
    return {
        "tensors": len(adapters),
        "bytes": lora_bytes,
        "full_tensors": len(full_sync),
        "full_bytes": full_bytes,
        "ratio": lora_bytes / full_bytes,
    }


def lora_activation_bytes(
    arch: ModelArch, rank: int, target_modules: Sequence[str], *, element_size: int, tp: int = 1, dropout: float = 0.0
) -> int:
    """Bytes per token one decoder layer's adapters save for backward on one TP rank of the local layer spec (the
    one :mod:`afm_core.models.lora` adapts; ``e`` = ``element_size``):

    * every target: ``h = A x`` (``r`` elements, ``B``'s input, on every TP rank);
    * ``linear_qkv``, ``linear_fc1`` (the RMSNorm-fused linears: the adapter normalises the input itself): the
      normalised input (``h`` elements, ``A``'s input, replicated), the fp32 ``rstd`` (4 bytes) and, in bf16, the
      one fp32 upcast of the input the norm's backward reads (``4 h`` bytes);
    * ``linear_fc2`` (the base fuses SwiGLU into it and keeps only the FC1 output): the recomputed ``silu(gate)``
      and SwiGLU output, ``A``'s input (``2 f / tp`` elements);
    * ``linear_proj``: nothing more (its input is the base's saved attention output);
    * with dropout, its output and mask for each target (``in`` elements + ``in`` bytes, ``in`` split by TP on the
      row-parallel targets).

    Measured within 20% against the saved tensors of a real forward (``tests/test_plan.py``).
    """
    shapes = lora_linear_shapes(arch)
    total = 0
    for name in target_modules:
        fan_in = shapes[name][0] // (1 if name in LORA_COLUMN_PARALLEL else tp)
        total += rank * element_size
        if name in LORA_COLUMN_PARALLEL:
            total += fan_in * element_size + 4 + (4 * fan_in if element_size != 4 else 0)
        elif name == "linear_fc2":
            total += 2 * fan_in * element_size
        if dropout:
            total += fan_in * (element_size + 1)
    return total
