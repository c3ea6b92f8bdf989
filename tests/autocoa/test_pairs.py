"""AutoCoA stage-1 pairs: the decision points of a trajectory, and packed batches that keep each pair whole with
labels exactly on the branch tokens, on hand-written and on converted real trajectories."""

from __future__ import annotations

import pytest
import torch

from afm_core.coa.prompts import user_prompt
from afm_core.coa.trajectory import Step, Trajectory
from afm_core.data.loader import collate
from afm_core.data.pairs import PairDataModule, build_pairs, pack_pairs, select_pairs, tokenize_pair, trajectory_pairs
from afm_core.data.prepare import prepare
from afm_core.train.contrastive import pair_index
from afm_core.utils.paths import shared_data_dir
from tests.test_loss_mask import smollm2_tokenizer  # noqa: F401  (session fixture)


def _trajectory(task: str, steps: list[tuple[str, str]], tid: str = "t:1") -> Trajectory:
    question = "Who wrote Hamlet?"
    return Trajectory(tid, task, question, user_prompt(task, question), [Step(t, c) for t, c in steps], "Shakespeare")


def test_each_call_and_the_answer_are_decision_points():
    t = _trajectory(
        "mhqa",
        [
            ("think", "I should search."),
            ("wiki_search", "Hamlet author"),
            ("observation", "Hamlet is a tragedy by William Shakespeare."),
            ("think", "Found it."),
            ("answer", "William Shakespeare"),
        ],
    )
    pairs, skipped = trajectory_pairs(t, "q1")
    assert not skipped and [p.kind for p in pairs] == ["act", "answer"]
    act, answer = pairs
    assert act.id == "t:1@1" and act.context == "<think>\nI should search.\n</think>\n"
    assert act.chosen == "<wiki_search>\nHamlet author\n</wiki_search>"
    assert act.rejected == answer.chosen == "<answer>\nWilliam Shakespeare\n</answer>"
    assert answer.context.endswith(
        "<observation>\nHamlet is a tragedy by William Shakespeare.\n</observation>\n\n<think>\nFound it.\n</think>\n"
    )
    assert answer.rejected == act.chosen  # one more (redundant) call
    # the branches continue the context exactly as the trajectory's own text does
    full = act.context + act.chosen
    assert full.startswith("<think>") and answer.context + answer.chosen == (
        full + "\n<observation>\nHamlet is a tragedy by William Shakespeare.\n</observation>\n\n"
        "<think>\nFound it.\n</think>\n<answer>\nWilliam Shakespeare\n</answer>"
    )


def test_trajectories_without_calls():
    cot = _trajectory("mhqa", [("think", "I know it."), ("answer", "Shakespeare")])
    pairs, _ = trajectory_pairs(cot, "q")
    assert [(p.kind, p.rejected) for p in pairs] == [("answer", "<wiki_search>\nWho wrote Hamlet?\n</wiki_search>")]
    math = _trajectory("math", [("think", "easy"), ("answer", "4")])
    assert trajectory_pairs(math, "q") == ([], {"no_action_to_reject": 1})
    two_calls = _trajectory(
        "web", [("web_search", "a"), ("crawl_page", "b"), ("observation", "x"), ("answer", "y")]
    )  # a second call of the same action is no decision point
    assert [p.id for p in trajectory_pairs(two_calls, "q")[0]] == ["t:1@0", "t:1@3"]
    pairs, report = build_pairs([("t:1", cot), ("t:1#up1", cot)])
    assert len(pairs) == 1 and report["trajectories"] == 1


def test_select_pairs_keeps_what_fits_then_samples_in_the_kinds_proportions():
    assert sorted(select_pairs([5, 50, 7, 9], ["act"] * 4, 10, None, 0)) == [0, 2, 3]
    picked = select_pairs([1] * 100, ["act"] * 100, 10, 30, seed=3)
    assert len(set(picked)) == 30 and picked == select_pairs([1] * 100, ["act"] * 100, 10, 30, seed=3)
    # 70 act pairs (all short) and 30 answer pairs (half too long): the sample keeps 7:3 while answers last
    lengths, kinds = [1] * 70 + [1] * 15 + [99] * 15, ["act"] * 70 + ["answer"] * 30
    picked = select_pairs(lengths, kinds, 10, 20, seed=0)
    assert len(picked) == 20 and sum(kinds[i] == "answer" for i in picked) == 6
    picked = select_pairs(lengths, kinds, 10, 80, seed=0)  # answers run short: acts fill the rest
    assert len(picked) == 80 and sum(kinds[i] == "answer" for i in picked) == 15


