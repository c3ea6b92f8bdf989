"""The SFT data module: prepared parquet -> tokenized, packed sequences -> resumable micro batches.

Tokenization and packing run once per data config and tokenizer: the arrays are cached next to the parquet and
memory-mapped by every rank (:mod:`afm_core.data.token_cache`). Micro batches are built one at a time, when the
training schedule asks for one (:class:`StepMicroBatches`, :class:`MicroBatchPlan`), and carry the dense
``[b, 1, s, s]`` block-causal mask only when the attention implementation needs it (``dense_mask``); every
batch carries the documents' ``cu_seqlens``.

Label convention (megatron ``GPTModel``): batches carry labels ALREADY SHIFTED for next-token
prediction, aligned with the input positions: ``labels[b, t]`` is the token at ``t + 1`` (the target
of the logits at ``t``), -100 where not trained. The shift never crosses a document boundary: the
last token of every document has label -100. ``loss_mask = (labels != -100)`` as float32, so the
loss is ``(per_token_loss * loss_mask).sum() / loss_mask.sum()`` (megatron ``loss_func``).
-100 is safe in megatron's vocab-parallel cross entropy (an out-of-partition id gives a zero target
logit, and the loss mask drops it); HF models, which shift internally, need the unshifted
``PackedSequences.labels`` instead.

One module, past 400 lines: the data module and what it serves (the step's micro-batch plan, the resumable train
iterator, the collate with the label shift above) are one path from parquet to batches, each part read by the next.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pyarrow.parquet as pq
import torch

from afm_core.data.io import DataFormatError
from afm_core.data.packing import PackedSequences, block_causal_attention_mask, pack_examples, pad_examples
from afm_core.data.token_cache import CACHE_DIR_NAME, cache_inputs, cached_packed
from afm_core.data.tokenize import IGNORE_INDEX, TokenizedExample, tokenize_sft_example

if TYPE_CHECKING:  # a rank that maps the token cache never tokenizes: see SFTDataModule.tokenizer
    from transformers import PreTrainedTokenizerBase

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

    Each split is tokenized and packed once, on first use: with ``cache`` (the default) into
    ``<directory of the first parquet file>/tokenized/<key>/`` by the first process to get there, the others
    waiting and then memory-mapping the same arrays (``3 * n * seq_length * 4`` bytes on disk, paged in as
    micro batches touch them); without, in memory.

    Args:
        train_paths: prepared parquet files of the train split.
        tokenizer: a fast HF tokenizer with a chat template, or its checkpoint directory (loaded only when the
            cache must be built; its files key the cache).
        seq_length: tokens per sequence (examples longer than this are truncated).
        heldout_paths: prepared parquet files of the held-out split (may be empty).
        pack: several examples per sequence (first-fit-decreasing), attention confined to each document;
            else one example per sequence and plain causal attention.
        mask_observations: label -100 on every ``<observation>`` span.
        system: optional system message for the chat template.
        dense_mask: packed micro batches carry the dense ``[b, 1, s, s]`` block-causal ``attention_mask``
            (``s * s`` bytes per sequence: 1 GiB at 32k) for attention that cannot read ``cu_seqlens``;
            None: ``pack``.
        cache: cache the tokenized, packed arrays next to the parquet (see :mod:`afm_core.data.token_cache`).
    """

    def __init__(
        self,
        train_paths: Sequence[str | Path],
        tokenizer: PreTrainedTokenizerBase | str | Path,
        seq_length: int,
        *,
        heldout_paths: Sequence[str | Path] = (),
        pack: bool = True,
        mask_observations: bool = True,
        system: str | None = None,
        dense_mask: bool | None = None,
        cache: bool = True,
    ):
        self.train_paths = list(train_paths)
        self.heldout_paths = list(heldout_paths)
        self._tokenizer = tokenizer
        self.seq_length = seq_length
        self.pack = pack
        self.mask_observations = mask_observations
        self.system = system
        self.dense_mask = pack if dense_mask is None else bool(dense_mask) and pack
        self.cache = cache
        self.built: dict[str, bool] = {}  # split -> whether this process tokenized it (False: mapped the cache)

    @cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer (loaded from its directory on first use)."""
        if isinstance(self._tokenizer, (str, Path)):
            # Imported here, not at the top: transformers' tokenizer classes (tokenization_auto and the auto factory,
            # ~1.2-1.9 s of CPU on two EPYC cores) are needed only to build a split; a rank whose token cache exists
            # keys it by the tokenizer's files (token_cache.tokenizer_fingerprint) and maps the arrays without them.
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self._tokenizer, local_files_only=True)
        return self._tokenizer

    @cached_property
    def train(self) -> PackedSequences:
        """The packed train split."""
        return self._split("train", self.train_paths)

    @cached_property
    def heldout(self) -> PackedSequences:
        """The packed held-out split (no sequences when there are no held-out files)."""
        return self._split("heldout", self.heldout_paths)

    def _split(self, name: str, paths: list[str | Path]) -> PackedSequences:
        if not (self.cache and paths):
            self.built[name] = True
            return self._build(paths)
        inputs = cache_inputs(
            paths,
            self._tokenizer,
            seq_length=self.seq_length,
            pack=self.pack,
            mask_observations=self.mask_observations,
            system=self.system,
        )
        packed, self.built[name] = cached_packed(
            Path(paths[0]).parent / CACHE_DIR_NAME, inputs, lambda: self._build(paths)
        )
        return packed

    def _build(self, paths: list[str | Path]) -> PackedSequences:
        tokenizer = self.tokenizer
        examples = read_sft_examples(paths, tokenizer, mask_observations=self.mask_observations, system=self.system)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        build = pack_examples if self.pack else pad_examples
        return build(examples, self.seq_length, pad_id=pad_id)

    def train_iterator(self, *, seed: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> TrainIterator:
        """The infinite, resumable train micro-batch iterator of data-parallel rank ``dp_rank``."""
        return TrainIterator(
            self.train,
            seed=seed,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            pack=self.pack,
            dense_mask=self.dense_mask,
        )

    def heldout_batches(
        self,
        *,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        max_sequences: int | None = None,
    ) -> MicroBatchPlan:
        """Held-out micro batches of rank ``dp_rank``, in order, no shuffle; built when iterated, re-iterable.

        Takes the first ``max_sequences`` held-out sequences (all when None), cut to a multiple of
        ``dp_size`` so that every rank runs the same number of forward passes; rank ``r`` gets
        sequences ``r, r + dp_size, …``. The last micro batch may be smaller.
        """
        data = self.heldout
        count = len(data) if max_sequences is None else min(max_sequences, len(data))
        indices = np.arange(count - count % dp_size)[dp_rank::dp_size]
        groups = [indices[start : start + micro_batch_size] for start in range(0, len(indices), micro_batch_size)]
        return MicroBatchPlan(data, groups, pack=self.pack, dense_mask=self.dense_mask)


class MicroBatchPlan:
    """Micro batches described by their sequence indices, each collated only when an iterator reaches it.

    ``len()`` is the number of micro batches; every ``iter()`` walks them from the first (a pipeline schedule
    with virtual stages iterates once per model chunk).
    """

    def __init__(self, data: PackedSequences, groups: Sequence[np.ndarray], *, pack: bool, dense_mask: bool):
        self.data, self.groups, self.pack, self.dense_mask = data, list(groups), pack, dense_mask

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (collate(self.data, g, pack=self.pack, dense_mask=self.dense_mask) for g in self.groups)

    def full(self, micro_batch_size: int) -> MicroBatchPlan:
        """Only the micro batches of exactly ``micro_batch_size`` sequences."""
        groups = [g for g in self.groups if len(g) == micro_batch_size]
        return MicroBatchPlan(self.data, groups, pack=self.pack, dense_mask=self.dense_mask)


def full_micro_batches(batches: Any, micro_batch_size: int) -> Any:
    """The held-out micro batches with exactly ``micro_batch_size`` sequences (pipeline shapes are fixed): a
    :class:`MicroBatchPlan` stays lazy; any other iterable of batches becomes a list.

    Raises:
        ValueError: none is left (too few held-out sequences for one micro batch per DP rank).
    """
    if isinstance(batches, MicroBatchPlan):
        full: Any = batches.full(micro_batch_size)
    else:
        full = [b for b in batches if b["tokens"].shape[0] == micro_batch_size]
    if not len(full):
        raise ValueError(
            f"no full held-out micro batch of trainer.micro_batch_size={micro_batch_size}: raise "
            "trainer.eval_sequences or data.heldout_fraction"
        )
    return full


class MicroBatchStream(Protocol):
    """Anything ``next()`` gives micro batches from (a :class:`TrainIterator`)."""

    def __next__(self) -> dict[str, Any]: ...


class StepMicroBatches:
    """The ``count`` micro batches of one optimizer step, taken from ``source`` only when a schedule asks.

    Every ``iter()`` yields the same ``count`` batches in order (one iterator per model chunk under an
    interleaved pipeline schedule); batch ``i`` is taken from ``source`` when the first iterator reaches it
    and dropped once every iterator has passed it, so a step holds only the micro batches in flight, not all
    ``count`` of them. Create all iterators before advancing any.

    Args:
        source: the rank's micro batch stream (``next()``), e.g. :class:`TrainIterator`.
        count: micro batches in the step.
        check: called on each batch as it is taken (e.g. a shape check).
    Raises:
        RuntimeError: an iterator created after another one has already passed a batch.
    """

    def __init__(self, source: MicroBatchStream, count: int, check: Callable[[dict[str, Any]], None] | None = None):
        self.source, self.count, self.check = source, count, check
        self._readers = 0
        self._taken = 0  # batches taken from the source
        self._held: dict[int, list[Any]] = {}  # index -> [batch, iterators that have yielded it]

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._taken > len(self._held):
            raise RuntimeError("StepMicroBatches: an iterator was created after batches were released")
        self._readers += 1
        return (self._get(i) for i in range(self.count))

    def _get(self, i: int) -> dict[str, Any]:
        if i == self._taken:
            batch = next(self.source)
            if self.check is not None:
                self.check(batch)
            self._held[i] = [batch, 0]
            self._taken += 1
        entry = self._held[i]
        entry[1] += 1
        if entry[1] == self._readers:
            del self._held[i]
        return entry[0]


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
        self,
        data: PackedSequences,
        *,
        seed: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        pack: bool,
        dense_mask: bool | None = None,
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
        self.dense_mask = pack if dense_mask is None else dense_mask
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
        batch = collate(self.data, self._epoch_order[self.position], pack=self.pack, dense_mask=self.dense_mask)
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


def collate(
    data: PackedSequences, indices: Sequence[int] | np.ndarray, *, pack: bool, dense_mask: bool | None = None
) -> dict[str, Any]:
    """A megatron-ready micro batch of the sequences ``data[indices]`` (``b = len(indices)``, ``s = seq_length``).

    Returns a dict:
        tokens: ``[b, s]`` int64 input ids.
        labels: ``[b, s]`` int64, shifted: ``labels[:, t]`` is the token at ``t + 1`` of the same
            document, -100 where not trained and at each document's last token.
        loss_mask: ``[b, s]`` float32, ``labels != -100``.
        position_ids: ``[b, s]`` int64, restarting at 0 in every document.
        attention_mask: ``[b, 1, s, s]`` bool, True = masked out (block-causal per document) when
            packed and ``dense_mask`` (default: ``pack``); None otherwise (unpacked: plain causal attention,
            the padding comes last; packed without it: attention reads ``cu_seqlens``).
        cu_seqlens: ``b`` int32 tensors ``[d_i + 1]``, document offsets in tokens (padding excluded).
        num_target_tokens: 0-d int64 tensor, trained tokens in the micro batch (``loss_mask.sum()``).
    """
    indices = np.asarray(indices)
    tokens = torch.from_numpy(data.input_ids[indices].astype(np.int64))
    unshifted = data.labels[indices]
    shifted = np.full_like(unshifted, IGNORE_INDEX, dtype=np.int64)
    shifted[:, :-1] = unshifted[:, 1:]
    cu_seqlens = [torch.from_numpy(data.cu_seqlens[i]) for i in indices]
    for row, offsets in enumerate(cu_seqlens):
        ends = offsets[1:].numpy()
        shifted[row, ends[ends > 0] - 1] = IGNORE_INDEX
    labels = torch.from_numpy(shifted)
    loss_mask = (labels != IGNORE_INDEX).float()
    attention_mask = None
    if pack and (pack if dense_mask is None else dense_mask):
        s = data.seq_length
        attention_mask = torch.empty(len(indices), 1, s, s, dtype=torch.bool)
        for row, offsets in enumerate(cu_seqlens):
            block_causal_attention_mask(offsets, s, out=attention_mask[row : row + 1])
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": torch.from_numpy(data.position_ids[indices].astype(np.int64)),
        "attention_mask": attention_mask,
        "cu_seqlens": cu_seqlens,
        "num_target_tokens": loss_mask.sum().to(torch.int64),
    }
