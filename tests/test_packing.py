"""Packing: first-fit-decreasing layout, per-document positions, block-causal masks, and exactness.

The exactness check runs a tiny random HF Llama: each document's logits inside a packed sequence
(block mask + reset positions) must equal its logits when run alone.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from afm_core.data.packing import block_causal_attention_mask, pack_examples, pad_examples
from afm_core.data.tokenize import IGNORE_INDEX, TokenizedExample


def _example(length: int, first_id: int, num_prompt: int = 1) -> TokenizedExample:
    """``length`` tokens ``first_id, first_id + 1, …``; the first ``num_prompt`` are masked."""
    ids = list(range(first_id, first_id + length))
    return TokenizedExample(ids, [IGNORE_INDEX] * num_prompt + ids[num_prompt:])


@pytest.fixture
def examples() -> list[TokenizedExample]:
    return [_example(n, 10 * i) for i, n in enumerate([5, 3, 7, 2, 6, 4])]


def test_first_fit_decreasing_layout(examples):
    packed = pack_examples(examples, seq_length=10, pad_id=99)
    # Longest first into the first sequence with room: 7 -> s0, 6 -> s1, 5 -> s2, 4 -> s1, 3 -> s0, 2 -> s2.
    assert [c.tolist() for c in packed.cu_seqlens] == [[0, 7, 10], [0, 6, 10], [0, 5, 7]]
    assert packed.input_ids[0].tolist() == list(range(20, 27)) + list(range(10, 13))
    assert packed.input_ids[2].tolist() == [*range(0, 5), 30, 31, 99, 99, 99]
    assert packed.labels[2].tolist() == [IGNORE_INDEX, 1, 2, 3, 4, IGNORE_INDEX, 31] + [IGNORE_INDEX] * 3
    assert packed.input_ids.dtype == np.int32 and packed.cu_seqlens[0].dtype == np.int32
    again = pack_examples(examples, seq_length=10, pad_id=99)
    assert np.array_equal(again.input_ids, packed.input_ids), "packing is deterministic"


def test_position_ids_restart_at_every_document(examples):
    packed = pack_examples(examples, seq_length=10)
    for row, offsets in enumerate(packed.cu_seqlens):
        for start, end in itertools.pairwise(offsets):
            assert packed.position_ids[row, start:end].tolist() == list(range(end - start))
    assert packed.position_ids[2, 7:].tolist() == [0, 1, 2]


def test_efficiency_and_target_share(examples):
    packed = pack_examples(examples, seq_length=10)
    stats = packed.stats
    assert (stats.num_sequences, stats.num_tokens, stats.capacity) == (3, 27, 30)
    assert stats.efficiency == pytest.approx(27 / 30)
    assert stats.num_target_tokens == 27 - 6  # one prompt token per example
    assert stats.target_share == pytest.approx(21 / 30)
    unpacked = pad_examples(examples, seq_length=10)
    assert unpacked.stats.num_sequences == 6 and unpacked.stats.efficiency == pytest.approx(27 / 60)
    assert [c.tolist() for c in unpacked.cu_seqlens][:2] == [[0, 5], [0, 3]], "input order is kept"


def test_long_examples_are_truncated_and_untrained_ones_dropped():
    long = _example(12, 0)
    untrained = TokenizedExample([1, 2, 3], [IGNORE_INDEX] * 3)
    prompt_only_after_cut = _example(8, 50, num_prompt=6)
    packed = pack_examples([long, untrained, prompt_only_after_cut], seq_length=5)
    assert packed.stats.num_truncated == 2
    assert packed.stats.num_dropped == 2
    assert len(packed) == 1 and packed.input_ids[0].tolist() == [0, 1, 2, 3, 4]


def _reference_mask(cu_seqlens: list[int], seq_length: int) -> torch.Tensor:
    masked = torch.ones(seq_length, seq_length, dtype=torch.bool)
    for start, end in itertools.pairwise(cu_seqlens):
        for q in range(start, end):
            masked[q, start : q + 1] = False
    for pad in range(cu_seqlens[-1], seq_length):
        masked[pad, pad] = False
    return masked[None, None]


@pytest.mark.parametrize("cu_seqlens", [[0, 3, 4, 8], [0, 10], [0, 2, 5], [0]])
def test_block_causal_mask(cu_seqlens):
    mask = block_causal_attention_mask(cu_seqlens, seq_length=10)
    assert mask.shape == (1, 1, 10, 10) and mask.dtype == torch.bool
    assert torch.equal(mask, _reference_mask(cu_seqlens, 10))
    assert not mask.all(dim=-1).any(), "every row attends to something"


def test_block_causal_mask_rejects_bad_offsets():
    for bad in ([1, 4], [0, 5, 3], [0, 11]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            block_causal_attention_mask(bad, seq_length=10)


def test_packed_logits_equal_unpacked_logits():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).eval()
    rng = np.random.default_rng(0)
    examples = [TokenizedExample(rng.integers(0, 128, n).tolist(), [1] * n) for n in (9, 5, 12, 3)]
    packed = pack_examples(examples, seq_length=32)
    assert len(packed) == 1
    offsets = packed.cu_seqlens[0]
    blocked = block_causal_attention_mask(offsets, packed.seq_length)
    additive = torch.zeros(blocked.shape).masked_fill(blocked, torch.finfo(torch.float32).min)
    with torch.no_grad():
        packed_logits = model(
            input_ids=torch.from_numpy(packed.input_ids.astype(np.int64)),
            position_ids=torch.from_numpy(packed.position_ids.astype(np.int64)),
            attention_mask=additive,
        ).logits[0]
        for start, end in itertools.pairwise(offsets):
            alone = torch.from_numpy(packed.input_ids[:1, start:end].astype(np.int64))
            torch.testing.assert_close(packed_logits[start:end], model(input_ids=alone).logits[0], atol=1e-5, rtol=0)


def test_mask_convention_matches_megatron_local_softmax():
    """megatron's local-spec softmax (``FusedScaleMaskSoftmax``, torch path, ``attention_mask_func``) with
    our mask gives each document exactly the causal softmax of its own scores and nothing across documents."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    softmax = FusedScaleMaskSoftmax(
        input_in_fp16=False,
        input_in_bf16=False,
        attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=False,
        mask_func=attention_mask_func,
        softmax_in_fp32=True,
        scale=None,
    )
    offsets, s = [0, 4, 9], 12
    scores = torch.randn(1, 2, s, s, generator=torch.Generator().manual_seed(0))
    probs = softmax(scores.clone(), block_causal_attention_mask(offsets, s))
    for start, end in itertools.pairwise(offsets):
        own = scores[..., start:end, start:end]
        causal = torch.ones(end - start, end - start, dtype=torch.bool).triu(1)
        torch.testing.assert_close(probs[..., start:end, start:end], own.masked_fill(causal, float("-inf")).softmax(-1))
        assert (
            torch.count_nonzero(probs[..., start:end, :start]) == torch.count_nonzero(probs[..., start:end, end:]) == 0
        )
    assert torch.equal(probs[..., 9:, 9:], torch.eye(3).expand(1, 2, 3, 3)), "padding attends to itself only"