def test_packed_pairs_train_exactly_the_branch_tokens(smollm2_tokenizer):  # noqa: F811
    t = _trajectory(
        "mhqa",
        [("think", "search"), ("wiki_search", "Hamlet"), ("observation", "by Shakespeare"), ("answer", "Shakespeare")],
    )
    pairs, _ = trajectory_pairs(t, "q")
    tokenized = [tokenize_pair(smollm2_tokenizer, p) for p in pairs]
    seq = max(len(x) for x in tokenized) + 10
    packed, dropped = pack_pairs([*tokenized, tokenized[0]], seq)
    assert dropped == 0 and len(packed) == 3  # no two pairs fit in one row here
    packed, dropped = pack_pairs(tokenized, len(tokenized[0]) + len(tokenized[1]))
    assert dropped == 0 and len(packed) == 1
    batch = collate(packed, [0], pack=True, dense_mask=False)
    index = pair_index(batch["cu_seqlens"], packed.seq_length)
    for j, pair in enumerate(tokenized):
        for branch, ids in ((0, pair.chosen_ids), (1, pair.rejected_ids)):
            doc = (index[0] == 2 * j + branch) & (batch["loss_mask"][0] > 0)
            assert batch["labels"][0][doc].tolist() == ids  # shifted labels: exactly the branch, nothing else
    assert int(batch["loss_mask"].sum()) == sum(len(p.chosen_ids) + len(p.rejected_ids) for p in tokenized)
    assert smollm2_tokenizer.decode(tokenized[0].chosen_ids) == pairs[0].chosen
    too_long, dropped = pack_pairs(tokenized, len(tokenized[0]) - 1)
    assert dropped == 2 and len(too_long) == 0
    # in order: the first row holds the first pair, then the next pairs as they fit
    ordered, _ = pack_pairs(
        [tokenized[1], tokenized[0], tokenized[1]], len(tokenized[0]) + len(tokenized[1]), keep_order=True
    )
    first_docs = ordered.cu_seqlens[0].tolist()
    assert len(ordered) == 2 and first_docs[2] == 2 * len(tokenized[1].context_ids) + len(
        tokenized[1].chosen_ids
    ) + len(tokenized[1].rejected_ids)


@pytest.mark.skipif(not shared_data_dir().is_dir(), reason="real data folder absent (set AFM_SHARED_DATA)")
def test_pairs_from_converted_real_traces(tmp_path, smollm2_tokenizer):  # noqa: F811
    cfg = {"name": "coa_traces", "shared_dir": None, "out_dir": str(tmp_path / "coa"),
           "sources": {"gsm8k": 30, "fireact": 30, "r1searcher": 30, "tora": None},
           "heldout_fraction": 0.2, "split_seed": 0, "mask_observations": True, "pack": True}  # fmt: skip
    out = prepare(cfg)
    data = PairDataModule(
        [out / "train.parquet"], smollm2_tokenizer, 1024, heldout_paths=[out / "heldout.parquet"], max_pairs=60
    )
    train, heldout = data.train, data.heldout
    report = data.reports["train"]
    assert report["pairs"] == train.stats.num_examples == 60 and report["pairs_found"] > 60
    assert set(report["by_kind"]) == {"act", "answer"}
    assert 0 < data.reports["heldout"]["pairs"] <= data.reports["heldout"]["pairs_found"]
    for packed in (train, heldout):
        for row in range(len(packed)):
            assert len(packed.cu_seqlens[row]) % 2 == 1  # an even number of documents: whole pairs
    batch = next(data.train_iterator(seed=0, micro_batch_size=2))
    index = pair_index(batch["cu_seqlens"], 1024)
    trained = index[batch["loss_mask"] > 0]
    assert bool((trained >= 0).all()) and set(torch.unique(trained % 2).tolist()) == {0, 1}
    # the cache: a second module maps the same arrays
    again = PairDataModule(
        [out / "train.parquet"], smollm2_tokenizer, 1024, heldout_paths=[out / "heldout.parquet"], max_pairs=60
    )
    assert bool((again.train.input_ids == train.input_ids).all()) and again.built["train"] is False
