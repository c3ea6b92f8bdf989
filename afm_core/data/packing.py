"""Pack tokenized SFT examples into fixed-length sequences, with per-document positions and masks.

A packed sequence holds several documents (tokenized trajectories) back to back, then padding.
Attention is confined to each document either by ``cu_seqlens`` (TE / flash-attn ``PackedSeqParams``,
``qkv_format="thd"``) or, on megatron's local (non-TE) spec, by the dense
:func:`block_causal_attention_mask`; position ids restart at 0 for every document, so each document
is computed exactly as if it were alone (checked numerically in ``tests/test_packing.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from afm_core.data.tokenize import IGNORE_INDEX, TokenizedExample


@dataclass(frozen=True)
class PackingStats:
    """What packing did and how well it filled the sequences.

    Attributes:
        num_examples: examples given.
        num_sequences: packed sequences produced.
        num_truncated: examples longer than ``seq_length`` tokens, cut to ``seq_length``.
        num_dropped: examples dropped because no trained token was left (after truncation).
        num_tokens: non-pad tokens over all sequences.
        num_target_tokens: trained tokens (``labels != -100``) over all sequences.
        capacity: ``num_sequences * seq_length`` tokens.
    """

    num_examples: int
    num_sequences: int
    num_truncated: int
    num_dropped: int
    num_tokens: int
    num_target_tokens: int
    capacity: int

    @property
    def efficiency(self) -> float:
        """Packing efficiency: the non-pad share of all token slots, in [0, 1]."""
        return self.num_tokens / self.capacity if self.capacity else 0.0

    @property
    def target_share(self) -> float:
        """The trained-token share of all token slots, in [0, 1]."""
        return self.num_target_tokens / self.capacity if self.capacity else 0.0


@dataclass(frozen=True)
class PackedSequences:
    """``n`` packed sequences of ``s = seq_length`` tokens, held in memory.

    Attributes:
        input_ids: ``[n, s]`` int32 token ids; padding holds ``pad_id``.
        labels: ``[n, s]`` int32, aligned with ``input_ids`` (NOT shifted: ``labels[i, t]`` labels token
            ``t`` itself), -100 on prompt, observation and padding tokens.
        position_ids: ``[n, s]`` int32, 0, 1, 2… restarting at every document and at the padding.
        cu_seqlens: ``n`` int32 arrays ``[d_i + 1]``: cumulative document lengths ``[0, l1, l1+l2, …]``
            in tokens (TE / flash-attn ``cu_seqlens`` convention). Padding lies after ``cu_seqlens[-1]``.
        stats: :class:`PackingStats`.
    """

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    cu_seqlens: list[np.ndarray]
    stats: PackingStats

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_length(self) -> int:
        return self.input_ids.shape[1]


def pack_examples(
    examples: Sequence[TokenizedExample], seq_length: int, *, pad_id: int = 0
) -> PackedSequences:
    """Pack ``examples`` several per sequence, first-fit-decreasing.

    Examples are taken longest first (ties by input order) and each goes into the first sequence with
    room for it, else into a new one; documents keep that order inside a sequence. The result is a
    deterministic function of ``examples``. An example longer than ``seq_length`` tokens is truncated
    to its first ``seq_length`` tokens; one with no trained token left is dropped.

    Raises:
        ValueError: ``seq_length`` < 1.
    """
    return _build(examples, seq_length, pad_id, pack=True)


def pad_examples(examples: Sequence[TokenizedExample], seq_length: int, *, pad_id: int = 0) -> PackedSequences:
    """Unpacked mode: one example per sequence, in input order, right-padded to ``seq_length``.

    Truncation and dropping as in :func:`pack_examples`.

    Raises:
        ValueError: ``seq_length`` < 1.
    """
    return _build(examples, seq_length, pad_id, pack=False)


def _build(examples: Sequence[TokenizedExample], seq_length: int, pad_id: int, pack: bool) -> PackedSequences:
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    docs: list[tuple[list[int], list[int]]] = []
    num_truncated = 0
    for example in examples:
        ids, labels = example.input_ids[:seq_length], example.labels[:seq_length]
        num_truncated += len(example.input_ids) > seq_length
        if any(label != IGNORE_INDEX for label in labels):
            docs.append((ids, labels))
    lengths = np.array([len(ids) for ids, _ in docs], dtype=np.int64)
    bins = _first_fit_decreasing(lengths, seq_length) if pack else [[i] for i in range(len(docs))]

    n = len(bins)
    input_ids = np.full((n, seq_length), pad_id, dtype=np.int32)
    labels = np.full((n, seq_length), IGNORE_INDEX, dtype=np.int32)
    position_ids = np.zeros((n, seq_length), dtype=np.int32)
    cu_seqlens = []
    for row, members in enumerate(bins):
        offsets = [0]
        for doc in members:
            doc_ids, doc_labels = docs[doc]
            start, end = offsets[-1], offsets[-1] + len(doc_ids)
            input_ids[row, start:end] = doc_ids
            labels[row, start:end] = doc_labels
            position_ids[row, start:end] = np.arange(end - start)
            offsets.append(end)
        position_ids[row, offsets[-1] :] = np.arange(seq_length - offsets[-1])
        cu_seqlens.append(np.array(offsets, dtype=np.int32))

    stats = PackingStats(
        num_examples=len(examples),
        num_sequences=n,
        num_truncated=num_truncated,
        num_dropped=len(examples) - len(docs),
        num_tokens=int(lengths.sum()),
        num_target_tokens=int((labels != IGNORE_INDEX).sum()),
        capacity=n * seq_length,
    )
    return PackedSequences(input_ids, labels, position_ids, cu_seqlens, stats)


def _first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bin packing, first-fit-decreasing (Johnson 1973): ``[bins]`` lists of indices into ``lengths``."""
    order = np.argsort(-lengths, kind="stable")
    free = np.empty(len(lengths), dtype=np.int64)  # room left in each open bin, in tokens
    bins: list[list[int]] = []
    for i in order:
        fits = np.flatnonzero(free[: len(bins)] >= lengths[i])
        if fits.size:
            target = int(fits[0])
        else:
            target = len(bins)
            bins.append([])
            free[target] = capacity
        bins[target].append(int(i))
        free[target] -= lengths[i]
    return bins


