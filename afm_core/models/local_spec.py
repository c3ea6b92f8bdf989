"""Megatron's local (non transformer-engine) GPT layer spec, lean in activation memory.

Megatron-core's local spec (``megatron/core/models/gpt/gpt_layer_specs.py`` ``get_gpt_layer_local_spec``) runs
RMSNorm, SwiGLU and the linear layers as separate modules, each keeping its own tensors for backward. At
SmolLM2-135M, 1024 tokens, fp32, one layer keeps 56 MiB: the RMSNorms their input and normalised output
(4.5 MiB each) and the following linear the normalised output again (2.25 MiB); the MLP its fc1 output
(12 MiB), ``silu(gate)`` (6 MiB), a copy of ``up`` (``x_linear + glu_linear_offset``, 6 MiB) and the SwiGLU
output for fc2 (6 MiB). This spec keeps what the backward's matrix products need and recomputes the elementwise
rest there (as transformer-engine's fused modules do):

* :class:`NormColumnParallelLinear`: RMSNorm fused into the next column-parallel linear (``linear_qkv`` and
  ``linear_fc1``, named ``layer_norm_weight`` as in transformer-engine's ``LayerNormColumnParallelLinear``, so
  checkpoints and the HF mapping are those of the TE spec). It keeps the norm's input and the ``1/rms`` per
  token; the normalised input is recomputed in backward (one elementwise pass).
* :class:`SwiGLUMLP`: the MLP with ``silu(gate) * up`` fused into ``linear_fc2``: it keeps the fc1 output only;
  the SwiGLU output is recomputed in backward.

Per layer 56 -> 26 MiB at those sizes, with the same matrix products: nothing but elementwise work is done twice.

* :func:`lean_apply_rotary_pos_emb`: megatron's unfused RoPE (``megatron/core/models/common/embeddings/
  rope_utils.py`` ``_apply_rotary_pos_emb_bshd``/``_thd``) computes ``cos``/``sin`` of the frequencies in every
  layer, for query and key apart, builds ``rotate_half`` with a negation and a concatenation, and keeps its own
  ``cos``/``sin`` for backward (4 x ``[t, 1, 1, hn]`` fp32 per layer: 30 MiB over SmolLM2's 30 layers at 1024
  tokens). Here ``cos``/``sin`` are computed once per forward and shared by every layer (one storage kept for
  backward), and the rotation is two multiply-adds per half (the same values: ``out1 = x1 cos - x2 sin``,
  ``out2 = x2 cos + x1 sin``, RoFormer, Su et al. 2021, eq. 34). Megatron's ``Attention`` calls the function
  through its module attribute ``apply_rotary_pos_emb``, which :func:`local_layer_spec` points here; other cases
  (fused RoPE on GPU, interleaved or multi-latent RoPE, ``mscale``, context parallelism, partial rotary
  dimensions) go to megatron's function unchanged.
* :class:`HeadRMSNorm`: the QK-norm of Qwen3 (``qk_layernorm``): an RMSNorm over the last dimension (one head's
  ``head_dim`` values) of ``q`` / ``k`` ``[s, b, heads / p, hn]``, computed as HF's ``Qwen3RMSNorm``
  (transformers ``models/qwen3/modeling_qwen3.py``): statistics in fp32, the normalised value cast back to the
  input dtype, then the gain. Megatron's local spec would use ``torch.nn.RMSNorm``, which multiplies the gain
  before the cast.
Both compute in the parameters' dtype (fp32 on CPU), with the RMS statistics in fp32 as HF's ``LlamaRMSNorm``.

On CUDA the elementwise parts of the three (the norm and its backward, ``silu(gate) * up`` and its backward, the
rotation) run as ``torch.compile``'d functions (:func:`set_compiled_elementwise`): one generated kernel each where
eager PyTorch launches one per operation (up to a dozen for the norm's backward), which dominated a launch-bound
GPU step. The matrix products, the TP all-reduces and the gradient sinks stay as they are. The compiled functions
compute the same values (the elementwise intermediates in fp32 instead of rounding each to bf16); the CPU keeps
the eager kernels, which reuse their buffers (``out=``) for a lower resident set. With ``trainer.compile_layers``
each whole layer is compiled instead (:func:`compile_transformer_layers`), these parts traced into its graph.
Tensor parallelism as megatron's column/row parallel linears: ``NormColumnParallelLinear`` all-reduces the gradient
of its (replicated) input over the TP group in backward, before the norm's backward (as transformer-engine's
``LayerNormLinear`` does), and ``SwiGLUMLP`` all-reduces fc2's partial output in forward. Sequence parallelism,
biases on the MLP and other activations are not covered (the module raises, or falls back to megatron's MLP).

Shapes: ``[s, b, h]`` (or ``[t, 1, h]`` for packed ``thd`` micro batches); ``h`` the hidden size, ``f`` the
FFN size, ``p`` the TP size.

One module, past 400 lines: the spec's modules and their hand-written backward passes share the private
elementwise kernels (norm, SwiGLU, rotation) and the one switch that compiles them, so they sit together.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer import attention as megatron_attention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from afm_core.utils.host_memory import populate_for_write


def _weight_grad(grad_sink: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``a @ b``, the gradient of a weight: added into ``grad_sink`` (megatron DDP's fp32 ``main_grad``, as its
    gradient-accumulation fusion does, in the same matrix product) and None returned, or returned when there is
    no sink (autograd then stores it and DDP's hook adds it to ``main_grad``: one more tensor and pass)."""
    if grad_sink is None:
        return a @ b
    populate_for_write(grad_sink)  # its pages may be released (zero_by_release): no zero-page faults
    grad_sink.addmm_(a, b)
    return None


