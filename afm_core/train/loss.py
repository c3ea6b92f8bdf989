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
    each group in turn (a group of one rank is skipped; on NCCL the sum travels through CUDA). The micro batches'
    reports are summed where they are and read back once (one host sync on CUDA, not one per micro batch)."""
    total = torch.zeros(size, dtype=torch.float64)
    if reports:
        total = torch.stack([report[key].detach().to(torch.float64) for report in reports]).sum(0).cpu()
    for group in groups:
        if torch.distributed.get_world_size(group) > 1:
            device = "cuda" if torch.distributed.get_backend(group) == "nccl" else "cpu"
            on_device = total.to(device)
            torch.distributed.all_reduce(on_device, group=group)
            total = on_device.cpu()
    return total
