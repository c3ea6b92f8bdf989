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
Both compute in the parameters' dtype (fp32 on CPU), with the RMS statistics in fp32 as HF's ``LlamaRMSNorm``.
Tensor parallelism as megatron's column/row parallel linears: ``NormColumnParallelLinear`` all-reduces the gradient
of its (replicated) input over the TP group in backward, before the norm's backward (as transformer-engine's
``LayerNormLinear`` does), and ``SwiGLUMLP`` all-reduces fc2's partial output in forward. Sequence parallelism,
biases on the MLP and other activations are not covered (the module raises, or falls back to megatron's MLP).

Shapes: ``[s, b, h]`` (or ``[t, 1, h]`` for packed ``thd`` micro batches); ``h`` the hidden size, ``f`` the
FFN size, ``p`` the TP size.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig


class _RMSNormLinear(torch.autograd.Function):
    """``linear(rmsnorm(x) * gamma, weight, bias)``, keeping ``x`` and ``1/rms(x)`` for backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        gamma: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        eps: float,
        tp_group: Any,
    ) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True).add_(eps))  # [..., 1] fp32
        normed = (x.float() * rstd).to(x.dtype).mul_(gamma)
        out = F.linear(normed, weight, bias)
        ctx.save_for_backward(x, rstd, gamma, weight)
        ctx.has_bias, ctx.tp_group = bias is not None, tp_group
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        x, rstd, gamma, weight = ctx.saved_tensors
        x_hat = (x.float() * rstd).to(x.dtype)  # the normalised input, recomputed
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[2]:
            grad_weight = g.t() @ (x_hat * gamma).reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = g.sum(0)
        grad_normed = grad_out @ weight  # partial over TP ranks: each holds a slice of the output
        if ctx.tp_group is not None:
            torch.distributed.all_reduce(grad_normed, group=ctx.tp_group)
        grad_gamma = (grad_normed * x_hat).reshape(-1, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            # d/dx of x * r, r = (mean(x^2) + eps)^-1/2:  r * (dy - x_hat * mean(dy * x_hat))
            dy = (grad_normed * gamma).float()
            x_hat32 = x.float() * rstd
            grad_x = ((dy - x_hat32 * (dy * x_hat32).mean(-1, keepdim=True)) * rstd).to(x.dtype)
        return grad_x, grad_gamma, grad_weight, grad_bias, None, None


class _SwiGLULinear(torch.autograd.Function):
    """``linear(silu(gate) * up, weight)`` of ``y = [gate, up]`` (last dim), keeping only ``y`` for backward."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        gate, up = y.chunk(2, dim=-1)
        out = F.linear(F.silu(gate).mul_(up), weight)
        ctx.save_for_backward(y, weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        y, weight = ctx.saved_tensors
        gate, up = y.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        grad_weight = None
        if ctx.needs_input_grad[1]:
            act = silu * up
            grad_weight = grad_out.reshape(-1, grad_out.shape[-1]).t() @ act.reshape(-1, act.shape[-1])
            del act
        grad_act = grad_out @ weight
        grad_up = grad_act * silu
        del silu
        # d silu(g) / dg = sig * (1 + g * (1 - sig))
        grad_gate = grad_act.mul_(up).mul_(sig.mul_((1 - sig).mul_(gate).add_(1)))
        return torch.cat([grad_gate, grad_up], dim=-1), grad_weight


class NormColumnParallelLinear(ColumnParallelLinear):
    """Megatron's ``ColumnParallelLinear`` with the preceding RMSNorm fused in (module docstring).

    Parameters: ``weight [out/p, h]``, ``bias [out/p]`` (when asked for), ``layer_norm_weight [h]`` (RMSNorm
    gain, replicated over TP ranks). ``forward(x [s, b, h]) -> (y [s, b, out/p], None)``.

    Raises:
        NotImplementedError: a configuration this fusion does not cover (LayerNorm, zero-centred gamma,
            sequence parallelism, a gathered output, expert parallelism or a weight passed at call time).
    """

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
        out = _RMSNormLinear.apply(input_, self.layer_norm_weight, self.weight, bias, self.eps, tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class SwiGLUMLP(MLP):
    """Megatron's ``MLP`` with the SwiGLU activation fused into ``linear_fc2`` (module docstring).

    ``forward(x [s, b, h]) -> (out [s, b, h], None)``. Other MLPs (biases, another activation, a GLU offset or
    clamp, per-token scales of experts) run megatron's ``MLP.forward`` unchanged.
    """

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
        out = _SwiGLULinear.apply(y, self.linear_fc2.weight)  # [s, b, h], partial over TP ranks
        if self.tp_group is not None and self.tp_group.size() > 1:
            out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, None


class _KnownMLPFilter(logging.Filter):
    """Drops megatron's "Unknown MLP type" warning, which ``TransformerLayer`` logs for every layer whose MLP is not
    exactly megatron's ``MLP`` (``transformer_layer.py``): :class:`SwiGLUMLP` is one, and the default kwargs it
    then gets (megatron's TP group) are the right ones."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type")


_TRANSFORMER_LAYER_LOG = logging.getLogger("megatron.core.transformer.transformer_layer")


def local_layer_spec(core_attention: type) -> ModuleSpec:
    """Megatron's local GPT layer spec (RMSNorm, SwiGLU, no qk layernorm) with the norms fused into
    ``linear_qkv`` / ``linear_fc1`` (:class:`NormColumnParallelLinear`), the SwiGLU into ``linear_fc2``
    (:class:`SwiGLUMLP`), and ``core_attention`` as the attention kernel."""
    if not any(isinstance(f, _KnownMLPFilter) for f in _TRANSFORMER_LAYER_LOG.filters):
        _TRANSFORMER_LAYER_LOG.addFilter(_KnownMLPFilter())
    spec = get_gpt_layer_local_spec(qk_layernorm=False, normalization="RMSNorm")
    layer = spec.submodules
    layer.input_layernorm = IdentityOp
    layer.pre_mlp_layernorm = IdentityOp
    layer.sharded_state_dict_keys_map = {}  # the norms now have the names the keys map pointed to
    attention = layer.self_attention.submodules
    attention.linear_qkv = NormColumnParallelLinear
    attention.core_attention = core_attention
    fc2 = layer.mlp.submodules.linear_fc2
    layer.mlp = ModuleSpec(
        module=SwiGLUMLP, submodules=MLPSubmodules(linear_fc1=NormColumnParallelLinear, linear_fc2=fc2)
    )
    return spec
