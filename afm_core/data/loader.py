"""The SFT data module: prepared parquet -> tokenized, packed sequences -> resumable micro batches.

Label convention (megatron ``GPTModel``): batches carry labels ALREADY SHIFTED for next-token
prediction, aligned with the input positions: ``labels[b, t]`` is the token at ``t + 1`` (the target
of the logits at ``t``), -100 where not trained. The shift never crosses a document boundary: the
last token of every document has label -100. ``loss_mask = (labels != -100)`` as float32, so the
loss is ``(per_token_loss * loss_mask).sum() / loss_mask.sum()`` (megatron ``loss_func``).
-100 is safe in megatron's vocab-parallel cross entropy (an out-of-partition id gives a zero target
logit, and the loss mask drops it); HF models, which shift internally, need the unshifted
``PackedSequences.labels`` instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from transformers import PreTrainedTokenizerBase

from afm_core.data.io import DataFormatError
from afm_core.data.packing import PackedSequences, block_causal_attention_mask, pack_examples, pad_examples
from afm_core.data.tokenize import IGNORE_INDEX, TokenizedExample, tokenize_sft_example

PROMPT_FIELD = "prompt"
RESPONSE_FIELD = "response"


def read_sft_examples(
    paths: Sequence[str | Path],
    tokenizer: PreTrainedTokenizerBase,
    *,
    mask_observations: bool = True,
    system: str | None = None,
) -> list[TokenizedExample]:
    """Tokenize every row of the prepared parquet files ``paths`` (columns ``prompt``, ``response``), in order.

    Raises:
        FileNotFoundError: a path does not exist.
        DataFormatError: a file lacks a column, or a row's field is null or not a string; the
            message names the file, the row (0-based) and the field.
    """
    examples = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such parquet file")
        schema = pq.read_schema(path)
        missing = [f for f in (PROMPT_FIELD, RESPONSE_FIELD) if f not in schema.names]
        if missing:
            raise DataFormatError(f"{path}: missing column(s) {missing}; has {schema.names}")
        table = pq.read_table(path, columns=[PROMPT_FIELD, RESPONSE_FIELD]).to_pydict()
        for row, (prompt, response) in enumerate(zip(table[PROMPT_FIELD], table[RESPONSE_FIELD])):
            for field, value in ((PROMPT_FIELD, prompt), (RESPONSE_FIELD, response)):
                if not isinstance(value, str):
                    raise DataFormatError(f"{path}: row {row}: field {field!r} must be a string, got {value!r:.80}")
            examples.append(
                tokenize_sft_example(tokenizer, prompt, response, mask_observations=mask_observations, system=system)
            )
    return examples


class SFTDataModule:
    """Packed train and held-out sequences from prepared parquet, with resumable train micro batches.

    Each split is tokenized and packed once, on first use, and kept in memory (``PackedSequences``
    arrays: ``3 * n * seq_length * 4`` bytes).

    Args:
        train_paths: prepared parquet files of the train split.
        tokenizer: a fast HF tokenizer with a chat template.
        seq_length: tokens per sequence (examples longer than this are truncated).
        heldout_paths: prepared parquet files of the held-out split (may be empty).
        pack: several examples per sequence (first-fit-decreasing) with a block-causal attention
            mask; else one example per sequence and plain causal attention.
        mask_observations: label -100 on every ``<observation>`` span.
        system: optional system message for the chat template.
    """

    def __init__(
        self,
        train_paths: Sequence[str | Path],
        tokenizer: PreTrainedTokenizerBase,
        seq_length: int,
        *,
        heldout_paths: Sequence[str | Path] = (),
        pack: bool = True,
        mask_observations: bool = True,
        system: str | None = None,
    ):
        self.train_paths = list(train_paths)
        self.heldout_paths = list(heldout_paths)
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.pack = pack
        self.mask_observations = mask_observations
        self.system = system

    @cached_property
    def train(self) -> PackedSequences:
        """The packed train split."""
        return self._build(self.train_paths)

    @cached_property
    def heldout(self) -> PackedSequences:
        """The packed held-out split (no sequences when there are no held-out files)."""
        return self._build(self.heldout_paths)

    def _build(self, paths: list[str | Path]) -> PackedSequences:
        examples = read_sft_examples(
            paths, self.tokenizer, mask_observations=self.mask_observations, system=self.system
        )
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        build = pack_examples if self.pack else pad_examples
        return build(examples, self.seq_length, pad_id=pad_id)

    def train_iterator(
        self, *, seed: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1
    ) -> TrainIterator:
        """The infinite, resumable train micro-batch iterator of data-parallel rank ``dp_rank``."""
        return TrainIterator(
            self.train, seed=seed, micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size, pack=self.pack
        )

    def heldout_batches(
        self,
        *,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        max_sequences: int | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Held-out micro batches of rank ``dp_rank``, in order, no shuffle; finite.

        Takes the first ``max_sequences`` held-out sequences (all when None), cut to a multiple of
        ``dp_size`` so that every rank runs the same number of forward passes; rank ``r`` gets
        sequences ``r, r + dp_size, …``. The last micro batch may be smaller.
        """
        data = self.heldout
        count = len(data) if max_sequences is None else min(max_sequences, len(data))
        indices = np.arange(count - count % dp_size)[dp_rank::dp_size]
        for start in range(0, len(indices), micro_batch_size):
            yield collate(data, indices[start : start + micro_batch_size], pack=self.pack)


