"""LoRA adapters on this rank's Megatron model chunks, sharded as tensor parallelism shards their base.

LoRA (Hu et al. 2021, eq. 3): a frozen linear ``y = W x`` becomes ``y = W x + (alpha / r) * B A dropout(x)``
with ``A [r, in]`` (kaiming-uniform, PEFT's ``reset_lora_parameters`` in ``peft/tuners/lora/layer.py``) and
``B [out, r]`` (zeros, so the adapted model starts as the base model, exactly). The targets are the local spec's
attention and MLP projections (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``). The adapters
are two parameters on the linear module itself (``<module>.lora_A``, ``<module>.lora_B``): the base parameters
keep their names, so the HF weight mapping and the checkpoints of the base are unchanged.

Tensor parallelism, as Megatron-Bridge's ``megatron/bridge/peft/lora.py`` (``ParallelLinearAdapter``) shards it:

* column-parallel base (``linear_qkv``, ``linear_fc1``: ``W [out/p, in]``, input replicated): ``A [r, in]``
  replicated, ``B [out/p, r]`` split by output rows like ``W`` (so ``B`` has ``W``'s row layout: megatron's fused
  q/k/v per query group, fc1's ``[gate; up]`` of this rank). ``h = A x`` is computed on every rank and passed
  through megatron's ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce of ``dh`` backward):
  ``dA`` and ``dx`` are then whole and equal on every TP rank.
* row-parallel base (``linear_proj``, ``linear_fc2``: ``W [out, in/p]``, input split): ``A [r, in/p]`` split by
  input columns like ``W``, ``B [out, r]`` replicated; ``h = A_p x_p`` is summed over the TP group
  (``reduce_from_tensor_model_parallel_region``) before ``B``.

So at every TP size, ``B_local @ A_local`` has the local weight's shape and layout (:func:`merged_weight`). The
initial ``A`` is drawn whole, from a generator seeded by the layer number and module name, and sliced for this
rank: TP=1 and TP=p runs hold the same adapters. For the RMSNorm-fused column-parallel linears of the local spec
(:class:`~afm_core.models.local_spec.NormColumnParallelLinear`) the adapter's input is the normalised input, as
for PEFT on HF's ``q_proj`` / ``gate_proj``. Sequence parallelism and the transformer-engine spec are not covered
(:func:`apply_lora` raises).

Full recomputation (``parallel.recompute=full``): megatron's ``tensor_parallel.checkpoint`` is a reentrant
``autograd.Function`` over each layer's input, whose output requires grad only when that input does, and with the
embedding frozen the first layer's input does not: no layer would get a gradient. :func:`apply_lora` then marks the
embedding's output as requiring grad, as transformers' ``enable_input_require_grads`` does for PEFT under gradient
checkpointing (``modeling_utils.py``).

Shapes: ``x [s, b, in]`` (``[t, 1, in]`` packed); ``p`` the TP size; ``r`` the rank.
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.transformer_layer import TransformerLayer

from afm_core.models.local_spec import NormColumnParallelLinear

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


class LoRAConfig(Protocol):
    """The adapter settings this module reads: ``model.lora`` (``afm_core.config.lora.LoRAConfig``, a layer
    above ``models``)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]

    @property
    def enabled(self) -> bool: ...

    @property
    def scale(self) -> float: ...


@dataclass
class _Adapter:
    """What the forward hook of one adapted linear reads."""

    config: LoRAConfig
    column: bool  # column-parallel base (else row-parallel)
    tp_group: torch.distributed.ProcessGroup | None  # None at TP=1
    enabled: bool = True


def is_adapter_name(name: str) -> bool:
    """Whether a parameter / state-dict name is an adapter's (``...lora_A`` / ``...lora_B``)."""
    return name.endswith(ADAPTER_SUFFIXES)


def _tp(module: torch.nn.Module) -> tuple[torch.distributed.ProcessGroup | None, int, int]:
    group = getattr(module, "tp_group", None)
    if group is None or group.size() == 1:
        return None, 0, 1
    return group, group.rank(), group.size()


def _seed(layer_number: int, name: str) -> int:
    return zlib.crc32(f"{layer_number}.{name}".encode())


def _attach(module: torch.nn.Module, name: str, layer_number: int, lora: LoRAConfig) -> int:
    if module.config.sequence_parallel:
        raise NotImplementedError("LoRA does not cover sequence parallelism (parallel.sequence_parallel)")
    group, rank, size = _tp(module)
    weight = module.weight
    column = isinstance(module, ColumnParallelLinear)
    r = lora.rank
    in_full = weight.shape[1] * (1 if column else size)
    a = torch.empty(r, in_full, dtype=torch.float32)
    torch.nn.init.kaiming_uniform_(
        a, a=math.sqrt(5), generator=torch.Generator().manual_seed(_seed(layer_number, name))
    )
    if not column:  # this rank's input columns, as RowParallelLinear splits W
        a = a[:, rank * weight.shape[1] : (rank + 1) * weight.shape[1]]
    module.lora_A = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
    module.lora_B = torch.nn.Parameter(torch.zeros(weight.shape[0], r, dtype=weight.dtype, device=weight.device))
    if size > 1:  # the split one carries megatron's TP attributes (grad-norm counting, checkpoint gathers)
        set_tensor_model_parallel_attributes(module.lora_B if column else module.lora_A, True, 0 if column else 1, 1)
    module.lora_dropout = torch.nn.Dropout(lora.dropout) if lora.dropout else torch.nn.Identity()
    module._afm_lora = _Adapter(lora, column, group)
    module.lora_delta = functools.partial(_delta, module)
    module.register_forward_hook(_add_delta)
    return module.lora_A.numel() + module.lora_B.numel()


