"""The SFT data module on real HotpotQA paragraphs rendered as CoA trajectories, with the SmolLM2 tokenizer.

Checks megatron-ready batches (shifted labels, loss mask, positions, block mask), DP sharding,
epoch shuffling, and that a resumed iterator yields exactly the batches of an uninterrupted one.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from afm_core.coa.render import render_response
from afm_core.coa.trajectory import Step
from afm_core.data.loader import SFTDataModule, StepMicroBatches, read_sft_examples
from afm_core.data.packing import block_causal_attention_mask
from afm_core.data.tokenize import IGNORE_INDEX
from afm_core.utils.paths import shared_data_dir
from tests.test_loss_mask import smollm2_tokenizer  # noqa: F401  (session fixture)

HOTPOT = shared_data_dir() / "mhqa" / "hotpotqa500"
SEQ_LENGTH = 512


def _hotpot_rows(first: int, count: int) -> list[dict[str, str]]:
    """CoA trajectories for HotpotQA questions: one wiki_search + observation per gold paragraph, then the answer."""
    if not HOTPOT.is_dir():
        pytest.skip(f"real data folder {HOTPOT} is absent (set AFM_SHARED_DATA)")
    with (HOTPOT / "corpus.jsonl").open() as f:
        corpus = {doc["id"]: doc for doc in map(json.loads, f)}
    with (HOTPOT / "questions.jsonl").open() as f:
        questions = [json.loads(line) for line in f][first : first + count]
    rows = []
    for q in questions:
        steps = [Step("plan", "Find each entity of the question, then combine the facts.")]
        for doc_id in q["gold_doc_ids"]:
            doc = corpus[doc_id]
            steps += [Step("wiki_search", doc["title"]), Step("observation", doc["contents"])]
        steps += [Step("think", "The paragraphs answer it."), Step("answer", q["golden_answers"][0])]
        rows.append({"id": q["id"], "prompt": f"Question: {q['question']}", "response": render_response(steps)})
    return rows


def _write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prepared")
    return {
        "train": [
            _write_parquet(folder / "train-0.parquet", _hotpot_rows(0, 60)),
            _write_parquet(folder / "train-1.parquet", _hotpot_rows(60, 60)),
        ],
        "heldout": [_write_parquet(folder / "heldout.parquet", _hotpot_rows(120, 20))],
    }


@pytest.fixture(scope="module")
def packed_module(data_files, smollm2_tokenizer):  # noqa: F811
    module = SFTDataModule(data_files["train"], smollm2_tokenizer, SEQ_LENGTH, heldout_paths=data_files["heldout"])
    _ = module.train, module.heldout  # tokenize and pack once for the whole module
    return module


@pytest.fixture(scope="module")
def small_module(data_files, smollm2_tokenizer):  # noqa: F811
    """20 trajectories: cheap enough to draw many micro batches."""
    return SFTDataModule(data_files["heldout"], smollm2_tokenizer, SEQ_LENGTH)


def test_packing_fills_sequences(packed_module, data_files, smollm2_tokenizer):  # noqa: F811
    stats = packed_module.train.stats
    assert stats.num_examples == 120 and stats.num_dropped == 0
    assert 0 < stats.target_share < stats.efficiency <= 1
    unpacked = SFTDataModule(data_files["train"], smollm2_tokenizer, SEQ_LENGTH, pack=False).train.stats
    assert unpacked.num_sequences == 120 and unpacked.num_tokens == stats.num_tokens
    assert stats.num_sequences < unpacked.num_sequences and stats.efficiency > unpacked.efficiency
    assert len(packed_module.heldout) > 0


def test_batches_are_megatron_ready(packed_module, smollm2_tokenizer):  # noqa: F811
    batch = next(packed_module.train_iterator(seed=1, micro_batch_size=2))
    b, s = 2, SEQ_LENGTH
    assert batch["tokens"].shape == (b, s) and batch["tokens"].dtype == torch.int64
    assert batch["labels"].dtype == torch.int64 and batch["position_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["loss_mask"], (batch["labels"] != IGNORE_INDEX).float())
    assert batch["num_target_tokens"].item() == int(batch["loss_mask"].sum()) > 0
    assert batch["attention_mask"].shape == (b, 1, s, s) and batch["attention_mask"].dtype == torch.bool
    for row in range(b):
        offsets = batch["cu_seqlens"][row]
        assert torch.equal(batch["attention_mask"][row : row + 1], block_causal_attention_mask(offsets, s))
        trained = batch["loss_mask"][row].bool()
        # Shifted: the label at t is the next token of the same document.
        assert torch.equal(batch["labels"][row, :-1][trained[:-1]], batch["tokens"][row, 1:][trained[:-1]])
        for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            assert batch["labels"][row, end - 1] == IGNORE_INDEX, "no target across a document boundary"
            assert batch["position_ids"][row, start:end].tolist() == list(range(end - start))
            # The document's trained targets are its assistant text minus observations, ending with <|im_end|>.
            targets = batch["labels"][row, start:end][trained[start:end]].tolist()
            text = smollm2_tokenizer.decode(targets)
            assert text.endswith("</answer><|im_end|>") and text.startswith("<plan>")
            assert "observation" not in text and "Question:" not in text


def test_observations_are_never_targets(packed_module, smollm2_tokenizer):  # noqa: F811
    """Every packed document's observation paragraphs (real text) are absent from its trained targets."""
    data = packed_module.train
    for row in range(len(data)):
        for start, end in zip(data.cu_seqlens[row][:-1], data.cu_seqlens[row][1:]):
            ids, labels = data.input_ids[row, start:end], data.labels[row, start:end]
            document = smollm2_tokenizer.decode(ids.tolist())
            trained = smollm2_tokenizer.decode(labels[labels != IGNORE_INDEX].tolist())
            for observation in re.findall(r"<observation>\n(.*?)\n</observation>", document, re.DOTALL):
                assert observation[:40] not in trained


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def _same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask"))