def _main_grad_sink(module: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor | None:
    """``weight.main_grad`` when the trainer enabled ``grad_into_main_grad`` on ``module`` and the weight is fp32
    (the sink's dtype), else None."""
    if not getattr(module, "grad_into_main_grad", False) or weight.dtype != torch.float32 or _in_compiled_region():
        return None  # a compiled region returns the gradient: AOTAutograd does not trace mutations of a sink
    return getattr(weight, "main_grad", None)


# None: compiled on CUDA tensors, eager on CPU ones (set_compiled_elementwise)
_COMPILED_ELEMENTWISE: list[bool | None] = [None]


def set_compiled_elementwise(enabled: bool | None) -> None:
    """Whether this process runs the local spec's elementwise parts as ``torch.compile``'d functions (module
    docstring): True on any device, False never, None (the default) on CUDA tensors only. Process-wide: the
    trainer sets it from ``trainer.compile``."""
    _COMPILED_ELEMENTWISE[0] = enabled


def _in_compiled_region() -> bool:
    """True while dynamo traces the caller: a layer compiled whole (``trainer.compile_layers``)."""
    return torch.compiler.is_compiling()


def _compiled(x: torch.Tensor) -> bool:
    """Whether the elementwise parts run as their pure-function twins (compiled alone, or traced into the
    compiled layer around them) rather than the eager buffer-reusing kernels."""
    if _in_compiled_region():
        return True
    setting = _COMPILED_ELEMENTWISE[0]
    return x.is_cuda if setting is None else setting


@functools.cache
def _compile_alone(fn: Any) -> Any:
    return torch.compile(fn)


def _compile(fn: Any) -> Any:
    """``torch.compile(fn)``, built on first use (shapes specialised, a second shape made dynamic: torch's
    default); ``fn`` itself inside a compiled region, which traces it into its own graph."""
    return fn if _in_compiled_region() else _compile_alone(fn)


def _rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x) * gamma, 1/rms(x) [..., 1] fp32)``: the compiled twin of :class:`_RMSNormLinear`'s forward."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * rstd).to(x.dtype) * gamma, rstd


def _rms_norm_backward(
    grad_normed: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, gamma: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d x, d gamma)`` of ``rmsnorm(x) * gamma`` from the gradient of its output: the compiled twin of
    :class:`_RMSNormLinear`'s backward (same formula)."""
    x_hat32 = x.float() * rstd
    grad_gamma = (grad_normed * x_hat32.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0)
    dy = (grad_normed * gamma).float()
    mean = (dy * x_hat32).mean(-1, keepdim=True)
    return ((dy - x_hat32 * mean) * rstd).to(x.dtype), grad_gamma