def _adapter_input(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input the adapter sees: the normalised input of an RMSNorm-fused linear (computed as its forward does,
    differentiable), else the linear's input."""
    if isinstance(module, NormColumnParallelLinear):
        x32 = x.float()  # one fp32 copy, kept once for backward by both products
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + module.eps)
        return (x32 * rstd).to(x.dtype) * module.layer_norm_weight
    return x


def _delta(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``scale * B A dropout(x)`` of the linear's input ``x`` (``[s, b, out/p]`` column-parallel, ``[s, b, out]``
    row-parallel: already summed over TP), or None while the adapters are disabled. Bound to each adapted module as
    ``module.lora_delta``: the local spec's fused SwiGLU MLP, which never calls ``linear_fc2``'s forward, adds it
    for fc2 itself."""
    adapter: _Adapter = module._afm_lora
    if not adapter.enabled:
        return None
    h = F.linear(module.lora_dropout(x), module.lora_A)  # [s, b, r]
    if adapter.tp_group is not None:
        if adapter.column:  # dh summed over the ranks' B slices in backward: dA and dx whole on every rank
            h = copy_to_tensor_model_parallel_region(h, group=adapter.tp_group)
        else:  # each rank's A_p x_p is a partial sum
            h = reduce_from_tensor_model_parallel_region(h, group=adapter.tp_group)
    return F.linear(h, module.lora_B) * adapter.config.scale


def _add_delta(module: torch.nn.Module, args: tuple, output: tuple[torch.Tensor, torch.Tensor | None]):
    """Forward hook: ``(y + delta, bias)`` of the linear's ``(y, bias)`` output (:func:`_delta`). The base output is
    computed as without adapters, so with ``B = 0`` the result is the base model's to the bit."""
    delta = _delta(module, _adapter_input(module, args[0]))
    if delta is None:
        return output
    y, bias = output
    return y + delta, bias


def _output_requires_grad(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook on a frozen embedding under full recomputation (module docstring): its output ``[s, b, h]``
    requires grad while gradients are recorded."""
    if torch.is_grad_enabled():
        output.requires_grad_(True)
    return output


def adapted_modules(chunks: Sequence[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every adapted linear in ``chunks`` (wrapped or not), names as in ``named_modules()``
    of the chunk."""
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if hasattr(module, "_afm_lora"):
                yield name, module


def apply_lora(chunks: Sequence[torch.nn.Module], lora: LoRAConfig) -> int:
    """Add adapters to the ``lora.target_modules`` linears of ``chunks`` (unwrapped GPTModel chunks, base weights
    already loaded: the HF loader maps every parameter name) and freeze every other parameter. Call it before the
    trainer core wraps the chunks, so that DDP's gradient buffers and the optimizer hold the adapters only.

    Returns:
        this rank's adapter parameter count.
    Raises:
        ValueError: ``lora`` is off (rank 0).
        NotImplementedError: a target that is not a megatron column/row-parallel linear (the transformer-engine
            spec), or sequence parallelism.
    """
    if not lora.enabled:
        raise ValueError("apply_lora: model.lora.rank is 0 (LoRA off)")
    count = 0
    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
        embedding = getattr(chunk, "embedding", None)  # the first pipeline stage's
        if embedding is not None and chunk.config.recompute_granularity == "full":
            embedding.register_forward_hook(_output_requires_grad)
        for layer in chunk.modules():
            if not isinstance(layer, TransformerLayer):
                continue
            for name, module in layer.named_modules():
                leaf = name.rsplit(".", 1)[-1]
                if leaf not in lora.target_modules:
                    continue
                if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    raise NotImplementedError(
                        f"LoRA on {name}: {type(module).__name__} is not a megatron column/row-parallel linear "
                        "(the local layer spec's; the transformer-engine spec is not covered)"
                    )
                count += _attach(module, leaf, layer.layer_number, lora)
    if count == 0:
        raise ValueError(f"apply_lora: none of model.lora.target_modules={lora.target_modules} is in the model")
    return count


def adapter_named_parameters(chunks: Sequence[torch.nn.Module]) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every adapter parameter of ``chunks`` (this rank's shards), in module order."""
    return [(n, p) for chunk in chunks for n, p in chunk.named_parameters() if is_adapter_name(n)]


def lora_config_of(chunks: Sequence[torch.nn.Module]) -> LoRAConfig | None:
    """The :class:`LoRAConfig` :func:`apply_lora` applied to ``chunks``, or None (no adapters)."""
    for _, module in adapted_modules(chunks):
        return module._afm_lora.config
    return None


@contextlib.contextmanager
def adapters_disabled(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Forwards inside compute the base model only: the RL reference policy without a second copy of the weights
    (PEFT's ``disable_adapter()``, verl's LoRA reference in ``verl/workers/fsdp_workers.py``)."""
    adapters = [module._afm_lora for _, module in adapted_modules(chunks)]
    states = [a.enabled for a in adapters]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter, state in zip(adapters, states, strict=True):
            adapter.enabled = state


def merged_weight(module: torch.nn.Module) -> torch.Tensor:
    """This rank's ``W + scale * B @ A`` of an adapted linear (``W``'s local shape ``[out/p, in]`` or
    ``[out, in/p]``, dtype and layout), computed in fp32; the module is not changed."""
    scale = module._afm_lora.config.scale
    delta = module.lora_B.detach().float() @ module.lora_A.detach().float()
    return (module.weight.detach().float() + scale * delta).to(module.weight.dtype)