def test_resume_yields_the_same_remaining_batches(small_module):
    settings = dict(seed=7, micro_batch_size=2, dp_rank=1, dp_size=2)
    uninterrupted = small_module.train_iterator(**settings)
    per_epoch = uninterrupted.micro_batches_per_epoch
    reference = _take(uninterrupted, 2 * per_epoch + 3)  # crosses two epoch boundaries

    for stop in (0, per_epoch - 1, per_epoch, per_epoch + 2):
        interrupted = small_module.train_iterator(**settings)
        _take(interrupted, stop)
        state = json.loads(json.dumps(interrupted.state_dict()))  # as saved in a checkpoint
        resumed = small_module.train_iterator(**settings)
        resumed.load_state_dict(state)
        rest = _take(resumed, len(reference) - stop)
        assert all(_same(a, b) for a, b in zip(rest, reference[stop:])), f"resume after {stop} micro batches"


def test_epochs_shuffle_and_ranks_partition(small_module):
    n = len(small_module.train)
    dp_size, mbs = 2, 2
    per_rank = [
        small_module.train_iterator(seed=3, micro_batch_size=mbs, dp_rank=r, dp_size=dp_size) for r in range(dp_size)
    ]
    k = per_rank[0].micro_batches_per_epoch
    assert k == n // (dp_size * mbs)
    epochs = []
    for _ in range(2):
        seen = [
            batch["tokens"][i].numpy().tobytes()
            for iterator in per_rank
            for batch in _take(iterator, k)
            for i in range(mbs)
        ]
        assert len(set(seen)) == k * dp_size * mbs, "ranks see disjoint sequences within an epoch"
        epochs.append(seen)
    assert epochs[0] != epochs[1], "each epoch has its own order"
    other_seed = small_module.train_iterator(seed=4, micro_batch_size=mbs, dp_rank=0, dp_size=dp_size)
    first = small_module.train_iterator(seed=3, micro_batch_size=mbs, dp_rank=0, dp_size=dp_size)
    assert not _same(next(other_seed), next(first))


def test_load_state_dict_rejects_another_stream(packed_module):
    iterator = packed_module.train_iterator(seed=1, micro_batch_size=1)
    state = iterator.state_dict()
    with pytest.raises(ValueError, match="seed"):
        packed_module.train_iterator(seed=2, micro_batch_size=1).load_state_dict(state)
    with pytest.raises(ValueError, match="position"):
        iterator.load_state_dict({**state, "position": iterator.micro_batches_per_epoch + 1})
    with pytest.raises(ValueError, match="cannot fill"):
        packed_module.train_iterator(seed=1, micro_batch_size=len(packed_module.train) + 1)


def test_heldout_batches(packed_module):
    n = len(packed_module.heldout)
    batches = list(packed_module.heldout_batches(micro_batch_size=2, max_sequences=5, dp_rank=1, dp_size=2))
    assert [b["tokens"].shape[0] for b in batches] == [2]  # 5 -> 4 sequences, rank 1 gets 1 and 3
    assert torch.equal(batches[0]["tokens"][1], torch.from_numpy(packed_module.heldout.input_ids[3].astype(np.int64)))
    assert sum(b["tokens"].shape[0] for b in packed_module.heldout_batches(micro_batch_size=4)) == n


def test_unpacked_mode(data_files, smollm2_tokenizer):  # noqa: F811
    module = SFTDataModule(data_files["heldout"], smollm2_tokenizer, SEQ_LENGTH, pack=False)
    assert len(module.train) == 20
    batch = next(module.train_iterator(seed=0, micro_batch_size=4))
    assert batch["attention_mask"] is None
    assert all(len(offsets) == 2 for offsets in batch["cu_seqlens"])


def test_bad_parquet_names_file_row_and_field(tmp_path, smollm2_tokenizer):  # noqa: F811
    missing = _write_parquet(tmp_path / "missing.parquet", [{"prompt": "q", "text": "a"}])
    with pytest.raises(ValueError, match=r"missing\.parquet.*response"):
        read_sft_examples([missing], smollm2_tokenizer)
    null = _write_parquet(
        tmp_path / "null.parquet", [{"prompt": "q", "response": "a"}, {"prompt": None, "response": "b"}]
    )
    with pytest.raises(ValueError, match=r"null\.parquet.*row 1.*'prompt'"):
        read_sft_examples([null], smollm2_tokenizer)
    with pytest.raises(FileNotFoundError, match="nope"):
        read_sft_examples([tmp_path / "nope.parquet"], smollm2_tokenizer)


