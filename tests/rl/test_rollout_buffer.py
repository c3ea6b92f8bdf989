"""The rollout buffer's pieces: groups carried whole, stale trajectories dropped or their tokens masked by lag,
the sampler fed only as many complete groups as fill it, and the buffer through a checkpoint's pickling."""

from __future__ import annotations

from afm_core.rl.dynamic_sampling import DynamicSampler
from afm_core.rl.grading import Sample
from afm_core.rl.rollout_buffer import BufferStats, Group, RolloutBuffer, lag_histogram, mask_stale_tokens
from afm_core.rl.train_batch import _enough


def _sample(uid: str, score: float, versions: list[int], mask: list[int] | None = None) -> Sample:
    mask = mask if mask is not None else [1] * len(versions)
    return Sample(uid=uid, task_id="t", prompt_ids=[1], response_ids=list(range(len(versions))), response_mask=mask,
                  logprobs=[0.0] * len(versions), score=score, format=1.0, reward=score, finish_reason="eos",
                  versions=versions)  # fmt: skip


def test_tokens_past_the_staleness_bound_leave_the_loss_and_are_counted_by_lag():
    # 3 sampled tokens of version 0, an observation token, 2 of version 2; trained at version 2, max lag 1
    s = _sample("a", 1.0, [0, 0, 0, 0, 2, 2], mask=[1, 1, 1, 0, 1, 1])
    assert lag_histogram([s], 2) == {"0": 2, "2": 3}
    (masked,) = mask_stale_tokens([s], version=2, max_staleness=1)
    assert masked.response_mask == [0, 0, 0, 0, 1, 1] and s.response_mask == [1, 1, 1, 0, 1, 1]  # input kept
    assert lag_histogram([masked], 2) == {"0": 2}
    (same,) = mask_stale_tokens([s], version=2, max_staleness=2)
    assert same is s  # nothing past the bound: the sample itself


def test_a_stale_trajectory_is_dropped_from_its_group_and_starts_again_with_drop():
    group = Group("0:0", 3, finished={0: _sample("0:0", 1.0, [0, 0])}, born=0)
    group.paused[1] = _sample("0:0", 0.0, [1, 1, 1])  # anything with versions and a mask: a paused trajectory
    buffer, stats = RolloutBuffer(), BufferStats()
    buffer.put([group])
    (taken,) = buffer.take(version=2, max_staleness=1, stale="drop", stats=stats)
    assert list(taken.finished) == [] and list(taken.paused) == [1]  # lag 2 dropped, lag 1 kept
    assert (stats.dropped, stats.dropped_tokens) == (1, 2) and len(buffer) == 0
    buffer.put([Group("0:1", 4, finished={0: _sample("0:1", 1.0, [0])})])
    (kept,) = buffer.take(version=5, max_staleness=1, stale="mask", stats=stats)
    assert list(kept.finished) == [0]  # mask: the trainer masks the tokens, the buffer keeps them


def test_the_sampler_gets_the_complete_groups_that_fill_it_and_the_rest_wait():
    sampler = DynamicSampler(2, filter_groups=True)

    def group(uid: str, scores: list[float]) -> Group:
        return Group(uid, 0, finished={i: _sample(uid, s, [0]) for i, s in enumerate(scores)})

    # all equal (filtered), spread, all equal, spread, spread: the sampler is full after the 4th
    complete = [group("a", [1, 1]), group("b", [0, 1]), group("c", [0, 0]), group("d", [1, 0]), group("e", [0, 1])]
    fed = _enough(complete, sampler)
    assert [g.uid for g in fed] == ["a", "b", "c", "d"]
    sampler.add_samples([s for g in fed for s in g.samples()])
    assert sampler.ready and sampler.keeps(complete[4].samples()) and not sampler.keeps(complete[0].samples())


def test_the_buffer_reads_back_from_a_weights_only_checkpoint_with_its_groups_in_order(tmp_path):
    import torch

    from afm_core.rollout.types import PausedTrajectory, ToolCallRecord

    paused = PausedTrajectory(task_id="t", sample=0, base_seed=7, prompt_ids=[1], response_ids=[5, 6, 7],
                              response_mask=[1, 0, 1], logprobs=[-0.5, 0.0, -1.0], versions=[0, 0, 0], turn_ids=[8],
                              turn_logprobs=[-0.1], turn_versions=[0], text_parts=["a", "b"],
                              tool_calls=[ToolCallRecord(0, "code", "1+1", "2", 0.1)], turns=1, seconds=2.0,
                              rolled_back_tokens=1)  # fmt: skip
    buffer = RolloutBuffer()
    buffer.put([Group("0:0", 1, finished={1: _sample("0:0", 1.0, [0, 0])}, paused={0: paused}, born=0,
                      rolled_back={0: 1}), Group("0:1", 2, born=1)])  # fmt: skip
    torch.save({"buffer": buffer.state_dict()}, tmp_path / "common.pt")
    restored = RolloutBuffer()
    restored.load_state_dict(torch.load(tmp_path / "common.pt", weights_only=True)["buffer"])  # as megatron reads it
    first, second = restored.groups
    assert (first.uid, first.index, first.born, first.rolled_back) == ("0:0", 1, 0, {0: 1})
    assert first.paused == {0: paused} and first.finished == buffer.groups[0].finished
    assert first.paused[0].num_generated_tokens == 3 and (second.uid, second.finished, second.paused) == ("0:1", {}, {})
    empty = RolloutBuffer()
    empty.load_state_dict(None)  # a checkpoint from before the buffer
    assert len(empty) == 0