def _swiglu(y: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``y = [gate, up]`` (last dim)."""
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_backward(grad_act: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[d gate, d up]`` of :func:`_swiglu` from the gradient of its output: the compiled twin of
    :class:`_SwiGLULinear`'s backward (``d silu(g) / dg = sig * (1 + g * (1 - sig))``)."""
    gate, up = y.float().chunk(2, dim=-1)
    grad = grad_act.float()
    sig = torch.sigmoid(gate)
    grad_gate = grad * up * sig * (1 + gate * (1 - sig))
    return torch.cat([grad_gate, grad * gate * sig], dim=-1).to(y.dtype)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """``[t1 cos1 - sign t2 sin1, t2 cos2 + sign t1 sin2]`` (halves of the last dim): the rotation of
    :class:`_RotaryEmbedding` with ``sign=1``, its backward with ``sign=-1``."""
    h = t.shape[-1] // 2
    t1, t2 = t[..., :h], t[..., h:]
    return torch.cat([t1 * cos[..., :h] - sign * t2 * sin[..., :h], t2 * cos[..., h:] + sign * t1 * sin[..., h:]], -1)


class _RMSNormLinear(torch.autograd.Function):
    """``linear(rmsnorm(x) * gamma, weight, bias)``, keeping ``x`` and ``1/rms(x)`` for backward; ``d weight`` goes
    into ``grad_sink`` when one is given (:func:`_weight_grad`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        gamma: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        eps: float,
        tp_group: Any,
        grad_sink: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if _compiled(x):
            normed, rstd = _compile(_rms_norm)(x, gamma, eps)
        else:
            rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True).add_(eps))  # [..., 1] fp32
            normed = (x.float() * rstd).to(x.dtype).mul_(gamma)
        out = F.linear(normed, weight, bias)
        ctx.save_for_backward(x, rstd, gamma, weight)
        ctx.has_bias, ctx.tp_group, ctx.grad_sink, ctx.eps = bias is not None, tp_group, grad_sink, eps
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        x, rstd, gamma, weight = ctx.saved_tensors
        if _compiled(x):
            return _RMSNormLinear._compiled_backward(ctx, grad_out, x, rstd, gamma, weight)
        h = x.shape[-1]
        x_hat32 = x.float() * rstd  # the normalised input, recomputed (fp32)
        x_hat = x_hat32.to(x.dtype)  # in the input dtype: x_hat32 itself when that is fp32
        # one scratch tensor for the elementwise products (fp32 runs: three [t, h] temporaries in all, where each
        # product had one of its own; each fresh one is a new mapping, faulted in page by page on CPU)
        scratch = x_hat * gamma  # the norm's output, input of the weight's gradient
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[2]:
            grad_weight = _weight_grad(ctx.grad_sink, g.t(), scratch.reshape(-1, h))
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = g.sum(0)
        grad_normed = grad_out @ weight  # partial over TP ranks: each holds a slice of the output
        if ctx.tp_group is not None:
            torch.distributed.all_reduce(grad_normed, group=ctx.tp_group)
        grad_gamma = None
        if ctx.needs_input_grad[1]:
            grad_gamma = torch.mul(grad_normed, x_hat, out=scratch).reshape(-1, h).sum(0)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # d/dx of x * r, r = (mean(x^2) + eps)^-1/2:  r * (dy - x_hat * mean(dy * x_hat))
            dy = grad_normed.mul_(gamma).float()  # grad_normed is spent: in place
            product = torch.mul(dy, x_hat32, out=scratch) if scratch.dtype == dy.dtype else dy * x_hat32
            mean = product.mean(-1, keepdim=True)
            grad_x = dy.sub_(x_hat32.mul_(mean)).mul_(rstd).to(x.dtype)
        return grad_x, grad_gamma, grad_weight, grad_bias, None, None, None

    @staticmethod
    def _compiled_backward(ctx: Any, grad_out: torch.Tensor, x, rstd, gamma, weight):  # type: ignore[no-untyped-def]
        """:meth:`backward` with its elementwise parts compiled (:func:`_rms_norm`, :func:`_rms_norm_backward`)."""
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[2]:
            normed = _compile(_rms_norm)(x, gamma, ctx.eps)[0]  # the norm's output, recomputed
            grad_weight = _weight_grad(ctx.grad_sink, g.t(), normed.reshape(-1, x.shape[-1]))
            del normed
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = g.sum(0)
        grad_normed = grad_out @ weight
        if ctx.tp_group is not None:
            torch.distributed.all_reduce(grad_normed, group=ctx.tp_group)
        grad_x, grad_gamma = _compile(_rms_norm_backward)(grad_normed, x, rstd, gamma)
        return grad_x, grad_gamma, grad_weight, grad_bias, None, None, None


class _SwiGLULinear(torch.autograd.Function):
    """``linear(silu(gate) * up, weight)`` of ``y = [gate, up]`` (last dim), keeping only ``y`` for backward;
    ``d weight`` goes into ``grad_sink`` when one is given (:func:`_weight_grad`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, y: torch.Tensor, weight: torch.Tensor, grad_sink: torch.Tensor | None = None
    ) -> torch.Tensor:
        if _compiled(y):
            out = F.linear(_compile(_swiglu)(y), weight)
        else:
            gate, up = y.chunk(2, dim=-1)
            out = F.linear(F.silu(gate).mul_(up), weight)
        ctx.save_for_backward(y, weight)
        ctx.grad_sink = grad_sink
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        y, weight = ctx.saved_tensors
        if _compiled(y):
            grad_weight = None
            if ctx.needs_input_grad[1]:
                act = _compile(_swiglu)(y)
                grad_weight = _weight_grad(
                    ctx.grad_sink, grad_out.reshape(-1, grad_out.shape[-1]).t(), act.reshape(-1, act.shape[-1])
                )
                del act
            return _compile(_swiglu_backward)(grad_out @ weight, y), grad_weight, None
        gate, up = y.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        grad_weight = None
        if ctx.needs_input_grad[1]:
            act = silu * up
            grad_weight = _weight_grad(
                ctx.grad_sink, grad_out.reshape(-1, grad_out.shape[-1]).t(), act.reshape(-1, act.shape[-1])
            )
            del act
        grad_act = grad_out @ weight
        grad_y = torch.empty_like(y)  # [d gate, d up], written in place: no concatenation
        grad_gate, grad_up = grad_y.chunk(2, dim=-1)
        torch.mul(grad_act, silu, out=grad_up)
        del silu
        # d silu(g) / dg = sig * (1 + g * (1 - sig))
        torch.mul(grad_act, up, out=grad_gate).mul_(sig.mul_((1 - sig).mul_(gate).add_(1)))
        return grad_y, grad_weight, None


class NormColumnParallelLinear(ColumnParallelLinear):
    """Megatron's ``ColumnParallelLinear`` with the preceding RMSNorm fused in (module docstring).

    Parameters: ``weight [out/p, h]``, ``bias [out/p]`` (when asked for), ``layer_norm_weight [h]`` (RMSNorm
    gain, replicated over TP ranks). ``forward(x [s, b, h]) -> (y [s, b, out/p], None)``. ``grad_into_main_grad``
    (set by the trainer when megatron's DDP reduces gradients only after backward): ``d weight`` is added straight
    into the fp32 ``weight.main_grad`` by its matrix product.

    Raises:
        NotImplementedError: a configuration this fusion does not cover (LayerNorm, zero-centred gamma,
            sequence parallelism, a gathered output, expert parallelism or a weight passed at call time).
    """

    grad_into_main_grad = False

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs: Any):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise NotImplementedError("NormColumnParallelLinear fuses a plain RMSNorm only")
        if config.sequence_parallel or kwargs.get("gather_output") or kwargs.get("is_expert"):
            raise NotImplementedError(
                "NormColumnParallelLinear does not cover sequence parallelism, gathered outputs or experts"
            )
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(
            torch.ones(input_size, dtype=config.params_dtype, device=self.weight.device)
        )

    def forward(  # type: ignore[override]
        self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if weight is not None or runtime_gather_output:
            raise NotImplementedError("NormColumnParallelLinear: no weight or gather at call time")
        tp_group = self.tp_group if self.tp_group is not None and self.tp_group.size() > 1 else None
        bias = None if self.skip_bias_add else self.bias
        sink = _main_grad_sink(self, self.weight)
        out = _RMSNormLinear.apply(input_, self.layer_norm_weight, self.weight, bias, self.eps, tp_group, sink)
        return out, (self.bias if self.skip_bias_add else None)


class SwiGLUMLP(MLP):
    """Megatron's ``MLP`` with the SwiGLU activation fused into ``linear_fc2`` (module docstring).

    ``forward(x [s, b, h]) -> (out [s, b, h], None)``. Other MLPs (biases, another activation, a GLU offset or
    clamp, per-token scales of experts) run megatron's ``MLP.forward`` unchanged. ``grad_into_main_grad``: as for
    :class:`NormColumnParallelLinear`, for ``linear_fc2``'s weight.
    """

    grad_into_main_grad = False

    def _fusable(self, per_token_scale: torch.Tensor | None) -> bool:
        c = self.config
        return (
            per_token_scale is None
            and c.gated_linear_unit
            and self.activation_func is F.silu
            and not c.add_bias_linear
            and not c.glu_linear_offset
            and c.activation_func_clamp_value is None
            and not c.sequence_parallel
        )

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs: Any):
        if not self._fusable(per_token_scale):
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        y, _ = self.linear_fc1(hidden_states)  # [s, b, 2f/p]: [gate, up] of this TP rank
        sink = _main_grad_sink(self, self.linear_fc2.weight)
        out = _SwiGLULinear.apply(y, self.linear_fc2.weight, sink)  # [s, b, h], partial over TP ranks
        if self.tp_group is not None and self.tp_group.size() > 1:
            out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        adapter = getattr(self.linear_fc2, "lora_delta", None)  # afm_core.models.lora: fc2 never runs its forward
        if adapter is not None:
            gate, up = y.chunk(2, dim=-1)
            delta = adapter(F.silu(gate) * up)  # [s, b, h] whole (the row-parallel adapter reduces itself), or None
            out = out if delta is None else out + delta
        return out, None