def _open_cached(train_paths, tokenizer_dir, seq_length, barrier, results):
    barrier.wait()  # every "rank" asks for the data at the same moment
    module = SFTDataModule(train_paths, tokenizer_dir, seq_length)
    data = module.train
    results.put(
        (
            module.built["train"],
            isinstance(data.input_ids, np.memmap),
            data.input_ids.sum(dtype=np.int64),
            "tokenizer" in module.__dict__,
        )
    )


def test_only_one_process_tokenizes_and_every_process_maps_the_cache(tmp_path, data_files, smollm2_tokenizer):  # noqa: F811
    import multiprocessing
    import shutil

    tokenizer_dir = tmp_path / "tokenizer"
    smollm2_tokenizer.save_pretrained(tokenizer_dir)
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    train = [shutil.copy(p, prepared) for p in data_files["train"]]
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(3), context.Queue()
    ranks = [context.Process(target=_open_cached, args=(train, tokenizer_dir, 256, barrier, results)) for _ in range(3)]
    for rank in ranks:
        rank.start()
    outcomes = [results.get(timeout=300) for _ in ranks]
    for rank in ranks:
        rank.join(timeout=60)
    assert sorted(built for built, *_ in outcomes) == [False, False, True], "exactly one process tokenized"
    assert all(mapped for _, mapped, _, _ in outcomes) and len({total for _, _, total, _ in outcomes}) == 1
    assert [loaded for built, _, _, loaded in outcomes if not built] == [False, False], "no tokenizer loaded"
    entries = lambda: [p for p in (prepared / "tokenized").iterdir() if not p.name.startswith(".")]  # noqa: E731
    (entry,) = entries()
    assert sorted(p.name for p in entry.iterdir()) == [
        "cu_offsets.npy",
        "cu_seqlens.npy",
        "input_ids.npy",
        "labels.npy",
        "meta.json",
        "position_ids.npy",
        "stats.json",
    ]

    # A requeued job maps the same arrays; another seq_length, or a re-prepared file, tokenizes again.
    again = SFTDataModule(train, tokenizer_dir, 256)
    reference = SFTDataModule(train, smollm2_tokenizer, 256, cache=False).train
    assert np.array_equal(again.train.input_ids, reference.input_ids) and not again.built["train"]
    assert [a.tolist() for a in again.train.cu_seqlens] == [a.tolist() for a in reference.cu_seqlens]
    assert again.train.stats == reference.stats
    assert SFTDataModule(train, tokenizer_dir, 128).train and len(entries()) == 2
    pq.write_table(pq.read_table(train[0]).slice(0, 10), train[0])
    rebuilt = SFTDataModule(train, tokenizer_dir, 256)
    assert rebuilt.train.stats.num_examples == 70 and rebuilt.built["train"]


def test_packed_batches_without_a_dense_mask_carry_cu_seqlens_only(packed_module, data_files, smollm2_tokenizer):  # noqa: F811
    lean = SFTDataModule(data_files["train"], smollm2_tokenizer, SEQ_LENGTH, dense_mask=False)
    dense, sparse = (
        next(packed_module.train_iterator(seed=5, micro_batch_size=2)),
        next(lean.train_iterator(seed=5, micro_batch_size=2)),
    )
    assert sparse["attention_mask"] is None and dense["attention_mask"] is not None
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(dense[key], sparse[key])
    assert all(torch.equal(a, b) for a, b in zip(dense["cu_seqlens"], sparse["cu_seqlens"]))
    heldout = lean.heldout_batches(micro_batch_size=2)
    assert all(batch["attention_mask"] is None for batch in heldout) and len(heldout) == len(list(heldout))


class _CountingSource:
    def __init__(self):
        self.taken = 0

    def __next__(self):
        self.taken += 1
        return {"index": self.taken - 1}


def test_a_step_takes_each_micro_batch_only_when_the_schedule_reaches_it():
    source, checked = _CountingSource(), []
    step = StepMicroBatches(source, 4, check=checked.append)
    chunks = [iter(step), iter(step)]  # an interleaved schedule: one iterator per model chunk
    assert len(step) == 4 and source.taken == 0, "nothing is built before the schedule asks"
    assert next(chunks[0])["index"] == 0 and next(chunks[0])["index"] == 1 and source.taken == 2
    assert next(chunks[1])["index"] == 0 and len(step._held) == 1, "batch 0 is released once both chunks had it"
    assert [b["index"] for b in chunks[1]] == [1, 2, 3] and [b["index"] for b in chunks[0]] == [2, 3]
    assert source.taken == 4 and [b["index"] for b in checked] == [0, 1, 2, 3] and not step._held
    with pytest.raises(RuntimeError, match="created after"):
        iter(step)
