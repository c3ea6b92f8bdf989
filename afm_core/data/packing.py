"""Pack tokenized SFT examples into fixed-length sequences, with per-document positions and masks.

A packed sequence holds several documents (tokenized trajectories) back to back, then padding.
Attention is confined to each document either by ``cu_seqlens`` (TE / flash-attn ``PackedSeqParams``,
``qkv_format="thd"``) or, on megatron's local (non-TE) spec, by the dense
:func:`block_causal_attention_mask`; position ids restart at 0 for every document, so each document
is computed exactly as if it were alone (checked numerically in ``tests/test_packing.py``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

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


class RaggedArray:
    """``n`` variable-length int32 rows stored flat: row ``i`` is ``values[offsets[i]:offsets[i + 1]]`` (a view).

    Args:
        values: ``[total]`` concatenated rows.
        offsets: ``[n + 1]`` int64 row starts in ``values``, from 0 to ``total``.
    """

    def __init__(self, values: np.ndarray, offsets: np.ndarray):
        self.values, self.offsets = values, offsets

    @classmethod
    def from_rows(cls, rows: Sequence[np.ndarray]) -> RaggedArray:
        offsets: np.ndarray = np.zeros(len(rows) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(r) for r in rows])
        values = np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, dtype=np.int32)
        return cls(values, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))


_ARRAYS = ("input_ids", "labels", "position_ids")


@dataclass(frozen=True)
class PackedSequences:
    """``n`` packed sequences of ``s = seq_length`` tokens, in memory or memory-mapped (:meth:`load`).

    Attributes:
        input_ids: ``[n, s]`` int32 token ids; padding holds ``pad_id``.
        labels: ``[n, s]`` int32, aligned with ``input_ids`` (NOT shifted: ``labels[i, t]`` labels token
            ``t`` itself), -100 on prompt, observation and padding tokens.
        position_ids: ``[n, s]`` int32, 0, 1, 2… restarting at every document and at the padding.
        cu_seqlens: ``n`` int32 arrays ``[d_i + 1]`` (a list or a :class:`RaggedArray`): cumulative document
            lengths ``[0, l1, l1+l2, …]`` in tokens (TE / flash-attn ``cu_seqlens`` convention). Padding lies
            after ``cu_seqlens[-1]``.
        stats: :class:`PackingStats`.
    """

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    cu_seqlens: Sequence[np.ndarray] | RaggedArray
    stats: PackingStats

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_length(self) -> int:
        return self.input_ids.shape[1]

    def save(self, directory: str | Path) -> None:
        """Write ``input_ids.npy``, ``labels.npy``, ``position_ids.npy``, ``cu_seqlens.npy`` (flat),
        ``cu_offsets.npy`` and ``stats.json`` into ``directory`` (created; make it atomic from outside)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in _ARRAYS:
            np.save(directory / f"{name}.npy", np.ascontiguousarray(getattr(self, name), dtype=np.int32))
        ragged = (
            self.cu_seqlens
            if isinstance(self.cu_seqlens, RaggedArray)
            else RaggedArray.from_rows(list(self.cu_seqlens))
        )
        np.save(directory / "cu_seqlens.npy", ragged.values)
        np.save(directory / "cu_offsets.npy", ragged.offsets)
        (directory / "stats.json").write_text(json.dumps(asdict(self.stats)) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, directory: str | Path) -> PackedSequences:
        """The sequences :meth:`save` wrote, memory-mapped read-only (pages are shared by every process that maps
        them, and only the rows a micro batch touches are read)."""
        directory = Path(directory)
        arrays = {name: _load_mapped(directory / f"{name}.npy") for name in _ARRAYS}
        cu_seqlens = RaggedArray(np.load(directory / "cu_seqlens.npy"), np.load(directory / "cu_offsets.npy"))
        stats = PackingStats(**json.loads((directory / "stats.json").read_text(encoding="utf-8")))
        return cls(cu_seqlens=cu_seqlens, stats=stats, **arrays)


def _load_mapped(path: Path) -> np.ndarray:
    array = np.load(path, mmap_mode="r")
    return array if array.size else np.load(path)  # an empty array has nothing to map


def pack_examples(examples: Sequence[TokenizedExample], seq_length: int, *, pad_id: int = 0) -> PackedSequences:
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
        ids, doc_labels = example.input_ids[:seq_length], example.labels[:seq_length]
        num_truncated += len(example.input_ids) > seq_length
        if any(label != IGNORE_INDEX for label in doc_labels):
            docs.append((ids, doc_labels))
    lengths = np.array([len(ids) for ids, _ in docs], dtype=np.int64)
    bins = first_fit_decreasing(lengths, seq_length) if pack else [[i] for i in range(len(docs))]

    input_ids, labels, position_ids, cu_seqlens = fill_sequences(docs, bins, seq_length, pad_id)
    n = len(bins)
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