class TrainIterator:
    """Infinite train micro batches for one data-parallel rank; resumable with ``state_dict()``.

    Epoch ``e`` visits the sequences in the order ``np.random.default_rng([seed, e]).permutation(n)``.
    That order is cut to ``k * dp_size * micro_batch_size`` sequences (the tail is dropped for that
    epoch, so every rank gets ``k`` micro batches) and viewed as ``[k, dp_size, micro_batch_size]``:
    micro batch ``i`` of rank ``r`` is ``order[i, r]``, so micro batch ``i`` of all ranks together is
    one contiguous block of the epoch's order. The stream depends only on (seed, dp_rank, dp_size,
    micro_batch_size, the data): a run restored from ``state_dict()`` yields exactly the micro batches
    that the uninterrupted run would have yielded next.

    Raises:
        ValueError: fewer than ``dp_size * micro_batch_size`` sequences, or a bad rank / size.
    """

    def __init__(
        self, data: PackedSequences, *, seed: int, micro_batch_size: int, dp_rank: int, dp_size: int, pack: bool
    ):
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}")
        if len(data) < dp_size * micro_batch_size:
            raise ValueError(
                f"{len(data)} train sequences cannot fill one micro batch of {micro_batch_size} on each of {dp_size} ranks"
            )
        self.data = data
        self.seed = seed
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.pack = pack
        self.micro_batches_per_epoch = len(data) // (dp_size * micro_batch_size)
        self.epoch = 0
        self.position = 0  # micro batches of the current epoch already yielded
        self._epoch_order = self._order(self.epoch)

    def _order(self, epoch: int) -> np.ndarray:
        """``[micro_batches_per_epoch, micro_batch_size]`` sequence indices of this rank in ``epoch``."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.data))
        used = self.micro_batches_per_epoch * self.dp_size * self.micro_batch_size
        return order[:used].reshape(self.micro_batches_per_epoch, self.dp_size, self.micro_batch_size)[:, self.dp_rank]

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        if self.position == self.micro_batches_per_epoch:
            self.epoch += 1
            self.position = 0
            self._epoch_order = self._order(self.epoch)
        batch = collate(self.data, self._epoch_order[self.position], pack=self.pack)
        self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands: ``epoch`` and ``position`` (micro batches yielded in that epoch),
        plus the settings that define the stream, checked on load."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "dp_size": self.dp_size,
            "micro_batch_size": self.micro_batch_size,
            "num_sequences": len(self.data),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` (from :meth:`state_dict` of the same rank).

        Raises:
            ValueError: ``state`` was saved with another seed, DP size, micro batch size or data, or
                its position lies outside the epoch.
        """
        mine = self.state_dict()
        for key in ("seed", "dp_size", "micro_batch_size", "num_sequences"):
            if state[key] != mine[key]:
                raise ValueError(f"data loader state has {key}={state[key]}, this run has {key}={mine[key]}")
        if not 0 <= state["position"] <= self.micro_batches_per_epoch or state["epoch"] < 0:
            raise ValueError(
                f"data loader state epoch={state['epoch']} position={state['position']} is outside "
                f"0..{self.micro_batches_per_epoch} micro batches per epoch"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._epoch_order = self._order(self.epoch)


def collate(data: PackedSequences, indices: Sequence[int] | np.ndarray, *, pack: bool) -> dict[str, Any]:
    """A megatron-ready micro batch of the sequences ``data[indices]`` (``b = len(indices)``, ``s = seq_length``).

    Returns a dict:
        tokens: ``[b, s]`` int64 input ids.
        labels: ``[b, s]`` int64, shifted: ``labels[:, t]`` is the token at ``t + 1`` of the same
            document, -100 where not trained and at each document's last token.
        loss_mask: ``[b, s]`` float32, ``labels != -100``.
        position_ids: ``[b, s]`` int64, restarting at 0 in every document.
        attention_mask: ``[b, 1, s, s]`` bool, True = masked out (block-causal per document) when
            packed; None when not packed (plain causal attention, the padding comes last).
        cu_seqlens: ``b`` int32 tensors ``[d_i + 1]``, document offsets in tokens (padding excluded).
        num_target_tokens: 0-d int64 tensor, trained tokens in the micro batch (``loss_mask.sum()``).
    """
    indices = np.asarray(indices)
    tokens = torch.from_numpy(data.input_ids[indices].astype(np.int64))
    unshifted = data.labels[indices]
    labels = np.full_like(unshifted, IGNORE_INDEX, dtype=np.int64)
    labels[:, :-1] = unshifted[:, 1:]
    cu_seqlens = [torch.from_numpy(data.cu_seqlens[i]) for i in indices]
    for row, offsets in enumerate(cu_seqlens):
        ends = offsets[1:].numpy()
        labels[row, ends[ends > 0] - 1] = IGNORE_INDEX
    labels = torch.from_numpy(labels)
    loss_mask = (labels != IGNORE_INDEX).float()
    attention_mask = None
    if pack:
        attention_mask = torch.cat([block_causal_attention_mask(c, data.seq_length) for c in cu_seqlens])
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": torch.from_numpy(data.position_ids[indices].astype(np.int64)),
        "attention_mask": attention_mask,
        "cu_seqlens": cu_seqlens,
        "num_target_tokens": loss_mask.sum().to(torch.int64),
    }