def block_causal_attention_mask(cu_seqlens: Sequence[int] | np.ndarray | torch.Tensor, seq_length: int) -> torch.Tensor:
    """Dense block-diagonal causal mask for one packed sequence, megatron convention (True = masked out).

    Token ``q`` may attend to token ``k`` iff ``k <= q`` and both lie in the same document
    ``[cu_seqlens[j], cu_seqlens[j+1])``; padding tokens (from ``cu_seqlens[-1]`` on) attend to
    themselves only, so no softmax row is empty. This is the ``attention_mask`` that megatron's
    local-spec ``DotProductAttention`` fills with -10000 (``attention_mask_func``); with TE, pass
    ``cu_seqlens`` through ``PackedSeqParams`` instead. Memory: ``s * s`` bytes.

    Args:
        cu_seqlens: ``[d + 1]`` cumulative document lengths in tokens, starting at 0, at most ``seq_length``.
        seq_length: ``s``, tokens in the sequence.

    Returns:
        ``[1, 1, s, s]`` bool tensor.

    Raises:
        ValueError: ``cu_seqlens`` does not start at 0, decreases, or exceeds ``seq_length``.
    """
    offsets = torch.as_tensor(np.asarray(cu_seqlens), dtype=torch.int64)
    if offsets.numel() == 0 or offsets[0] != 0 or bool((offsets.diff() < 0).any()) or offsets[-1] > seq_length:
        raise ValueError(f"cu_seqlens must rise from 0 to at most seq_length={seq_length}, got {offsets.tolist()}")
    positions = torch.arange(seq_length)
    document = torch.bucketize(positions, offsets[1:], right=True)  # document index of each token
    padding = positions >= offsets[-1]
    document[padding] = -1 - positions[padding]  # each padding token is a document of its own
    same_document = document[:, None] == document[None, :]
    causal = positions[None, :] <= positions[:, None]
    return ~(same_document & causal)[None, None]