def fill_sequences(
    docs: Sequence[tuple[Sequence[int], Sequence[int]]], bins: Sequence[Sequence[int]], seq_length: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """Lay documents out in packed rows: row ``r`` holds ``docs[i]`` for ``i`` in ``bins[r]``, in that order, back
    to back, then padding; positions restart at 0 in every document and in the padding.

    Args:
        docs: ``(input ids, labels)`` per document (labels unshifted, -100 where not trained).
        bins: the document indices of each row; a row's documents fit in ``seq_length`` tokens.
    Returns:
        ``(input_ids, labels, position_ids, cu_seqlens)``: ``[n, s]`` int32 arrays and ``n`` int32 ``[d_r + 1]``
        document offsets (the fields of :class:`PackedSequences`).
    """
    n = len(bins)
    input_ids: np.ndarray = np.full((n, seq_length), pad_id, dtype=np.int32)
    labels: np.ndarray = np.full((n, seq_length), IGNORE_INDEX, dtype=np.int32)
    position_ids: np.ndarray = np.zeros((n, seq_length), dtype=np.int32)
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
    return input_ids, labels, position_ids, cu_seqlens


def thd_offsets(cu_seqlens: Sequence[Sequence[int] | np.ndarray | torch.Tensor], seq_length: int) -> list[int]:
    """Document offsets of ``b`` packed sequences laid end to end as one row of ``b * seq_length`` tokens (the
    ``thd`` format, as Megatron-LM packs a micro batch): each document is a sequence, and each row's trailing
    padding one more. Host work on the rows' ``cu_seqlens``, once per micro batch.

    Args:
        cu_seqlens: ``b`` ``[d_i + 1]`` document offsets in tokens (the loader's ``cu_seqlens``).
        seq_length: tokens in each packed sequence.
    Returns:
        ``[D + 1]`` offsets from 0 to ``b * seq_length``.
    Raises:
        ValueError: offsets of a row that do not rise from 0 to at most ``seq_length``.
    """
    offsets = [0]
    for row, bounds in enumerate(cu_seqlens):
        ends = np.asarray(bounds, dtype=np.int64).ravel().tolist()
        if not ends or ends[0] != 0 or any(e < a for a, e in itertools.pairwise(ends)) or ends[-1] > seq_length:
            raise ValueError(f"cu_seqlens of row {row} must rise from 0 to at most seq_length={seq_length}, got {ends}")
        if ends[-1] < seq_length:
            ends.append(seq_length)
        offsets.extend(row * seq_length + e for e in ends[1:])
    return offsets


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bin packing, first-fit-decreasing (Johnson 1973): ``[bins]`` lists of indices into ``lengths``."""
    order = np.argsort(-lengths, kind="stable")
    free: np.ndarray = np.empty(len(lengths), dtype=np.int64)  # room left in each open bin, in tokens
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


def block_causal_attention_mask(
    cu_seqlens: Sequence[int] | np.ndarray | torch.Tensor, seq_length: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Dense block-diagonal causal mask for one packed sequence, megatron convention (True = masked out).

    Token ``q`` may attend to token ``k`` iff ``k <= q`` and both lie in the same document
    ``[cu_seqlens[j], cu_seqlens[j+1])``; padding tokens (from ``cu_seqlens[-1]`` on) attend to
    themselves only, so no softmax row is empty. This is the ``attention_mask`` that megatron's
    local-spec ``DotProductAttention`` fills with -10000 (``attention_mask_func``); with TE, pass
    ``cu_seqlens`` through ``PackedSeqParams`` instead. Memory: ``s * s`` bytes, written in place (each
    document's block is cut to its strict upper triangle with ``triu_``), no ``s * s`` temporaries.

    Args:
        cu_seqlens: ``[d + 1]`` cumulative document lengths in tokens, starting at 0, at most ``seq_length``.
        seq_length: ``s``, tokens in the sequence.
        out: a ``[1, 1, s, s]`` (or ``[s, s]``) bool tensor to fill instead of allocating one.

    Returns:
        ``[1, 1, s, s]`` bool tensor (``out`` when given).

    Raises:
        ValueError: ``cu_seqlens`` does not start at 0, decreases, or exceeds ``seq_length``.
    """
    offsets = torch.as_tensor(np.asarray(cu_seqlens), dtype=torch.int64)
    if offsets.numel() == 0 or offsets[0] != 0 or bool((offsets.diff() < 0).any()) or offsets[-1] > seq_length:
        raise ValueError(f"cu_seqlens must rise from 0 to at most seq_length={seq_length}, got {offsets.tolist()}")
    mask = torch.empty(1, 1, seq_length, seq_length, dtype=torch.bool) if out is None else out
    square = mask.view(seq_length, seq_length)
    square.fill_(True)
    bounds = offsets.tolist()
    for start, end in itertools.pairwise(bounds):
        square[start:end, start:end].triu_(diagonal=1)  # in the document: k <= q attends (False)
    padding = torch.arange(bounds[-1], seq_length)
    square[padding, padding] = False  # each padding token attends to itself
    return mask