class GroupRowParallelLinear(RowParallelLinear):
    """Megatron's ``RowParallelLinear`` (``linear_proj``, ``linear_fc2``) handing its own TP group to the linear
    function. Megatron's ``forward`` hands it ``tp_group=None`` (``megatron/core/tensor_parallel/layers.py``), which
    the function resolves back to the default TP group (the same group) through
    ``get_tensor_model_parallel_group_if_none``, calling ``warnings.warn`` on rank 0 at every call: a graph break
    in a compiled layer (``trainer.compile_layers``). Values, parameters and checkpoints are megatron's."""

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("tp_group", ...) is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)


class _RotaryEmbedding(torch.autograd.Function):
    """``t * cos + rotate_half(t) * sin`` (halves not interleaved) of ``t [..., hn]``; ``cos``/``sin`` broadcast
    to ``t``'s shape (no gradient) are all it keeps for backward."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        if _compiled(t):
            return _compile(_rotate)(t, cos, sin, 1.0)
        h = t.shape[-1] // 2
        out = torch.empty(torch.broadcast_shapes(t.shape, cos.shape), dtype=t.dtype, device=t.device)
        torch.mul(t[..., :h], cos[..., :h], out=out[..., :h]).addcmul_(t[..., h:], sin[..., :h], value=-1.0)
        torch.mul(t[..., h:], cos[..., h:], out=out[..., h:]).addcmul_(t[..., :h], sin[..., h:])
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        if _compiled(grad):
            return _compile(_rotate)(grad, cos, sin, -1.0), None, None
        h = grad.shape[-1] // 2
        out = torch.empty_like(grad)
        torch.mul(grad[..., :h], cos[..., :h], out=out[..., :h]).addcmul_(grad[..., h:], sin[..., h:])
        torch.mul(grad[..., h:], cos[..., h:], out=out[..., h:]).addcmul_(grad[..., :h], sin[..., :h], value=-1.0)
        return out, None, None


# the last (key, freqs, cu_seqlens, cos, sin): every layer of a forward pass gets the same freqs and cu_seqlens tensors
_COS_SIN: list[tuple[Any, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]] = []


def _cos_sin(freqs: torch.Tensor, cu_seqlens: torch.Tensor | None, rows: int, dtype: torch.dtype):
    """``cos``/``sin`` of the frequencies of each position as megatron's unfused RoPE picks them: ``freqs [s, 1, 1,
    hn]`` as they are (``bshd``), or for ``rows`` packed ``thd`` rows (``cu_seqlens``, one context-parallel rank,
    covering the rows from 0) the rows' own positions when ``freqs`` covers all of them, else each row's position
    in its document (``freqs[:len]`` of every document), then ``[t, 1, hn]``. The positions are gathered on the
    device (``searchsorted`` of the rows in ``cu_seqlens``): no host loop over documents, no device sync. Cached for
    the next layer of the same forward pass (the same ``freqs`` and ``cu_seqlens`` tensors)."""
    if _in_compiled_region():  # the compiled layer fuses cos/sin into the rotation: nothing to cache
        return _pick_cos_sin(freqs, cu_seqlens, rows, dtype)
    key = (freqs._version, tuple(freqs.shape), None if cu_seqlens is None else cu_seqlens._version, rows, dtype)
    if _COS_SIN and _COS_SIN[0][0] == key and _COS_SIN[0][1] is freqs and _COS_SIN[0][2] is cu_seqlens:
        return _COS_SIN[0][3], _COS_SIN[0][4]
    cos, sin = _pick_cos_sin(freqs, cu_seqlens, rows, dtype)
    _COS_SIN[:] = [(key, freqs, cu_seqlens, cos, sin)]
    return cos, sin


def _pick_cos_sin(freqs: torch.Tensor, cu_seqlens: torch.Tensor | None, rows: int, dtype: torch.dtype):
    """:func:`_cos_sin` without its cache."""
    picked = freqs
    if cu_seqlens is not None:
        picked = freqs.squeeze(1)  # [s, 1, hn]
        if freqs.shape[0] != rows:
            index = torch.arange(rows, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
            starts = cu_seqlens[torch.searchsorted(cu_seqlens, index, right=True) - 1]
            picked = picked.index_select(0, (index - starts).long())
    return torch.cos(picked).to(dtype), torch.sin(picked).to(dtype)


def lean_apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    config: Any,
    cu_seqlens: torch.Tensor | None = None,
    mscale: float = 1.0,
    cp_group: Any = None,
) -> torch.Tensor:
    """Megatron's ``apply_rotary_pos_emb`` (same arguments and values) for plain RoPE over the whole head
    dimension; the module docstring says what differs and what is passed on to megatron's function."""
    plain = (
        not config.apply_rope_fusion
        and not config.rotary_interleaved
        and not config.multi_latent_attention
        and mscale == 1.0
        and freqs.shape[-1] == t.shape[-1]
        and t.shape[-1] % 2 == 0
        and (cu_seqlens is None or (cp_group is not None and cp_group.size() == 1))
    )
    if not plain:
        return rope_utils.apply_rotary_pos_emb(
            t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group
        )
    cos, sin = _cos_sin(freqs, cu_seqlens, t.shape[0], t.dtype)
    return _RotaryEmbedding.apply(t, cos, sin)


class HeadRMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension of ``[..., hn]`` with a gain ``weight [hn]`` (module docstring): the
    ``q_layernorm`` / ``k_layernorm`` of megatron's ``SelfAttention`` (built with ``hidden_size = hn``; the same
    on every TP rank: megatron's ``finalize_model_grads`` sums its gradient over the TP group)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _compiled(x):
            return _compile(_rms_norm)(x, self.weight, self.eps)[0]
        return _rms_norm(x, self.weight, self.eps)[0]


def compile_transformer_layers(chunks: list[torch.nn.Module]) -> int:
    """``torch.compile`` each megatron ``TransformerLayer`` of the model chunks in place (``Module.compile``: the
    parameter names, checkpoints and DDP's gradient hooks stay as they are), as torchtitan compiles each
    transformer block (``torchtitan/models/llama3/infra/parallelize.py`` ``apply_compile``): one graph per layer for
    its forward and one for its backward, the same code for every layer (its parameters are graph inputs), where
    eager PyTorch launches a kernel per operation and runs megatron's Python layer code every step. The local
    spec's modules trace into it without a graph break (the elementwise twins, RoPE's ``cos``/``sin`` and the
    attention's device-side offsets are used inside a compiled region; :class:`GroupRowParallelLinear`).

    Packed ``thd`` micro batches on CUDA: the attention reads only device offsets there (their count is dynamic
    from the first micro batch, :class:`~afm_core.models.attention.PackedDocuments`), so a new document layout (new
    lengths, another number of documents) runs the graphs already built: at most three, for the first micro batch,
    the first with another longest document (RoPE's table length made dynamic) and the first of one document
    filling it (megatron's per-row RoPE branch). The CPU kernel attends per document with host offsets, constants
    of the graph (a recompilation per layout): use this on CUDA.

    Returns:
        the number of layers compiled.
    """
    layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compile()
    for block in (m for chunk in chunks for m in chunk.modules() if isinstance(m, TransformerBlock)):
        block.register_forward_pre_hook(_canonical_strides, with_kwargs=True)
    return len(layers)


