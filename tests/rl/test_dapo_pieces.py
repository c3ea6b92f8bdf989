"""The DAPO pieces against hand-computed values: clip-higher loss, token-mean over sequences of different lengths,
the group filter and refill, the overlong penalty, GRPO and GAE advantages, k3 KL, truncated IS."""

from __future__ import annotations

import math

import pytest
import torch

from afm_core.rl.advantages import gae_advantages, grpo_advantages
from afm_core.rl.batch import response_values, rollout_micro_batch
from afm_core.rl.dynamic_sampling import DynamicSampler, DynamicSamplingExhausted
from afm_core.rl.losses import (
    PolicyLossConfig,
    logprob_gap_stats,
    low_var_kl,
    policy_loss,
    reduce_stats,
    value_loss,
)
from afm_core.rl.reward_shaping import overlong_penalty


def _loss(ratios, advantages, *, config=None, mask=None, global_num_tokens=None, **extra):
    ratios = torch.tensor([ratios], dtype=torch.float32)
    old = torch.zeros_like(ratios)
    logp = torch.log(ratios).requires_grad_(True)
    mask = torch.ones_like(ratios) if mask is None else torch.tensor([mask], dtype=torch.float32)
    n = int(mask.sum()) if global_num_tokens is None else global_num_tokens
    loss, stats = policy_loss(
        logp, old, torch.tensor([advantages]), mask, global_num_tokens=n, config=config or PolicyLossConfig(), **extra
    )
    loss.backward()
    return loss.item(), stats, logp.grad[0]


# -- clip-higher ------------------------------------------------------------------------------------------
def test_clip_higher_loss_equals_hand_computed_values():
    # token: ratio, A  ->  max(-A r, -A clip(r, 0.8, 1.28))
    #   1.5, +1 -> max(-1.5, -1.28) = -1.28  (clipped high)
    #   1.1, +1 -> -1.1
    #   0.5, -1 -> max(0.5, 0.8)    =  0.8   (clipped low)
    #   1.2, -1 -> 1.2
    loss, stats, grad = _loss([1.5, 1.1, 0.5, 1.2], [1.0, 1.0, -1.0, -1.0])
    assert loss == pytest.approx((-1.28 - 1.1 + 0.8 + 1.2) / 4, abs=1e-6)
    assert float(stats["clip_frac_sum"]) == 2 and float(stats["tokens"]) == 4
    # d loss / d logp = -A r / N where unclipped, 0 where the clip is active
    torch.testing.assert_close(grad, torch.tensor([0.0, -1.1 / 4, 0.0, 1.2 / 4]))


def test_clip_higher_differs_from_symmetric_clip_only_above_one_plus_eps_low():
    higher, _, _ = _loss([1.25, 1.5], [1.0, 1.0])
    symmetric, _, _ = _loss([1.25, 1.5], [1.0, 1.0], config=PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.2))
    assert higher == pytest.approx((-1.25 - 1.28) / 2, abs=1e-6)
    assert symmetric == pytest.approx((-1.2 - 1.2) / 2, abs=1e-6)


def test_dual_clip_bounds_the_loss_of_negative_advantages_at_c():
    # ratio 5, A = -1: max(5, 0.8) = 5 -> min(5, c * 1) = 3
    loss, stats, grad = _loss([5.0, 2.0], [-1.0, -1.0], config=PolicyLossConfig(clip_ratio_c=3.0))
    assert loss == pytest.approx((3.0 + 2.0) / 2, abs=1e-6)
    assert float(stats["clip_frac_dual_sum"]) == 1
    assert grad[0].item() == 0.0 and grad[1].item() == pytest.approx(2.0 / 2)


# -- token-mean -------------------------------------------------------------------------------------------
def test_token_mean_over_sequences_of_different_lengths_weights_every_token_equally():
    # ratio 1 -> per-token loss -A. Sequence 1: 1 valid token, A=2; sequence 2: 3 valid tokens, A=1.
    mask = [[1, 0, 0], [1, 1, 1]]
    adv = torch.tensor([[2.0, 0, 0], [1.0, 1.0, 1.0]])
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(2, 3), adv, torch.tensor(mask), global_num_tokens=4)
    assert loss.item() == pytest.approx((-2 - 3) / 4)  # token-mean, not the sequence mean (-2 - 1) / 2


# -- KL, TIS, value loss ------------------------------------------------------------------------------------
def test_low_var_kl_is_the_k3_estimate():
    kl = low_var_kl(torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -1.0]))
    torch.testing.assert_close(kl, torch.tensor([math.exp(-1) + 1 - 1, 0.0]))


