"""Masked token-mean cross-entropy: the SFT loss over unmasked (trained) target tokens.

The loss of one optimizer step is

    L = sum_{micro batches m, DP ranks r} sum_t mask[t] * CE[t]  /  sum_{m, r} sum_t mask[t]

i.e. one mean over every unmasked target token of the GLOBAL batch, not a mean of per-micro-batch means.
Prompt tokens, ``<observation>`` spans and padding have ``loss_mask = 0`` and contribute nothing. This is
Megatron-core's per-token loss (``TransformerConfig.calculate_per_token_loss=True``: the schedule sums the
per-micro-batch ``(loss_sum, num_tokens)`` pairs and ``finalize_model_grads`` divides the gradients by the
all-reduced token count), and it matches LLaMA-Factory / HF Trainer's token-level average over a batch, which
the upstream AFM SFT recipe uses (``--ignore_observation``: observation labels are ``IGNORE_INDEX``).
"""

from __future__ import annotations

import torch

LOSS_KEY = "lm loss"


def masked_token_loss(
    loss_mask: torch.Tensor, per_token_loss: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron ``loss_func`` for one micro batch (the 3-tuple form used with per-token loss).

    Args:
        loss_mask: [b, s], 1 where the target token is trained, 0 elsewhere (any numeric dtype).
        per_token_loss: [b, s] fp32 cross-entropy of each target token (``GPTModel(..., labels=...)``).
    Returns:
        ``(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})``: the summed masked CE (scalar, with
        grad), the number of unmasked tokens (int scalar), and a detached fp32 pair for reporting.
    Raises:
        ValueError: if the shapes differ.
    """
    if loss_mask.shape != per_token_loss.shape:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} != per-token loss {tuple(per_token_loss.shape)}")
    mask = loss_mask.to(per_token_loss.dtype)
    loss_sum = (per_token_loss.float() * mask.float()).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().float(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {LOSS_KEY: report}


def reduce_reports(
    reports: list[dict[str, torch.Tensor]], groups: list[torch.distributed.ProcessGroup]
) -> tuple[float, int]:
    """Global token-mean loss and token count from the per-micro-batch reports of one step.

    Args:
        reports: what ``forward_backward_func`` returned on this rank (empty except on the last pipeline
            stage), each ``{"lm loss": [loss_sum, num_tokens]}``.
        groups: process groups summed over in turn: the data-parallel group and the pipeline group (other
            stages contribute zeros). Tensor-parallel ranks hold identical reports and must not be summed.
    Returns:
        ``(loss, num_tokens)``: ``sum loss_sum / sum num_tokens`` over the global batch (nan if no token is
        unmasked) and the number of unmasked target tokens, identical on every rank.
    """
    total = sum_reports(reports, LOSS_KEY, 2, groups)
    loss_sum, num_tokens = float(total[0]), int(total[1])
    return (loss_sum / num_tokens if num_tokens else float("nan")), num_tokens


def sum_reports(
    reports: list[dict[str, torch.Tensor]], key: str, size: int, groups: list[torch.distributed.ProcessGroup]
) -> torch.Tensor:
    """``[size]`` float64 (CPU): the sum of ``report[key]`` over the micro batches' reports and over the ranks of
    each group in turn (a group of one rank is skipped; on NCCL the sum travels through CUDA)."""
    total = torch.zeros(size, dtype=torch.float64)
    for report in reports:
        total += report[key].detach().to("cpu", torch.float64)
    for group in groups:
        if torch.distributed.get_world_size(group) > 1:
            device = "cuda" if torch.distributed.get_backend(group) == "nccl" else "cpu"
            on_device = total.to(device)
            torch.distributed.all_reduce(on_device, group=group)
            total = on_device.cpu()
    return total


LINEAR_CE_CHUNK_BYTES = 64 * 1024**2  # fp32 logits of one chunk of rows


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-row ``CE(hidden @ weight.T, labels)`` over chunks of rows: the ``[rows, vocab]`` logits never exist at
    once. Forward keeps only the log-sum-exp per row; backward recomputes each chunk's logits (one extra matmul)
    and accumulates ``d hidden = G @ W`` and ``d W = G^T @ hidden`` with ``G = g * (softmax - onehot)``. The
    technique of Liger-Kernel's fused linear cross entropy (``liger_kernel/ops/fused_linear_cross_entropy.py``),
    with per-row gradients instead of a reduced loss."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,  # type: ignore[override]
        chunk_rows: int,
    ) -> torch.Tensor:
        valid = labels >= 0
        targets = labels.clamp(min=0)
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(losses)
        for a in range(0, hidden.shape[0], chunk_rows):
            logits = (hidden[a : a + chunk_rows] @ weight.t()).float()
            lse[a : a + chunk_rows] = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, targets[a : a + chunk_rows, None]).squeeze(1)
            losses[a : a + chunk_rows] = lse[a : a + chunk_rows] - target_logit
        losses.masked_fill_(~valid, 0.0)
        ctx.save_for_backward(hidden, weight, targets, valid, lse)
        ctx.chunk_rows = chunk_rows
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):  # type: ignore[override]
        hidden, weight, targets, valid, lse = ctx.saved_tensors
        scale = (grad_losses.float() * valid)[:, None]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        rows = torch.arange(min(ctx.chunk_rows, hidden.shape[0]), device=hidden.device)
        for a in range(0, hidden.shape[0], ctx.chunk_rows):
            h = hidden[a : a + ctx.chunk_rows]
            n = h.shape[0]
            grad_logits = (h @ weight.t()).float().sub_(lse[a : a + n, None]).exp_()  # softmax
            grad_logits[rows[:n], targets[a : a + n]] -= 1.0
            grad_logits.mul_(scale[a : a + n])
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                torch.matmul(grad_logits, weight, out=grad_hidden[a : a + n])
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t().float(), h.float())
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_bytes: int = LINEAR_CE_CHUNK_BYTES
) -> torch.Tensor:
    """Cross entropy of the output layer's logits ``hidden @ weight.T`` per row, without materialising them.

    Equal to ``F.cross_entropy(hidden @ weight.T, labels, reduction="none")`` in fp32 (logits upcast as
    Megatron's cross entropy does), in chunks of rows whose fp32 logits take at most ``chunk_bytes``.

    Args:
        hidden: ``[n, h]`` final hidden states (after the final norm).
        weight: ``[vocab, h]`` output layer (or tied embedding) weight.
        labels: ``[n]`` int64 target ids; negative ids (``-100``) give loss 0 and no gradient.
    Returns:
        ``[n]`` fp32 per-row loss in nats.
    """
    chunk_rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk_rows)
