"""What the SFT trainer minimises: the objective chosen by ``trainer.objective``, behind one small interface.

The trainer core (:class:`afm_core.train.trainer.SFTTrainer`: Megatron schedules, DDP, optimizer, checkpoints)
is the same for every objective; an objective supplies only the Megatron ``loss_func`` of a micro batch and the
reduction of the loss reports of a step or an eval into the logged metrics.

- ``sft``: observation-masked SFT, the token-mean cross entropy over trained tokens (:mod:`afm_core.train.loss`);
- ``contrastive``: AutoCoA stage 1's "when to act" pair loss (:mod:`afm_core.train.contrastive`) on packed
  pairs (:class:`afm_core.data.pairs.PairDataModule`); metrics add ``pref_acc`` (the share of pairs whose chosen
  branch scores above the rejected one), ``margin``, ``chosen_logprob``, ``rejected_logprob``...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Protocol

import torch

from afm_core.config.sft import OBJECTIVES, ContrastiveConfig, TrainerConfig
from afm_core.train.contrastive import megatron_contrastive_loss, pair_index, reduce_pair_reports
from afm_core.train.loss import masked_token_loss, reduce_reports

LossFunc = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


class Objective(Protocol):
    """The loss of the trainer's forward step and the reduction of its reports."""

    name: str
    # the loss is the plain sum of the labelled positions' per-token losses (gradient 1 on each: the fused output
    # layer then skips its check of that gradient, see afm_core.models.cross_entropy.linear_cross_entropy)
    unit_row_grads: bool

    def loss_func(self, batch: Mapping[str, Any], loss_mask: torch.Tensor) -> LossFunc:
        """Megatron's ``loss_func`` for one micro batch: ``per_token_loss -> (loss_sum, count, reports)``.

        Args:
            batch: the micro batch as the data loader made it (CPU tensors, ``cu_seqlens``...).
            loss_mask: the batch's loss mask as given to the model (``[b, s]`` or ``[1, b * s]``, on its device).
        """
        ...

    def reduce(self, reports: list[dict[str, torch.Tensor]], groups: list[Any]) -> dict[str, float]:
        """The metrics of one step or eval over micro batches and the ranks of ``groups``: at least ``loss`` and
        ``tokens`` (trained target tokens), identical on every rank."""
        ...


class TokenLoss:
    """Observation-masked SFT: the global token mean of the cross entropy over trained tokens."""

    name = "sft"
    unit_row_grads = True  # masked_token_loss: sum(per_token_loss * loss_mask), a 0/1 loss mask

    def loss_func(self, batch: Mapping[str, Any], loss_mask: torch.Tensor) -> LossFunc:
        return partial(masked_token_loss, loss_mask)

    def reduce(self, reports: list[dict[str, torch.Tensor]], groups: list[Any]) -> dict[str, float]:
        loss, tokens = reduce_reports(reports, groups)
        return {"loss": loss, "tokens": tokens}


class PairLoss:
    """AutoCoA's contrastive "when to act" loss over packed pairs (mean over the global batch's pairs).

    Args:
        config: the ``contrastive`` group (:class:`~afm_core.config.sft.ContrastiveConfig`: ``aux_sft_coef``,
            ``reduction``).
        seq_length: tokens per packed sequence (``trainer.seq_length``).
    """

    name = "contrastive"
    unit_row_grads = False

    def __init__(self, config: ContrastiveConfig, seq_length: int):
        self.config, self.seq_length = config, seq_length

    def loss_func(self, batch: Mapping[str, Any], loss_mask: torch.Tensor) -> LossFunc:
        if batch.get("cu_seqlens") is None:
            raise ValueError("trainer.objective=contrastive needs packed pair batches (with cu_seqlens)")
        index = pair_index(batch["cu_seqlens"], self.seq_length, device=loss_mask.device)
        return partial(megatron_contrastive_loss, loss_mask, index, self.config)

    def reduce(self, reports: list[dict[str, torch.Tensor]], groups: list[Any]) -> dict[str, float]:
        return reduce_pair_reports(reports, groups)


def build_objective(trainer: TrainerConfig, contrastive: ContrastiveConfig) -> Objective:
    """The objective of ``trainer.objective`` (one of :data:`~afm_core.config.sft.OBJECTIVES`), with the
    ``contrastive`` group and ``trainer.seq_length`` for pairs.

    Raises:
        ValueError: an objective of :data:`~afm_core.config.sft.OBJECTIVES` that has no implementation here.
    """
    if trainer.objective == "sft":
        return TokenLoss()
    if trainer.objective == "contrastive":
        return PairLoss(contrastive, trainer.seq_length)
    raise ValueError(f"trainer.objective={trainer.objective!r}: expected one of {', '.join(OBJECTIVES)}")
