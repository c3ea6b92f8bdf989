"""Per-GPU memory of Megatron-core training of a dense decoder (Llama / Qwen2 / Qwen3): the one estimator behind
``python -m jobs.plan`` (:mod:`afm_core.launch.plan`).

Model states are not estimated, they are built: :func:`model_state` constructs each pipeline stage's
``GPTModel`` chunks on the ``meta`` device inside a fake process group of the job's world size
(``torch.testing._internal.distributed.fake_pg``: no memory, no communication), wraps them in megatron-core's
``DistributedDataParallel`` with the trainer's settings (:func:`afm_core.engine.core.ddp_config`) and reads the
byte counts off the result:

  * parameters: this rank's tensors in the training dtype (with the distributed optimizer, megatron's padded
    contiguous parameter buffer);
  * gradients: the fp32 ``main_grad`` buffer of megatron's DDP (padded as megatron pads it);
  * optimizer: Adam's two fp32 moments plus fp32 master weights when the parameters are not fp32, over the
    whole stage, or with the distributed optimizer over this DP rank's shard of each gradient bucket
    (``DistributedOptimizer._build_gbuf_range_map``; ZeRO-1, Rajbhandari et al. 2020, Sec. 5.1).

With LoRA (``model.lora``) the adapters are added to the meta chunks before the wrap
(:func:`afm_core.models.lora.apply_lora`, as the trainer adds them): the frozen base keeps its tensors in the
training dtype and has no gradient buffer, no master weights and no moments, which hold the adapters only.

Activations are analytic, one decoder layer's saved tensors for backward per micro batch (Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4, rewritten for GQA, SwiGLU, no
dropout and flash / fused SDPA attention, which store no ``s x s`` scores), in elements of ``s * b``:

  * transformer-engine's layer spec (GPU): ``4h``, divided by ``tp`` only with sequence parallelism: the two
    RMSNorm inputs and outputs (the outputs are the inputs of the fused QKV and FC1 matmuls);
  * ``(2h + 2 g d + 3f) / tp``: q, k, v after RoPE (``h + 2 g d``), the attention output (``h``, also the input
    of the output projection), the FC1 output (``2f``, SwiGLU's input) and the SwiGLU output (``f``, FC2's input);
    the ``h`` of q and of the attention output is the query width ``n_q d`` (Qwen3: 8192 at hidden 5120 for 32B),
    plus the QK-norm's inputs (``n_q d + g d``) where the family has it;
  * with full recomputation (Sec. 4.1) a layer keeps only its input (``h``, divided by ``tp`` with sequence
    parallelism) and one layer's full set is live while it is recomputed; selective recomputation drops the
    attention scores, which flash attention never stores, so it is counted as none;
  * the local layer spec (CPU, or a GPU without transformer-engine): :func:`layer_activation_elements`;
  * the 1F1B pipeline schedule keeps ``min(pp - stage, micro batches)`` micro batches in flight on a stage
    (Sec. 4.2.3), times ``1 + (pp - 1) / (pp * vpp)`` with interleaving; context parallelism divides ``s``;
  * the last stage's output layer and cross entropy keep ``c * s * b * V / t`` bytes at their peak, ``c`` per logit
    by the cross entropy the model runs (:func:`cross_entropy_kind`; ``e`` the activation element size):
    transformer-engine's ``parallel_cross_entropy`` (GPU with TE) keeps only the logits and writes their gradient
    in place, ``c = e`` (``transformer_engine/pytorch/cross_entropy.py``); megatron's native fused one (GPU
    without TE) holds the logits, their fp32 copy and the fp32 softmax at once in forward, ``c = e + 8``
    (``megatron/core/fusions/fused_cross_entropy.py``; measured on an H200 with ``benchmarks/plan_vs_gpu.py``:
    5.8 GiB over the kept layer inputs at 4096 tokens x 151936 vocab, bf16); megatron's unfused
    ``vocab_parallel_cross_entropy`` (CPU, TP > 1) the logits and an fp32 softmax, ``c = e + 4``; on CPU at TP=1
    the fused, chunked :func:`afm_core.models.cross_entropy.linear_cross_entropy` stores no logits (``c = 0``).

Not counted: allocator fragmentation, the CUDA context and NCCL buffers (the plan adds
:data:`afm_core.launch.plan_estimates.GPU_OVERHEAD_BYTES`), communication buckets, and the optimizer step's temporaries
(with the fused AdamW, one fp32 copy of the largest parameter: below the forward-backward peak).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from afm_core.config.lora import LoRAConfig
from afm_core.models.arch import ModelArch


@dataclass(frozen=True)
class StageState:
    """Bytes of one rank's model states on pipeline stage ``pp_rank`` (TP rank 0, DP rank ``dp_rank``)."""

    pp_rank: int
    params: int  # parameter elements of this rank (unpadded)
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    master_bytes: int  # the fp32 master weights inside optimizer_bytes (0 for fp32 parameters)
    layers: int  # decoder layers on this rank (all its virtual chunks)
    first: bool  # holds the embedding
    last: bool  # holds the output layer
    adapter_params: int = 0  # LoRA adapter elements of this rank inside params (0: full fine-tuning)

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@contextlib.contextmanager
def fake_world(world_size: int, rank: int, *, tp: int, pp: int, cp: int = 1, vpp: int | None = None) -> Iterator[Any]:
    """A fake ``torch.distributed`` world of ``world_size`` ranks seen from ``rank``, with megatron's TP/PP/DP
    groups; no process is started and no collective communicates. Yields megatron's ``parallel_state``.

    Raises:
        RuntimeError: a process group is already initialised in this process.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from afm_core.engine.distributed import model_parallel_groups

    if dist.is_initialized():
        raise RuntimeError("fake_world: torch.distributed is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield model_parallel_groups(tp, pp, cp=cp, vpp=vpp, create_gloo_process_groups=False)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@contextlib.contextmanager
def _cuda_as_meta() -> Iterator[None]:
    """Megatron allocates DDP buffers on ``torch.cuda.current_device()`` and moves the last stage's copy of tied
    embeddings with ``.cuda()``: make those ``meta`` meanwhile (no CUDA here, and no memory anywhere)."""
    saved_device, saved_cuda = torch.cuda.current_device, torch.Tensor.cuda

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self if self.is_meta else saved_cuda(self, *args, **kwargs)

    torch.cuda.current_device = lambda: "meta"  # type: ignore[assignment,return-value]
    torch.Tensor.cuda = cuda  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = saved_device  # type: ignore[method-assign]
        torch.Tensor.cuda = saved_cuda  # type: ignore[method-assign]


def model_state(
    hf_config: Any,
    *,
    world_size: int,
    tp: int,
    pp: int,
    vpp: int | None = None,
    cp: int = 1,
    params_dtype: torch.dtype,
    distributed_optimizer: bool,
    on_gpu: bool,
    dp_rank: int = 0,
    lora: LoRAConfig | None = None,
) -> list[StageState]:
    """The model states of TP rank 0 / DP rank ``dp_rank`` of every pipeline stage, built on the meta device
    (module docstring). Ranks of one stage differ by at most the distributed optimizer's shard padding.

    Args:
        hf_config: a transformers ``LlamaConfig`` / ``Qwen2Config``.
        world_size: ranks of the job (``dp = world_size / (tp * pp * cp)``).
        params_dtype: the training dtype (bf16 on GPU, fp32 or bf16 on CPU).
        on_gpu: the job runs on GPUs (DDP overlaps and buckets its reductions there when DP > 1).
        lora: ``model.lora`` when it is on: :func:`afm_core.models.lora.apply_lora` adds the adapters to the meta
            chunks and freezes the base before DDP wraps them, as the trainer does, so the gradient buffers and
            the optimizer hold the adapters only; the frozen base stays in ``params_dtype`` (no fp32 master).
    Raises:
        ValueError: ``world_size`` not a multiple of ``tp * pp * cp``, or a size that does not split the model.
        RuntimeError: a process group is already initialised in this process.
    """
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.transformer.module import Float16Module

    from afm_core.engine.core import ddp_config
    from afm_core.models.gpt import build_gpt_model, mcore_config_from_hf

    if world_size % (tp * pp * cp):
        raise ValueError(f"world size {world_size} is not a multiple of tp * pp * cp = {tp} * {pp} * {cp}")
    dp = world_size // (tp * pp * cp)
    ddp = ddp_config(distributed_optimizer=distributed_optimizer, on_gpu=on_gpu, dp=dp)
    optimizer_bytes_per_element = 8 + (0 if params_dtype == torch.float32 else 4)
    stages = []
    for stage in range(pp):
        rank = stage * tp * cp * dp + dp_rank * tp * cp  # megatron's default order tp-cp-ep-dp-pp
        with fake_world(world_size, rank, tp=tp, pp=pp, cp=cp, vpp=vpp) as ps:
            assert ps.get_pipeline_model_parallel_rank() == stage and ps.get_data_parallel_rank() == dp_rank
            config = mcore_config_from_hf(
                hf_config,
                tp=tp,
                pp=pp,
                params_dtype=params_dtype,
                virtual_pipeline_model_parallel_size=vpp,
                use_cpu_initialization=True,
                **({"context_parallel_size": cp} if cp > 1 else {}),
            )
            chunks = []
            with torch.device("meta"), _cuda_as_meta():
                for vp_stage in range(vpp or 1):
                    where = vp_stage if vpp else None
                    chunks.append(
                        build_gpt_model(
                            hf_config,
                            config,
                            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=where),
                            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=where),
                            vp_stage=where,
                        )
                    )
            adapters = 0
            if lora is not None and lora.enabled:
                from afm_core.models.lora import apply_lora

                adapters = apply_lora(chunks, lora)
            first = any(chunk.pre_process for chunk in chunks)
            last = any(chunk.post_process for chunk in chunks)
            layers = sum(len(chunk.decoder.layers) for chunk in chunks)
            if config.bf16:  # as the trainer wraps them: every floating parameter in bf16
                chunks = [Float16Module(config, m) for m in chunks]
            with _cuda_as_meta():
                wrapped = [
                    DistributedDataParallel(config=config, ddp_config=ddp, module=m, disable_bucketing=i > 0)
                    for i, m in enumerate(chunks)
                ]
            params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
            frozen = [p for chunk in chunks for p in chunk.parameters() if not p.requires_grad]  # LoRA's base
            frozen_bytes = sum(p.numel() * p.element_size() for p in frozen)
            buffers = [b for chunk in wrapped for b in chunk.buffers + chunk.expert_parallel_buffers]
            grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
            if distributed_optimizer:  # the contiguous buffer holds the trained parameters only
                param_bytes = frozen_bytes + sum(b.param_data.numel() * b.param_data.element_size() for b in buffers)
                owned = 0
                for buffer in buffers:
                    for buckets in DistributedOptimizer._build_gbuf_range_map(buffer).values():
                        for bucket in buckets:  # this DP rank's shard of each bucket
                            owned += sum(r["param"].size for r in bucket["param_map"].values())
                optimizer_elements = owned
            else:
                param_bytes = sum(p.numel() * p.element_size() for chunk in chunks for p in chunk.parameters())
                optimizer_elements = params - sum(p.numel() for p in frozen)
            master = optimizer_elements * 4 if params_dtype != torch.float32 else 0
            stages.append(
                StageState(
                    pp_rank=stage,
                    params=params,
                    param_bytes=param_bytes,
                    grad_bytes=grad_bytes,
                    optimizer_bytes=optimizer_elements * optimizer_bytes_per_element,
                    master_bytes=master,
                    layers=layers,
                    first=first,
                    last=last,
                    adapter_params=adapters,
                )
            )
    return stages


def layer_activation_elements(
    arch: ModelArch, *, tp: int, sequence_parallel: bool, transformer_engine: bool = True
) -> dict[str, float]:
    """Elements saved for backward by one decoder layer per token of a micro batch (module docstring):
    ``{"full": all saved tensors, "input": the layer input kept under full recomputation}``.

    ``transformer_engine=False``: the local layer spec (:mod:`afm_core.models.local_spec`; CPU, or a GPU without
    transformer-engine: there measured within 4% with :func:`activations`, ``benchmarks/plan_vs_gpu.py``), whose fused norm keeps
    only the norm input (``2h`` per layer, never sequence parallel), whose attention keeps q and k after RoPE
    next to the fused QKV output and a copy of its output for the projection (``4h + 3 g d``), and whose MLP
    keeps the FC1 output only (``2f``). The attention terms are of the query width ``q = n_q d`` (``h`` but for
    Qwen3, whose ``head_dim`` is independent of ``h``); with QK-norm (Qwen3) its inputs ``q + g d`` are kept too
    (transformer-engine's norm), twice on the local spec (the input and the normalised value).
    """
    h, f, gd = arch.hidden_size, arch.ffn_hidden_size, arch.num_query_groups * arch.head_dim
    q = arch.num_attention_heads * arch.head_dim  # the query / attention-output width (h unless Qwen3-like)
    qk = q + gd if arch.qk_layernorm else 0  # the QK-norm's inputs (Qwen3)
    if not transformer_engine:
        return {"full": 2 * h + (4 * q + 3 * gd + 2 * f + 2 * qk) / tp, "input": h}
    replicated = 4 * h / (tp if sequence_parallel else 1)
    sharded = (2 * q + 2 * gd + 3 * f + qk) / tp
    return {"full": replicated + sharded, "input": h / (tp if sequence_parallel else 1)}


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one rank of a pipeline stage during training."""

    per_layer_micro_batch: int  # one layer, one micro batch, all saved tensors
    layers: int  # the stage's in-flight micro batches' layer activations (under the recompute setting)
    logits: int  # output layer + cross entropy (last stage only)
    in_flight: float  # micro batches in flight on the stage

    @property
    def total(self) -> int:
        return self.layers + self.logits


def cross_entropy_kind(*, on_gpu: bool, tp: int, transformer_engine: bool) -> str:
    """Which output layer + cross entropy the last stage runs (module docstring): ``"te"`` (transformer-engine's
    ``parallel_cross_entropy``), ``"native"`` (megatron's fused one), ``"unfused"`` (megatron's
    ``vocab_parallel_cross_entropy``) or ``"chunked"`` (:func:`afm_core.models.cross_entropy.linear_cross_entropy`), as
    :func:`afm_core.models.gpt.platform_fusions` and ``_GPTModel._postprocess`` choose it."""
    if on_gpu:
        return "te" if transformer_engine else "native"
    return "unfused" if tp > 1 else "chunked"


def logit_bytes(kind: str, element_size: int) -> int:
    """Bytes per logit element the cross entropy ``kind`` (:func:`cross_entropy_kind`) holds at its peak."""
    return {"te": element_size, "native": element_size + 8, "unfused": element_size + 4, "chunked": 0}[kind]


def activations(
    arch: ModelArch,
    stage: StageState,
    *,
    pp: int,
    vpp: int | None,
    tp: int,
    cp: int,
    seq_length: int,
    micro_batch_size: int,
    num_microbatches: int,
    sequence_parallel: bool,
    recompute: str | None,
    element_size: int,
    on_gpu: bool,
    transformer_engine: bool | None = None,
    adapter_bytes_per_token: int = 0,
) -> Activations:
    """Activation bytes of ``stage`` (module docstring).

    Args:
        seq_length, micro_batch_size: tokens per sequence and sequences per micro batch.
        num_microbatches: micro batches per optimizer step on a DP rank.
        recompute: ``None``, ``"selective"`` or ``"full"`` (``parallel.recompute``).
        element_size: bytes per activation element (2 for bf16, 4 for fp32).
        on_gpu: the job runs on GPUs; on CPU the local layer spec, and at TP=1 the fused, chunked output layer +
            loss (:func:`afm_core.models.cross_entropy.linear_cross_entropy`).
        transformer_engine: the GPU job has transformer-engine (its layer spec and cross entropy); None: as
            ``on_gpu`` (``requirements/gpu.txt`` installs it). Without it a GPU job runs the local layer spec and
            megatron's native fused cross entropy.
        adapter_bytes_per_token: what LoRA adapters save for backward per token in one decoder layer, on top of
            the base layer's tensors (:func:`afm_core.launch.plan_estimates.lora_activation_bytes`; 0: none).
    """
    te = on_gpu if transformer_engine is None else transformer_engine and on_gpu
    tokens = seq_length // cp * micro_batch_size
    per_layer = layer_activation_elements(arch, tp=tp, sequence_parallel=sequence_parallel, transformer_engine=te)
    full_layer = int(per_layer["full"] * tokens * element_size) + adapter_bytes_per_token * tokens
    in_flight = float(min(pp - stage.pp_rank, num_microbatches))
    if vpp:
        in_flight *= 1 + (pp - 1) / (pp * vpp)
    if recompute == "full":
        kept = int(per_layer["input"] * tokens * element_size)
        layers = int(in_flight * stage.layers * kept) + full_layer
    else:
        layers = int(in_flight * stage.layers * full_layer)
    logits = 0
    if stage.last:
        per_logit = logit_bytes(cross_entropy_kind(on_gpu=on_gpu, tp=tp, transformer_engine=te), element_size)
        logits = int(per_logit * tokens * arch.vocab_size / tp)
    return Activations(full_layer, layers, logits, in_flight)
