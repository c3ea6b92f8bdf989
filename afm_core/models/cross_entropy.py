"""The output layer and its cross entropy in one op: per-row CE of ``hidden @ weight.T`` without the ``[rows, vocab]``
logits, for the model's fused output layer (:class:`afm_core.models.gpt._GPTModel`).

Kept with the model (as Megatron-core keeps its fused cross entropy in ``megatron/core/fusions``): the trainers'
losses (:mod:`afm_core.train.loss`) sum what it returns per row.
"""

from __future__ import annotations

import torch

from afm_core.models.cpu_shapes import BUCKETED_DTYPES, cpu_kernel_length, zero_padded
from afm_core.utils.host_memory import populate_for_write

LINEAR_CE_CHUNK_BYTES = 32 * 1024**2  # fp32 logits of one chunk of rows


def _exp_shifted_(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits [n, V]`` fp32 replaced in place by ``exp(logits - rowmax)``; returns it, its row sums ``[n, 1]`` and
    the rows' log-sum-exp ``[n]`` (no ``[n, V]`` temporary, unlike ``torch.logsumexp``)."""
    peak = logits.amax(dim=-1, keepdim=True)
    exp = logits.sub_(peak).exp_()
    total = exp.sum(dim=-1, keepdim=True)
    return exp, total, total.log().add_(peak).squeeze(-1)


def _softmax_minus_onehot_(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``softmax(logits) - onehot(targets)`` in place of ``logits [n, V]`` fp32 (``lse [n]`` its log-sum-exp)."""
    logits.sub_(lse[:, None]).exp_()
    logits[torch.arange(logits.shape[0], device=logits.device), targets] -= 1.0
    return logits


def _kernel_rows(h: torch.Tensor) -> torch.Tensor:
    """``h [n, hidden]`` with zero rows appended up to :func:`~afm_core.models.cpu_shapes.cpu_kernel_length` on CPU
    in bf16/fp16 (``h`` itself elsewhere): a chunk's row count changes every step, and torch keeps the bf16
    matmuls of each new count (:mod:`afm_core.models.cpu_shapes`)."""
    rows = cpu_kernel_length(h.shape[0], h.dtype) if h.device.type == "cpu" else h.shape[0]
    return zero_padded(h, rows)


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-row ``CE(hidden @ weight.T, labels)`` over chunks of rows: the ``[rows, vocab]`` logits never exist at
    once. The gradient is ``d hidden = G @ W``, ``d W = G^T @ hidden`` with ``G = g * (softmax - onehot)`` per row,
    ``g`` the upstream gradient of each row's loss. As Liger-Kernel's fused linear cross entropy
    (``liger_kernel/ops/fused_linear_cross_entropy.py``), forward computes both products while each chunk's logits
    are at hand, for ``g = 1`` on the rows with a label: backward scales ``d hidden`` row by row (exact for any
    ``g``), and ``d W`` is exact as computed when ``g`` is 1 on every labelled row (the SFT loss: a sum of masked
    token losses, divided by the token count later, in megatron's ``finalize_model_grads``). For any other ``g``,
    backward recomputes each chunk's logits (one more matmul) from the kept rows and log-sum-exp and adds
    what is missing. ``d W`` goes into ``grad_sink`` when one is given (megatron DDP's fp32 ``main_grad`` of the
    weight, as megatron's gradient-accumulation fusion writes there), with no gradient returned for ``weight``;
    else into a buffer of its own, returned by backward.

    Only the labelled rows are computed (gathered first when some are not): an unlabelled row's loss is 0 and its
    gradient is 0 whatever its logits are, so its ``[vocab]`` logits, softmax and both gradient products would be
    work for nothing (in observation-masked SFT most rows are prompt or observation tokens). Given ``rows`` (their
    indices, found by the caller on the host) and ``unit_grads`` (the caller's promise that ``g = 1`` on every
    labelled row), no step reads a device value back to the host: no data-dependent shape, no check of ``g``."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,  # type: ignore[override]
        chunk_rows: int,
        grad_enabled: bool,
        grad_sink: torch.Tensor | None,
        rows: torch.Tensor | None,
        unit_grads: bool,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        if rows is None:  # found here: a device sync on CUDA
            valid = labels >= 0
            rows = None if bool(valid.all()) else valid.nonzero().squeeze(1)  # None: every row
        kept = hidden if rows is None else hidden.index_select(0, rows)  # [m, h]
        targets = labels if rows is None else labels.index_select(0, rows)
        m = kept.shape[0]
        losses = torch.empty(m, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(losses)
        want_hidden, want_weight = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        unit_hidden = torch.empty_like(kept) if want_hidden else None
        grad_weight = None
        if want_weight:
            grad_weight = (
                grad_sink
                if grad_sink is not None
                else torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            )
        if grad_sink is not None and want_weight:
            populate_for_write(grad_sink)  # released pages (zero_by_release) come back without zero-page faults
        for a in range(0, m, chunk_rows):
            h, t = kept[a : a + chunk_rows], targets[a : a + chunk_rows]
            c = h.shape[0]
            h = _kernel_rows(h)  # [c', h]: c' >= c, zero rows after the chunk's c
            logits = (h @ weight.t()).float()
            target_logit = logits[:c].gather(1, t[:, None]).squeeze(1)
            exp, total, chunk_lse = _exp_shifted_(logits)
            lse[a : a + c] = chunk_lse[:c]
            losses[a : a + c] = chunk_lse[:c] - target_logit
            if unit_hidden is not None or grad_weight is not None:
                grad_logits = exp.div_(total)  # softmax
                grad_logits[torch.arange(c, device=h.device), t] -= 1.0
                grad_logits[c:] = 0.0  # the appended rows: no gradient
                grad_logits = grad_logits.to(hidden.dtype)
                if unit_hidden is not None:
                    if h.shape[0] == c:
                        torch.matmul(grad_logits, weight, out=unit_hidden[a : a + c])
                    else:
                        unit_hidden[a : a + c] = (grad_logits @ weight)[:c]
                if grad_weight is not None:
                    grad_weight.addmm_(grad_logits.t().float(), h.float())
        ctx.save_for_backward(kept, weight, targets, lse, rows)
        ctx.n, ctx.chunk_rows = n, chunk_rows
        ctx.unit_hidden, ctx.grad_weight, ctx.grad_sink = unit_hidden, grad_weight, grad_sink
        ctx.weight_rows_done = want_weight  # d W holds g = 1 on every labelled row (False after a backward)
        ctx.unit_grads = unit_grads
        if rows is None:
            return losses
        return losses.new_zeros(n).index_copy_(0, rows, losses)

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):  # type: ignore[override]
        kept, weight, targets, lse, rows = ctx.saved_tensors
        g = grad_losses.float() if rows is None else grad_losses.float().index_select(0, rows)  # [m]
        grad_hidden = None
        if ctx.needs_input_grad[0]:
            kept_grad = (ctx.unit_hidden * g[:, None]).to(kept.dtype)
            grad_hidden = (
                kept_grad if rows is None else kept.new_zeros(ctx.n, kept.shape[1]).index_copy_(0, rows, kept_grad)
            )
        if not ctx.needs_input_grad[1]:
            return grad_hidden, None, None, None, None, None, None, None
        if ctx.weight_rows_done:  # forward's d W, for g = 1 on every labelled row
            grad_weight, missing = ctx.grad_weight, g - 1.0
        else:  # a second backward (retain_graph): all of this g
            grad_weight = (
                ctx.grad_sink
                if ctx.grad_sink is not None
                else torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            )
            missing = g
        # g = 1 on every labelled row (the caller's promise, unchecked: checking reads g back to the host)
        promised = ctx.weight_rows_done and ctx.unit_grads
        ctx.weight_rows_done, ctx.grad_weight = False, None
        if not promised and bool(missing.any()):
            for a in range(0, kept.shape[0], ctx.chunk_rows):
                h = kept[a : a + ctx.chunk_rows]
                n = h.shape[0]
                logits = (_kernel_rows(h) @ weight.t())[:n].float()
                grad_logits = _softmax_minus_onehot_(logits, lse[a : a + n], targets[a : a + n])
                grad_weight.addmm_(grad_logits.mul_(missing[a : a + n, None]).t(), h.float())
        if ctx.grad_sink is not None:
            return grad_hidden, None, None, None, None, None, None, None
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_bytes: int = LINEAR_CE_CHUNK_BYTES,
    grad_sink: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    unit_grads: bool = False,
) -> torch.Tensor:
    """Cross entropy of the output layer's logits ``hidden @ weight.T`` per row, without materialising them.

    Equal to ``F.cross_entropy(hidden @ weight.T, labels, reduction="none")`` in fp32 (logits upcast as
    Megatron's cross entropy does), in chunks of rows whose fp32 logits take at most ``chunk_bytes`` (on CPU in
    bf16/fp16: a multiple of 64 rows, at least 64, and the last chunk run at a bucketed size with zero rows appended:
    :mod:`afm_core.models.cpu_shapes`).

    Args:
        hidden: ``[n, h]`` final hidden states (after the final norm).
        weight: ``[vocab, h]`` output layer (or tied embedding) weight.
        labels: ``[n]`` int64 target ids; negative ids (``-100``) give loss 0 and no gradient.
        grad_sink: an fp32 tensor shaped like ``weight`` to which the weight's gradient is added (from forward
            on: see :class:`_LinearCrossEntropy`), e.g. megatron DDP's ``weight.main_grad``; backward then returns
            no gradient for ``weight`` (megatron's DDP hook must not run for this weight, or must see the
            gradient of its other use only: the tied input embedding). None: the gradient goes through autograd.
        rows: ``[m]`` int64 indices (ascending, on ``hidden``'s device) of exactly the rows whose label is >= 0,
            found by the caller (on the host, from its CPU labels); None: found here (``nonzero``: a device sync on
            CUDA).
        unit_grads: the upstream gradient is exactly 1 on every labelled row (a loss that is the plain sum of
            these rows' losses, as the SFT token loss :func:`afm_core.train.loss.masked_token_loss` with a 0/1 mask and no loss
            scale): backward then takes the weight's gradient computed in forward without checking ``g`` (a device
            sync). A wrong promise gives a wrong weight gradient.
    Returns:
        ``[n]`` fp32 per-row loss in nats.
    Raises:
        ValueError: ``grad_sink`` is not fp32 or not shaped like ``weight``.
    """
    if grad_sink is not None and (grad_sink.dtype != torch.float32 or grad_sink.shape != weight.shape):
        raise ValueError(
            f"grad_sink must be fp32 {tuple(weight.shape)}, got {grad_sink.dtype} {tuple(grad_sink.shape)}"
        )
    chunk_rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    if hidden.device.type == "cpu" and hidden.dtype in BUCKETED_DTYPES:  # bucketed sizes: _kernel_rows
        chunk_rows = max(64, chunk_rows // 64 * 64)
    grad_enabled = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk_rows, grad_enabled, grad_sink, rows, unit_grads)