def test_kl_is_added_only_when_its_coefficient_is_set():
    ref = torch.tensor([[-1.0]])
    base, _, _ = _loss([1.0], [1.0], ref_log_prob=ref)
    with_kl, stats, _ = _loss([1.0], [1.0], ref_log_prob=ref, config=PolicyLossConfig(kl_coef=0.5))
    k3 = math.exp(-1) + 1 - 1  # logp = 0, ref = -1
    assert base == pytest.approx(-1.0) and with_kl == pytest.approx(-1.0 + 0.5 * k3, abs=1e-6)
    assert float(stats["kl_sum"]) == pytest.approx(k3, abs=1e-6)


def test_truncated_importance_sampling_caps_the_trainer_over_rollout_ratio_and_reports_the_gap():
    # old (trainer) logprob 0; rollout logprobs -1 and -0.1 -> weights min(e^1, 2) = 2 and e^0.1
    rollout = torch.tensor([[-1.0, -0.1]])
    loss, stats, _ = _loss([1.0, 1.0], [1.0, 1.0], rollout_log_prob=rollout, config=PolicyLossConfig(tis_cap=2.0))
    assert loss == pytest.approx((-2.0 - math.exp(0.1)) / 2, abs=1e-6)
    assert float(stats["tis_clipped_sum"]) == 1
    assert float(stats["logprob_gap_sum"]) == pytest.approx(1.1, abs=1e-6)
    assert float(stats["logprob_gap_max"]) == pytest.approx(1.0)


def test_logprob_gap_statistics_reduce_to_the_mean_and_max_over_valid_tokens():
    trainer = torch.tensor([[-1.0, -2.0, 5.0]])
    engine = torch.tensor([[-1.5, -1.0, float("nan")]])  # the last position is masked
    stats = reduce_stats([logprob_gap_stats(trainer, engine, torch.tensor([[1, 1, 0]]))])
    assert stats["tokens"] == 2 and stats["logprob_gap"] == pytest.approx(0.75)
    assert stats["logprob_gap_max"] == pytest.approx(1.0)
    assert stats["prob_ratio_error"] == pytest.approx((math.expm1(0.5) + math.expm1(1.0)) / 2)


def test_clipped_value_loss_equals_hand_computed_values():
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0]])
    loss, stats = value_loss(values, old, returns, torch.ones(1, 2), global_num_tokens=2, clip_range_value=0.5)
    # token 0: max((1-0)^2, (0.5-0)^2) = 1; token 1: max(1, 1) = 1  -> 0.5 * (1 + 1) / 2
    assert loss.item() == pytest.approx(0.5)
    assert float(stats["vf_clip_frac_sum"]) == 0


# -- dynamic sampling -----------------------------------------------------------------------------------------
def test_group_filter_drops_equal_reward_groups_and_refills_until_the_batch_is_full():
    sampler = DynamicSampler(train_batch_size=3, max_num_gen_batches=3)
    kept = sampler.add(
        ["a", "a", "b", "b", "c", "c", "d"], [1, 0, 1, 1, 0, 0, 0.5], ["a0", "a1", "b0", "b1", "c0", "c1", "d0"]
    )
    assert kept == 2 and not sampler.is_full  # a (spread) and d (a single sample) kept; b, c dropped
    kept = sampler.add(["e", "e", "f", "f", "f"], [0, 1, 1, 0, 1], ["e0", "e1", "f0", "f1", "f2"])
    assert kept == 2 and sampler.is_full
    samples, stats = sampler.take()
    assert samples == ["a0", "a1", "d0", "e0", "e1"]  # first 3 kept groups; f is surplus
    assert stats.as_dict() == {
        "gen_batches": 2,
        "groups_generated": 6,
        "samples_generated": 12,
        "groups_kept": 4,
        "groups_trained": 3,
        "groups_surplus": 1,
        "groups_all_equal": 2,  # b and c: no GRPO signal
        "kept_group_ratio": 4 / 6,
        "all_equal_group_ratio": 2 / 6,
    }
    assert not sampler.is_full and sampler.gen_batches == 0  # ready for the next step


def test_group_filter_gives_up_after_max_num_gen_batches():
    sampler = DynamicSampler(train_batch_size=2, max_num_gen_batches=2)
    sampler.add(["a", "a"], [1, 1], [0, 1])
    with pytest.raises(DynamicSamplingExhausted, match="2 generation batches"):
        sampler.add(["b", "b"], [0, 0], [2, 3])
    partial = DynamicSampler(train_batch_size=2, max_num_gen_batches=2, allow_partial=True)
    partial.add(["a", "a"], [1, 0], [0, 1])
    partial.add(["b", "b"], [0, 0], [2, 3])
    assert partial.ready and partial.take()[0] == [0, 1]


