"""The contrastive "when to act" loss of AutoCoA SFT stage 1, as a Megatron ``loss_func`` of the SFT trainer.

AutoCoA (arXiv 2503.06580, §3.2.2 "SFT-Stage1: CoT+A") trains the decision between acting and answering with
pairs that share a context ``c`` (built by :mod:`afm_core.data.pairs`). Per pair::

    L = -log sigma( log P(chosen | c) - log P(rejected | c) ) + alpha * NLL(chosen | c)

with ``log P(x | c) = sum_i log pi(x_i | c, x_<i)`` summed over the branch tokens (``reduction="sum"``) or
their mean (``reduction="mean"``: the paper's §3.2.2 length-normalised P and upstream AutoCoA's
``LogprobsPairwiseTrainer``, ``SFT_trianing/src/llamafactory/train/rm/trainer.py``). ``NLL(chosen | c)`` is the
token-mean negative log-likelihood of the chosen branch (the paper's ``L_aux = -P(x_chosen | c)``; upstream's
``auxilary_sft_coef_in_pl``, 0.2 in its ``llamafty_ppf.sh``): without it both probabilities fall together.

In the trainer the loss of one optimizer step is the mean of ``L`` over the pairs of the global batch: the
``loss_func`` returns the sum over its micro batch's pairs and their count, Megatron's per-token-loss mode sums
both over micro batches and DP ranks and divides the gradients by the count (:mod:`afm_core.train.loss`). A pair's
two documents are always in one packed row (documents ``2j`` and ``2j + 1``), so each micro batch holds whole pairs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from afm_core.config.sft import ContrastiveConfig
from afm_core.train.loss import LOSS_KEY, sum_reports

PAIRS_KEY = "pairs"
# the additive statistics of PAIRS_KEY, in order
_STATS = (
    "pairs",
    "correct",
    "chosen_logprob",
    "rejected_logprob",
    "chosen_nll",
    "margin",
    "contrastive",
    "loss",
    "tokens",
)


def pair_index(cu_seqlens: Sequence[torch.Tensor], seq_length: int, device: torch.device | None = None) -> torch.Tensor:
    """``[b, s]`` int64: for every position, ``2 * pair + branch`` (branch 0 = chosen, 1 = rejected), with pairs
    numbered across the micro batch's rows; -1 on padding.

    Args:
        cu_seqlens: ``b`` tensors ``[d_i + 1]`` of document offsets (the loader's ``cu_seqlens``); ``d_i`` even.
    Raises:
        ValueError: a row with an odd number of documents (not a packed-pairs batch).
    """
    rows = []
    first = 0
    for row, offsets in enumerate(cu_seqlens):
        offsets = torch.as_tensor(offsets, dtype=torch.int64).flatten()
        docs = offsets.numel() - 1
        if docs % 2:
            raise ValueError(f"row {row} holds {docs} documents: contrastive batches hold pairs (an even number)")
        positions = torch.arange(seq_length)
        doc = torch.searchsorted(offsets[1:], positions, right=True)  # document of each position; docs: padding
        rows.append(torch.where(doc < docs, doc + 2 * first, torch.full_like(doc, -1)))
        first += docs // 2
    return torch.stack(rows).to(device) if rows else torch.zeros(0, seq_length, dtype=torch.int64, device=device)


def pair_logprobs(
    token_logprobs: torch.Tensor, loss_mask: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair and branch: the summed log-probability of the branch tokens and their count.

    Args:
        token_logprobs: ``[b, s]`` log pi of each position's target token (``-CE``).
        loss_mask: ``[b, s]``, 1 on branch target tokens.
        index: ``[b, s]`` from :func:`pair_index`.
    Returns:
        ``(logprob_sum, tokens)``, each ``[P, 2]`` (column 0 chosen, 1 rejected); ``logprob_sum`` has grad.
    """
    mask = (loss_mask > 0) & (index >= 0)
    slots = int(index.max()) + 1 if index.numel() else 0
    slots += slots % 2
    flat = index[mask]
    sums = torch.zeros(slots, dtype=torch.float32, device=token_logprobs.device)
    sums = sums.index_add(0, flat, token_logprobs[mask].float())
    tokens = torch.zeros(slots, dtype=torch.float32, device=token_logprobs.device).index_add(
        0, flat, torch.ones_like(flat, dtype=torch.float32)
    )
    return sums.view(-1, 2), tokens.view(-1, 2)


def contrastive_loss(
    logprob_sum: torch.Tensor, tokens: torch.Tensor, config: ContrastiveConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-pair loss ``L`` (module docstring) from :func:`pair_logprobs`.

    Args:
        logprob_sum: ``[P, 2]`` summed branch log-probabilities (chosen, rejected).
        tokens: ``[P, 2]`` branch token counts (> 0).
    Returns:
        ``(loss [P], stats)``: stats are detached ``[P]`` tensors: ``margin`` (the scored difference),
        ``correct`` (1 where chosen scores above rejected), ``chosen_nll`` (token mean), ``contrastive``.
    Raises:
        ValueError: a branch without tokens.
    """
    if bool((tokens <= 0).any()):
        raise ValueError("a pair branch has no trained token (truncated pair?)")
    score = logprob_sum if config.reduction == "sum" else logprob_sum / tokens
    margin = score[:, 0] - score[:, 1]
    contrastive = -torch.nn.functional.logsigmoid(margin)
    chosen_nll = -logprob_sum[:, 0] / tokens[:, 0]
    loss = contrastive + config.aux_sft_coef * chosen_nll
    stats = {
        "margin": margin.detach(),
        "correct": (margin > 0).float().detach(),
        "chosen_nll": chosen_nll.detach(),
        "contrastive": contrastive.detach(),
    }
    return loss, stats


def megatron_contrastive_loss(
    loss_mask: torch.Tensor, index: torch.Tensor, config: ContrastiveConfig, per_token_loss: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron ``loss_func`` (3-tuple, per-token-loss mode) of one micro batch of packed pairs.

    Args:
        loss_mask: ``[b, s]`` (or ``[1, b * s]`` in the ``thd`` format), 1 on branch target tokens.
        index: ``[b, s]`` from :func:`pair_index`.
        per_token_loss: the model's cross entropy per target token, shaped like ``loss_mask``.
    Returns:
        ``(sum of L over the pairs, number of pairs (int), {"lm loss": [sum L, pairs], "pairs": stats})`` where
        stats sums ``pairs, correct, chosen_logprob, rejected_logprob, chosen_nll, margin, contrastive, loss,
        tokens`` (log-probabilities as scored: summed or per token; tokens: trained branch tokens).
    """
    shape = index.shape
    logprob_sum, tokens = pair_logprobs(-per_token_loss.reshape(shape), loss_mask.reshape(shape), index)
    loss, stats = contrastive_loss(logprob_sum, tokens, config)
    scored = logprob_sum.detach() if config.reduction == "sum" else logprob_sum.detach() / tokens
    count = torch.tensor(loss.numel(), dtype=torch.int, device=loss.device)
    total = loss.sum()
    report = torch.stack(
        [
            torch.tensor(float(loss.numel()), device=loss.device),
            stats["correct"].sum(),
            scored[:, 0].sum(),
            scored[:, 1].sum(),
            stats["chosen_nll"].sum(),
            stats["margin"].sum(),
            stats["contrastive"].sum(),
            total.detach(),
            tokens.sum(),
        ]
    ).float()
    return total, count, {LOSS_KEY: torch.stack([total.detach().float(), count.float()]), PAIRS_KEY: report}


def reduce_pair_reports(
    reports: list[dict[str, torch.Tensor]], groups: list[torch.distributed.ProcessGroup]
) -> dict[str, float]:
    """Pair statistics of one step (or one eval) over the micro batches and the ranks of ``groups`` (DP, PP).

    Returns:
        ``{"loss": mean L, "tokens": trained branch tokens, "pairs", "pref_acc": share of pairs whose chosen
        branch scores above the rejected, "chosen_logprob", "rejected_logprob", "margin", "chosen_nll",
        "contrastive_loss"}`` (means over pairs), identical on every rank; nan means when there is no pair.
    """
    sums = dict(zip(_STATS, sum_reports(reports, PAIRS_KEY, len(_STATS), groups).tolist()))
    pairs = sums["pairs"]

    def mean(key: str) -> float:
        return sums[key] / pairs if pairs else float("nan")

    return {
        "loss": mean("loss"),
        "tokens": int(sums["tokens"]),
        "pairs": int(pairs),
        "pref_acc": mean("correct"),
        "chosen_logprob": mean("chosen_logprob"),
        "rejected_logprob": mean("rejected_logprob"),
        "margin": mean("margin"),
        "chosen_nll": mean("chosen_nll"),
        "contrastive_loss": mean("contrastive"),
    }
