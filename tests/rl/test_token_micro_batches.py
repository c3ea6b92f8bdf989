"""Micro batches by tokens (``trainer.max_tokens_per_micro_batch``): the partitioner
(:func:`afm_core.rl.batch.token_micro_batches`), the plan the policy and the critic train on, the submit checks, and
one real policy update on tiny-llama over gloo whose loss and gradients equal the counted path's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from afm_core.config.checks import ConfigError
from afm_core.config.rl import rl_config as as_rl_config
from afm_core.rl.batch import (
    MAX_TOKENS_KEY,
    karmarkar_karp,
    micro_batch_plan,
    minibatch_shares,
    token_micro_batches,
)
from afm_core.rl.policy_trainer import check_batch_split
from afm_core.utils.paths import repo_root
from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks
from tests.rl.helpers import rl_config

BUDGET = 64  # data.max_prompt_len + rollout.max_response_len of the real update below


def _tokens(lengths, micro):
    return sum(lengths[i] for i in micro)


def _check_plan(lengths, plan, max_tokens):
    """Every sample once, every micro batch within the budget, the same number of micro batches on every rank."""
    assert sorted(i for rank in plan for micro in rank for i in micro) == list(range(len(lengths)))
    assert all(_tokens(lengths, micro) <= max_tokens for rank in plan for micro in rank)
    assert len({len(rank) for rank in plan}) == 1


def coa_lengths(n: int, seed: int) -> list[int]:
    """``n`` trajectory lengths drawn from the histogram of real CoA trace lengths (64-token bins)."""
    hist = json.loads((repo_root() / "benchmarks" / "coa_doc_lengths.json").read_text())
    width, rng = hist["bin_tokens"], random.Random(seed)
    bins = rng.choices(range(len(hist["counts"])), weights=hist["counts"], k=n)
    return [rng.randrange(b * width, (b + 1) * width) for b in bins]


# -- the partitioner ------------------------------------------------------------------------------------------
def test_karmarkar_karp_splits_into_k_parts_of_nearly_equal_sums():
    lengths = [8, 7, 6, 5, 4]
    parts = karmarkar_karp(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(5))
    # the differencing method's: 8-7 -> 1, 6-5 -> 1, 4-1 -> 3, 3-1 -> 2 (a heuristic: 15 + 15 exists)
    assert sorted(_tokens(lengths, p) for p in parts) == [14, 16]
    parts = karmarkar_karp([1] * 6 + [6], 3)
    assert sorted(_tokens([1] * 6 + [6], p) for p in parts) == [3, 3, 6]
    with pytest.raises(ValueError):
        karmarkar_karp(lengths, 6)


def test_one_trajectory_8x_longer_than_the_rest_keeps_every_micro_batch_within_the_budget():
    lengths = [100] * 15 + [800]
    for dp in (1, 2):
        plan = token_micro_batches(lengths, 800, dp)
        _check_plan(lengths, plan, 800)
        (alone,) = [micro for rank in plan for micro in rank if 15 in micro]
        assert alone == [15]  # the long one fills its micro batch
    # the fewest micro batches that fit: 2300 tokens need 3 of 800 on one rank (4 with 2 ranks, 2 each)
    assert [len(rank) for rank in token_micro_batches(lengths, 800, 1)] == [3]
    assert [len(rank) for rank in token_micro_batches(lengths, 800, 2)] == [2, 2]


@pytest.mark.parametrize("n", [16, 64, 256])
def test_two_dp_ranks_get_balanced_tokens_on_the_coa_length_distribution(n):
    for seed in range(20):
        lengths = coa_lengths(n, seed)
        for budget in (2560, 8192):
            plan = token_micro_batches(lengths, budget, 2)
            _check_plan(lengths, plan, budget)
            per_rank = [sum(_tokens(lengths, micro) for micro in rank) for rank in plan]
            assert max(per_rank) / min(per_rank) <= 1.1, (n, seed, budget, per_rank)


def test_more_micro_batches_than_samples_leave_a_filler_on_the_short_rank():
    """3 samples of 0.6 budget over 2 ranks: 3 micro batches of one sample; the rank with one gets a filler."""
    lengths = [600, 610, 620]
    plan = token_micro_batches(lengths, 1000, 2)
    _check_plan(lengths, plan, 1000)
    assert sorted(map(len, plan)) == [2, 2] and [] in plan[0] + plan[1]


def test_a_trajectory_longer_than_the_budget_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=MAX_TOKENS_KEY.replace(".", r"\.")):
        token_micro_batches([10, 65], BUDGET, 1)
    with pytest.raises(ValueError, match="2 DP ranks"):
        token_micro_batches([10], BUDGET, 2)


def test_the_counted_plan_is_todays_every_dp_th_sample_in_micro_batches_of_micro_batch_size():
    lengths = [5, 3, 9, 1, 7, 2, 8, 4, 6, 10, 11, 12]
    for rank in (0, 1):
        plan = micro_batch_plan(lengths, 8, 2, rank, 2, None, by_length=False)
        shares = minibatch_shares(12, 8, 2, rank)
        assert plan == [[share[i : i + 2] for i in range(0, len(share), 2)] for share in shares]
        by_length = micro_batch_plan(lengths, 8, 2, rank, 2, None, by_length=True)
        assert [[i for m in mini for i in m] for mini in by_length] == [
            sorted(s, key=lambda i: lengths[i]) for s in shares
        ]


def test_the_token_plan_splits_each_mini_batch_over_the_ranks():
    lengths = coa_lengths(40, 0)
    plans = [micro_batch_plan(lengths, 16, 2, rank, 2, 4096, by_length=True) for rank in (0, 1)]
    assert [len(p) for p in plans] == [3, 3]  # mini-batches of 16, 16 and the rest, 8
    for k, start in enumerate((0, 16, 32)):
        both = [i for p in plans for micro in p[k] for i in micro]
        assert sorted(both) == list(range(start, min(start + 16, 40)))
        assert len(plans[0][k]) == len(plans[1][k])


# -- the checks -----------------------------------------------------------------------------------------------
def test_the_batch_split_needs_only_a_sample_per_dp_rank_with_a_token_budget():
    with pytest.raises(ValueError, match=r"trainer\.micro_batch_size"):
        check_batch_split(6, 12, 2, 2)
    check_batch_split(6, 12, 2, 2, max_tokens=4096)  # 6 samples need not be a multiple of dp x micro_batch_size
    check_batch_split(6, 9, 2, 2, max_tokens=4096)  # a partial train batch's rest of 3 still has one per rank
    with pytest.raises(ValueError, match=r"trainer\.max_tokens_per_micro_batch"):
        check_batch_split(1, 2, 2, 2, max_tokens=4096)
    with pytest.raises(ValueError, match=r"trainer\.max_tokens_per_micro_batch"):
        check_batch_split(4, 5, 2, 2, max_tokens=4096)  # the rest, 1 sample, cannot reach 2 ranks


def test_the_submit_check_names_the_field_when_the_budget_cannot_hold_the_longest_trajectory(tmp_path):
    base = ["data.files=[p.parquet]", "data.max_prompt_len=16", "rollout.context_schedule=[]"]
    base += ["rollout.max_response_len=48"]
    as_rl_config(rl_config(tmp_path, *base, f"trainer.max_tokens_per_micro_batch={BUDGET}"))
    with pytest.raises(ConfigError, match=r"trainer\.max_tokens_per_micro_batch=63: .* 16 \+ 48 = 64 tokens"):
        as_rl_config(rl_config(tmp_path, *base, "trainer.max_tokens_per_micro_batch=63"))
    with pytest.raises(ConfigError, match=r"trainer\.max_tokens_per_micro_batch=0"):
        as_rl_config(rl_config(tmp_path, *base, "trainer.max_tokens_per_micro_batch=0"))
    # the token path needs no mini-batch x n multiple of dp x micro_batch_size: 1 x 2 samples, micro batches of 4
    as_rl_config(
        rl_config(tmp_path, *base, "trainer.micro_batch_size=4", f"trainer.max_tokens_per_micro_batch={BUDGET}")
    )
    with pytest.raises(ConfigError, match=r"algorithm\.mini_batch_size"):
        as_rl_config(rl_config(tmp_path, *base, "trainer.micro_batch_size=4"))


# -- one real policy update -----------------------------------------------------------------------------------
def _samples() -> list:
    """16 trajectories in groups of two: 5 to 14 tokens, and one 8x the shortest ones' 6 (prompt 4 + response 44);
    observation tokens (mask 0) mid-response."""
    from afm_core.rl.grading import Sample

    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(16):
        n = 44 if i == 5 else 1 + (7 * i) % 11
        mask = [1] * n
        if n > 3:
            mask[n // 2] = 0
        samples.append(
            Sample(
                uid=f"g{i // 2}",
                task_id="t",
                prompt_ids=torch.randint(0, 1000, (4,), generator=g).tolist(),
                response_ids=torch.randint(0, 1000, (n,), generator=g).tolist(),
                response_mask=mask,
                logprobs=(-5.0 - torch.rand(n, generator=g)).tolist(),  # vLLM's: ratios around e^1, some clip
                score=0.0,
                format=1.0,
                reward=float(i % 2 == 0),
                finish_reason="eos",
            )
        )
    return samples


def _update_rank(rank: int, world: int, port: int, cfg: dict, out: str) -> None:
    set_rank_env(rank, world, port)
    from omegaconf import OmegaConf

    import afm_core.rl.batch as batch_module
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rl.critic import Critic
    from afm_core.rl.policy_model import build_policy_model
    from afm_core.rl.policy_trainer import build_policy_trainer, policy_update

    layout = init_distributed(OmegaConf.create(cfg["parallel"]), seed=1, num_threads=1)
    try:
        hf_dir = ensure_hf_checkpoint(cfg["model"])
        samples = _samples()
        advantages = torch.tensor([1.0, -1.0] * 8)
        real = batch_module.token_micro_batches
        results = {}
        for name, budget in (("counted", None), ("tokens", BUDGET), ("filler", BUDGET)):
            if name == "filler":  # one more micro batch of nothing to train on every rank, as a short rank gets

                def with_filler(lengths, max_tokens, dp):
                    return [[*micro, []] for micro in real(lengths, max_tokens, dp)]

                batch_module.token_micro_batches = with_filler
            trainer_cfg = {**cfg["trainer"], "max_tokens_per_micro_batch": budget}
            policy = as_rl_config({**cfg, "trainer": trainer_cfg}).policy
            chunks, _ = build_policy_model(hf_dir, layout)
            trainer = build_policy_trainer(policy, layout, chunks, Path(cfg["run_dir"]) / name, 10)
            micro_tokens: list[list[int]] = []
            step = trainer.step

            def recording_step(micro, *args, _step=step, _tokens=micro_tokens, **kwargs):
                _tokens.append([int((b["prompt_lengths"] + b["response_lengths"]).sum()) for b in micro])
                return _step(micro, *args, **kwargs)

            trainer.step = recording_step
            stats = policy_update(trainer, samples, advantages, policy, BUDGET, 0)
            batch_module.token_micro_batches = real
            grads = [p.main_grad.detach().clone() for chunk in trainer.model for p in chunk.parameters()]
            params = [p.detach().clone() for chunk in trainer.model for p in chunk.parameters()]
            if rank == 0:
                torch.save({"grads": grads, "params": params}, Path(out) / f"{name}.pt")
            results[name] = {"stats": stats, "micro_tokens": micro_tokens}
        for name, budget in (("critic_counted", None), ("critic_tokens", BUDGET)):  # PPO's value model alike
            policy = as_rl_config({**cfg, "trainer": {**cfg["trainer"], "max_tokens_per_micro_batch": budget}}).policy
            torch.manual_seed(0)  # the same value head's initial weights
            critic = Critic(policy, layout, hf_dir, Path(cfg["run_dir"]) / name, 10, params_dtype=torch.float32)
            values = critic.values(samples, BUDGET, 0)
            returns = [[float(i % 2)] * len(s.response_ids) for i, s in enumerate(samples)]
            stats = critic.update(samples, values, returns, BUDGET, 0)
            grads = [p.main_grad.detach().clone() for chunk in critic.model for p in chunk.parameters()]
            if rank == 0:
                torch.save({"grads": grads, "values": values}, Path(out) / f"{name}.pt")
            results[name] = {"stats": stats}
        (Path(out) / f"results_{rank}.json").write_text(json.dumps(results))
    finally:
        destroy_distributed()


def _close(got: list[torch.Tensor], want: list[torch.Tensor], elementwise: bool = True) -> None:
    for a, b in zip(got, want, strict=True):
        if elementwise:
            assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
        assert float((a - b).norm()) <= 1e-5 * float(b.norm())


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_policy_update_by_tokens_has_the_counted_paths_loss_and_gradients(tmp_path, world):
    """Two mini-batches of 8 samples (two optimizer steps), fp32, on one and on two DP ranks: counted micro batches
    of 2 samples (every dp-th sample per rank) against micro batches of <= 64 tokens balanced over the ranks (and
    against those plus a filler micro batch on every rank). The per-micro-batch sums change order and the ranks
    hold other samples, nothing else: the token-mean loss, its statistics, the gradients after the second step
    (which starts from the first step's update) agree to fp32 rounding: each tensor's largest difference within
    1e-5 of its largest entry and the norm of its difference within 1e-5 of its norm (measured on one rank: 5e-6
    and 2e-6), the weights' norms alike (AdamW's m / sqrt(v) magnifies the rounding of near-zero gradients), the
    statistics to 1e-5 relative. The PPO critic's old values and update likewise."""
    cfg = rl_config(
        tmp_path / "run",
        "data.files=[p.parquet]",
        "data.max_prompt_len=16",
        "rollout.context_schedule=[]",
        "rollout.max_response_len=48",
        "rollout.n=2",
        "algorithm.mini_batch_size=4",
        "algorithm.train_batch_size=8",
        "algorithm.clip_ratio_c=3.0",
        "trainer.micro_batch_size=2",
        "trainer.precision=fp32",
        "optim.lr=1e-3",
        "optim.min_lr=1e-3",
    )
    start_ranks(_update_rank, args=(world, free_port(), cfg, str(tmp_path)), nprocs=world)
    per_rank = [json.loads((tmp_path / f"results_{r}.json").read_text()) for r in range(world)]
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in _samples()]

    for results in per_rank:
        counted, tokens, filler = (results[k] for k in ("counted", "tokens", "filler"))
        assert [len(m) for m in counted["micro_tokens"]] == [4 // world] * 2  # 8 samples / dp / 2 per micro batch
        assert [m[:-1] for m in filler["micro_tokens"]] == tokens["micro_tokens"]  # and a filler, last
        assert all(max(mini) <= BUDGET for mini in tokens["micro_tokens"])  # within the budget
    for k in range(2):  # every sample of the mini-batch once over the ranks, the same micro batch count on each
        minis = [results["tokens"]["micro_tokens"][k] for results in per_rank]
        assert sum(map(sum, minis)) == sum(lengths[8 * k : 8 * k + 8]) and len(set(map(len, minis))) == 1
        assert sum(map(len, minis)) < 4  # fewer than the counted path's 4 over all ranks
    results, want = per_rank[0], torch.load(tmp_path / "counted.pt")
    for name in ("tokens", "filler"):
        got = torch.load(tmp_path / f"{name}.pt")
        _close(got["grads"], want["grads"])  # the second step's
        _close(got["params"], want["params"], elementwise=False)
        for key, value in results["counted"]["stats"].items():
            if key.startswith("actor/") or key in ("grad_norm", "entropy", "logprob_gap_vllm_trainer"):
                assert results[name]["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        assert results[name]["stats"]["actor/tokens"] == results["counted"]["stats"]["actor/tokens"]
        assert results[name]["stats"]["optimizer_steps"] == 2
    got, want = torch.load(tmp_path / "critic_tokens.pt"), torch.load(tmp_path / "critic_counted.pt")
    _close([torch.tensor(v) for v in got["values"]], [torch.tensor(v) for v in want["values"]])
    _close(got["grads"], want["grads"])
    for key in ("critic/vf_loss", "critic/values", "critic/grad_norm"):
        assert results["critic_tokens"]["stats"][key] == pytest.approx(results["critic_counted"]["stats"][key], 1e-5)


# -- jobs.plan ------------------------------------------------------------------------------------------------
def test_the_plan_sizes_a_micro_batchs_activations_by_the_token_budget():
    """afm_mhqa_rl (PP=1): micro batches of 2 trajectories of 2048 + 8192 tokens hold what a budget of 20480
    tokens holds; half that budget, half the activations and logits."""
    from afm_core.launch.plan import layout_of, make_plan, plan_config

    def plan(*overrides):
        job = plan_config("rl", ["recipe=afm_mhqa_rl", *overrides])
        return layout_of(job), make_plan(job)["stages"]

    counted_layout, counted = plan()
    same_layout, same = plan("trainer.max_tokens_per_micro_batch=20480")
    _, half = plan("trainer.max_tokens_per_micro_batch=10240")
    assert counted_layout.seq_length == same_layout.seq_length == 10240  # vLLM's max_model_len is unchanged
    assert same_layout.max_tokens_per_micro_batch == 20480
    for key in ("activations_bytes", "logits_bytes"):
        assert [r[key] for r in same] == [r[key] for r in counted]
        assert [2 * r[key] for r in half] == pytest.approx([r[key] for r in counted], rel=1e-6)