def test_group_filter_rejects_a_group_id_seen_earlier_in_the_step():
    sampler = DynamicSampler(train_batch_size=4)
    sampler.add(["a", "a"], [1, 0], [0, 1])
    with pytest.raises(ValueError, match="already came"):
        sampler.add(["a", "a"], [1, 0], [2, 3])


def test_group_filter_state_round_trips_mid_step():
    sampler = DynamicSampler(train_batch_size=2)
    sampler.add(["a", "a", "b", "b"], [1, 0, 1, 1], [0, 1, 2, 3])
    resumed = DynamicSampler(train_batch_size=2)
    resumed.load_state_dict(sampler.state_dict())
    for s in (sampler, resumed):
        s.add(["c", "c"], [0, 1], [4, 5])
    assert sampler.take() == resumed.take()


def test_without_filtering_the_first_generation_batch_is_the_train_batch():
    sampler = DynamicSampler(train_batch_size=2, filter_groups=False)
    sampler.add(["a", "a", "b", "b"], [1, 1, 0, 0], [0, 1, 2, 3])
    assert sampler.take()[0] == [0, 1, 2, 3]


# -- overlong penalty -------------------------------------------------------------------------------------
def test_overlong_penalty_is_zero_then_linear_in_the_buffer_then_minus_one():
    lengths = torch.tensor([10, 16, 17, 18, 20, 21])
    penalty = overlong_penalty(lengths, max_length=20, buffer_length=4)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4, factor=0.5), penalty * 0.5)
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 20, 0)


# -- advantages -------------------------------------------------------------------------------------------
def test_grpo_advantages_equal_hand_computed_group_normalised_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 1.0, 1.0, 1.0])
    groups = ["a", "a", "a", "a", "b", "c", "c", "c"]
    std_a = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [
        0.5 / (std_a + 1e-6),
        -0.5 / (std_a + 1e-6),
        -0.5 / (std_a + 1e-6),
        0.5 / (std_a + 1e-6),
        2.0 / (1 + 1e-6),
        0.0,
        0.0,
        0.0,
    ]  # b: a single sample (mean 0, std 1); c: all equal
    torch.testing.assert_close(grpo_advantages(rewards, groups), torch.tensor(expected))
    dr_grpo = grpo_advantages(rewards, groups, norm_by_std=False)
    torch.testing.assert_close(dr_grpo, torch.tensor([0.5, -0.5, -0.5, 0.5, 2.0, 0.0, 0.0, 0.0]))


def test_gae_skips_observation_tokens_and_equals_hand_computed_values():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 9.9, 0.8]])  # position 2 is a tool observation: its value is ignored
    mask = torch.tensor([[1, 1, 0, 1]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.0, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0, 1.0]]))
    # gamma = lam = 0.5: d3 = 0.2, A3 = 0.2; d1 = 0.5*0.8 - 0.6 = -0.2, A1 = -0.2 + 0.25*0.2 = -0.15;
    # d0 = 0.5*0.6 - 0.5 = -0.2, A0 = -0.2 + 0.25*(-0.15) = -0.2375
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.5, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[-0.2375, -0.15, 0.0, 0.2]]))
    whitened, _ = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.5)
    kept = torch.tensor([-0.2375, -0.15, 0.2], dtype=torch.float64)
    expected = ((kept - kept.mean()) / torch.sqrt(kept.var() + 1e-8)).float()
    torch.testing.assert_close(whitened[0, [0, 1, 3]], expected)


# -- batch layout ----------------------------------------------------------------------------------------------
def test_rollout_micro_batch_aligns_response_values_with_their_targets():
    batch = rollout_micro_batch(
        [[7, 8], [9]],
        [[1, 2, 3], [4, 5]],
        [[1, 0, 1], [1, 1]],
        per_token={"lp": [[-1.0, -2.0, -3.0], [-4.0, -5.0]]},
        pad_token_id=0,
    )
    assert batch["tokens"].tolist() == [[7, 8, 1, 2, 3], [9, 4, 5, 0, 0]]
    assert batch["labels"].tolist() == [[8, 1, 2, 3, 0], [4, 5, 0, 0, 0]]
    assert batch["response_mask"].tolist() == [[0, 1, 0, 1, 0], [1, 1, 0, 0, 0]]
    assert batch["lp"].tolist() == [[0, -1, -2, -3, 0], [-4, -5, 0, 0, 0]]
    assert [v.tolist() for v in response_values(batch["lp"], batch)] == [[-1, -2, -3], [-4, -5]]
    with pytest.raises(ValueError, match="seq_length"):
        rollout_micro_batch([[1]], [[2, 3]], [[1, 1]], seq_length=2)


