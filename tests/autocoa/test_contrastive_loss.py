"""AutoCoA stage 1's contrastive loss against a hand computation, and its pairing read back from packed batches."""

from __future__ import annotations

import math

import pytest
import torch

from afm_core.train.contrastive import (
    ContrastiveConfig,
    contrastive_loss,
    megatron_contrastive_loss,
    pair_index,
    pair_logprobs,
    reduce_pair_reports,
)


def test_pair_index_numbers_pairs_across_rows_and_marks_padding():
    cu = [torch.tensor([0, 3, 5, 8, 10]), torch.tensor([0, 4, 6])]
    index = pair_index(cu, 12)
    assert index.tolist() == [
        [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, -1, -1],  # pair 0 chosen/rejected, pair 1 chosen/rejected, padding
        [4, 4, 4, 4, 5, 5, -1, -1, -1, -1, -1, -1],  # pair 2 of the micro batch
    ]
    with pytest.raises(ValueError, match="3 documents"):
        pair_index([torch.tensor([0, 2, 4, 6])], 8)


def test_loss_matches_a_hand_computation_with_summed_and_mean_logprobs():
    # one pair: chosen tokens log p = -1, -2; rejected token log p = -0.5; alpha = 0.2
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.ones(1, 3)
    index = torch.tensor([[0, 0, 1]])
    sums, tokens = pair_logprobs(lp, mask, index)
    assert sums.tolist() == [[-3.0, -0.5]] and tokens.tolist() == [[2.0, 1.0]]

    loss, stats = contrastive_loss(sums, tokens, ContrastiveConfig(aux_sft_coef=0.2, reduction="sum"))
    # margin = -3 - (-0.5) = -2.5; -log sigma(-2.5) = log(1 + e^2.5); NLL(chosen) = 3 / 2 tokens = 1.5
    expected = math.log(1 + math.exp(2.5)) + 0.2 * 1.5
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["margin"].item() == pytest.approx(-2.5) and stats["correct"].item() == 0.0
    loss.sum().backward()
    # dL/dlog p(chosen token) = -sigma(-margin) - alpha / 2; dL/dlog p(rejected token) = +sigma(-margin)
    s = 1 / (1 + math.exp(-2.5))
    assert lp.grad[0].tolist() == pytest.approx([-s - 0.1, -s - 0.1, s], abs=1e-6)

    sums, tokens = pair_logprobs(lp.detach(), mask, index)
    loss, stats = contrastive_loss(sums, tokens, ContrastiveConfig(aux_sft_coef=0.2, reduction="mean"))
    # per-token scores: chosen -1.5, rejected -0.5: margin -1; -log sigma(-1) = log(1 + e)
    assert loss.item() == pytest.approx(math.log(1 + math.e) + 0.3, abs=1e-6)

    loss, _ = contrastive_loss(torch.tensor([[-0.1, -4.0]]), torch.ones(1, 2), ContrastiveConfig(aux_sft_coef=0.0))
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-3.9)), abs=1e-6)  # chosen ahead: small loss


def test_megatron_loss_func_sums_pairs_and_reports_preference_accuracy():
    # two rows, three pairs; per-token CE = -log p; masked positions (context, padding) must not count
    cu = [torch.tensor([0, 3, 6, 8, 10]), torch.tensor([0, 3, 6])]
    index = pair_index(cu, 10)
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0, 1, 0, 1], [0, 0, 1, 0, 0, 1, 0, 0, 0, 0]], dtype=torch.float32)
    ce = torch.full((2, 10), 7.0)  # garbage where masked
    ce[0, [1, 2]] = torch.tensor([0.2, 0.3])  # pair 0 chosen: log p sum -0.5
    ce[0, [4, 5]] = torch.tensor([1.0, 1.0])  # pair 0 rejected: -2
    ce[0, 7], ce[0, 9] = 2.0, 0.5  # pair 1: chosen -2, rejected -0.5
    ce[1, 2], ce[1, 5] = 0.1, 0.4  # pair 2: chosen -0.1, rejected -0.4
    cfg = ContrastiveConfig(aux_sft_coef=0.5)
    total, count, report = megatron_contrastive_loss(mask, index, cfg, ce)
    margins = [1.5, -1.5, 0.3]
    nll = [0.25, 2.0, 0.1]
    expected = sum(math.log(1 + math.exp(-m)) + 0.5 * n for m, n in zip(margins, nll))
    assert count.item() == 3 and total.item() == pytest.approx(expected, abs=1e-5)
    # the thd layout gives the loss as one [1, b * s] row: same result
    flat, _, _ = megatron_contrastive_loss(mask.reshape(1, 20), index, cfg, ce.reshape(1, 20))
    assert flat.item() == pytest.approx(expected, abs=1e-5)

    out = reduce_pair_reports([report, report], [])  # two micro batches, no process group to sum over
    assert out["pairs"] == 6 and out["pref_acc"] == pytest.approx(2 / 3)
    assert out["loss"] == pytest.approx(expected / 3, abs=1e-5)
    assert out["margin"] == pytest.approx(sum(margins) / 3, abs=1e-5)
    assert out["tokens"] == 2 * 8