def _canonical_strides(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The decoder's input as a view with the strides a layer's output has: megatron's embedding output ``[s, 1,
    h]`` (a transpose of ``[1, s, h]``) is contiguous with another stride on its size-1 dimension, which the compiled
    graph would guard on (one more compilation for the first layer)."""
    x = kwargs.get("hidden_states")
    if isinstance(x, torch.Tensor) and x.is_contiguous() and x.stride() != torch.empty(x.shape, device="meta").stride():
        kwargs["hidden_states"] = x.view(-1).view(x.shape)
    return args, kwargs


class _KnownMLPFilter(logging.Filter):
    """Drops megatron's "Unknown MLP type" warning, which ``TransformerLayer`` logs for every layer whose MLP is not
    exactly megatron's ``MLP`` (``transformer_layer.py``): :class:`SwiGLUMLP` is one, and the default kwargs it
    then gets (megatron's TP group) are the right ones."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type")


_TRANSFORMER_LAYER_LOG = logging.getLogger("megatron.core.transformer.transformer_layer")


def local_layer_spec(core_attention: type, qk_layernorm: bool = False) -> ModuleSpec:
    """Megatron's local GPT layer spec (RMSNorm, SwiGLU; with ``qk_layernorm`` the QK-norm :class:`HeadRMSNorm`)
    with the norms fused into ``linear_qkv`` / ``linear_fc1`` (:class:`NormColumnParallelLinear`), the SwiGLU into
    ``linear_fc2`` (:class:`SwiGLUMLP`), and ``core_attention`` as the attention kernel. Also points megatron's
    attention at :func:`lean_apply_rotary_pos_emb` (for the whole process: only the local spec is built where
    transformer-engine is absent)."""
    if not any(isinstance(f, _KnownMLPFilter) for f in _TRANSFORMER_LAYER_LOG.filters):
        _TRANSFORMER_LAYER_LOG.addFilter(_KnownMLPFilter())
    megatron_attention.apply_rotary_pos_emb = lean_apply_rotary_pos_emb  # type: ignore[assignment]
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")
    layer = spec.submodules
    layer.input_layernorm = IdentityOp
    layer.pre_mlp_layernorm = IdentityOp
    layer.sharded_state_dict_keys_map = {}  # the norms now have the names the keys map pointed to
    attention = layer.self_attention.submodules
    attention.linear_qkv = NormColumnParallelLinear
    attention.linear_proj = GroupRowParallelLinear
    attention.core_attention = core_attention
    if qk_layernorm:
        attention.q_layernorm = HeadRMSNorm
        attention.k_layernorm = HeadRMSNorm
    layer.mlp = ModuleSpec(
        module=SwiGLUMLP,
        submodules=MLPSubmodules(linear_fc1=NormColumnParallelLinear, linear_fc2=GroupRowParallelLinear),
    )
    return spec