def test_minibatch_shares_give_the_last_mini_batch_the_rest_of_a_partial_train_batch():
    from afm_core.rl.batch import minibatch_shares

    assert minibatch_shares(40, 32, 1, 0) == [list(range(32)), list(range(32, 40))]
    assert minibatch_shares(12, 8, 2, 1) == [[1, 3, 5, 7], [9, 11]]
    with pytest.raises(ValueError, match="DP ranks"):
        minibatch_shares(10, 8, 4, 0)


def test_the_rl_jobs_sampler_drops_a_group_of_equal_accuracy_whose_overlong_shaped_rewards_differ():
    """The sampler the driver builds from ``conf/rl.yaml`` (``filter_groups_metric: acc``, verl's default) and feeds
    graded samples: it filtered on the shaped reward, so with the overlong penalty a group all right (or all
    wrong) passed on length alone; ``score`` keeps that behaviour on request."""
    from dataclasses import replace

    from afm_core.config.rl import AlgorithmConfig, RewardConfig
    from afm_core.rl.dynamic_sampling import dynamic_sampler
    from afm_core.rl.grading import Sample
    from afm_core.rl.reward_shaping import shaped_reward
    from tests.rl.helpers import rl_config

    cfg = rl_config("unused", recipe="afm_code_rl_32b")  # DAPO with the overlong penalty (buffer 4,096 tokens)
    reward_cfg, max_len = RewardConfig(**cfg["reward"]), 16384
    algorithm = AlgorithmConfig(**cfg["algorithm"])

    def sample(uid: str, score: float, length: int) -> Sample:
        reward = shaped_reward(score, 1.0, length, reward_cfg, max_len)
        return Sample(uid, "t", [1], [2] * length, [1] * length, [0.0] * length, score, 1.0, reward, "eos")

    # group a: both right, one inside the overlong buffer (rewards 1.0 and 0.5); group b: one right, one wrong
    batch = [sample("a", 1.0, 1000), sample("a", 1.0, 14336), sample("b", 1.0, 1000), sample("b", 0.0, 1000)]
    assert batch[0].reward == 1.0 and batch[1].reward == 0.5
    kept = {}
    for metric in ("acc", "score"):
        sampler = dynamic_sampler(
            replace(algorithm, train_batch_size=2, mini_batch_size=2, filter_groups_metric=metric)
        )
        assert sampler.filter_groups and sampler.metric == metric
        kept[metric] = sampler.add_samples(batch)
    assert kept == {"acc": 1, "score": 2}  # only group b has something to learn
    assert rl_config("unused")["algorithm"]["filter_groups_metric"] == "acc"
    with pytest.raises(ValueError, match="filter_groups_metric='reward'"):
        dynamic_sampler(replace(algorithm, filter_groups_metric="reward"))


def test_the_rl_phases_report_tokens_per_s_tflops_and_mfu_of_the_real_tokens():
    from types import SimpleNamespace

    from afm_core.engine.flops import matmul_params
    from afm_core.models.presets import load_preset
    from afm_core.rl.policy_trainer import phase_throughput

    arch = load_preset("tiny-llama").arch
    lengths = [100, 300]  # prompt + response tokens of this rank's two trajectories
    layout = SimpleNamespace(tp=2, pp=1, on_gpu=False)
    out = phase_throughput(arch, lengths, layout, epochs=2, logprob_passes=1, logprob_s=0.5, train_s=4.0)
    attention = 12.0 * arch.num_layers * arch.num_attention_heads * arch.head_dim * (100 * 101 + 300 * 301) // 2
    one_pass = (6.0 * matmul_params(arch) * 400 + attention) / 2  # forward + backward, per TP rank
    assert out["train_tokens_per_s"] == 2 * 400 / 4.0 and out["logprob_tokens_per_s"] == 400 / 0.5
    assert out["train_tflops"] == pytest.approx(2 * one_pass / 4.0 / 1e12)
    assert out["logprob_tflops"] == pytest.approx(one_pass / 3 / 0.5 / 1e12)
    assert out["train_mfu"] is None  # no peak on a CPU
    with_peak = phase_throughput(arch, lengths, layout, 2, 1, 0.5, 4.0, peak_tflops=1e-3)
    assert with_peak["train_mfu"] == pytest.approx(out["train_tflops"] / 1e-3)
    assert phase_throughput(None, lengths, layout, 2, 1, 0.5, 4.0)["train_tflops"] is None
