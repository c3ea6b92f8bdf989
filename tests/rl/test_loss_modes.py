"""verl's loss aggregations and KL estimators, IcePop's token mask and the geometric-mean sequence mask, each
against values computed by hand on small batches; the ``algorithm`` group as the loss's settings (their bounds:
``tests/test_config_policy_loss.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from afm_core.config.rl import AlgorithmConfig, has_off_policy_correction
from afm_core.rl.losses import PolicyLossConfig, kl_penalty, policy_loss, reduce_stats


def _run(advantages, mask, *, divisor, config, log_k=None, ref=None):
    """policy_loss at ratio 1 (logp = logp_old = 0), so a token's loss is -A * w; log_k = logp_old - logp_rollout."""
    adv = torch.tensor(advantages, dtype=torch.float32)
    logp = torch.zeros_like(adv, requires_grad=True)
    rollout = None if log_k is None else -torch.tensor(log_k, dtype=torch.float32)
    loss, stats = policy_loss(
        logp, torch.zeros_like(adv), adv, torch.tensor(mask, dtype=torch.float32), global_num_tokens=divisor,
        config=config, rollout_log_prob=rollout, ref_log_prob=None if ref is None else torch.tensor(ref),
    )  # fmt: skip
    loss.backward()
    return loss.item(), stats, logp.grad


# -- KL estimators (verl kl_penalty_forward) ------------------------------------------------------------------
def test_each_kl_loss_type_is_verls_estimate_with_its_clamps():
    logp = torch.tensor([-1.0, -1.0, -1.0, 0.0])
    ref = torch.tensor([-2.0, -1.0, -0.5, -30.0])
    d = [1.0, 0.0, -0.5, 30.0]  # logp - ref
    expected = {
        "k1": d,
        "kl": d,
        "abs": [abs(x) for x in d],
        "k2": [0.5 * x * x for x in d],
        "mse": [0.5 * x * x for x in d],
        # k3 on ref - logp clamped to +-20, the estimate to +-10: e^-1 + 1 - 1, 0, e^0.5 - 1.5, min(e^-20 + 19, 10)
        "low_var_kl": [math.exp(-1), 0.0, math.exp(0.5) - 1.5, 10.0],
        "k3": [math.exp(-1), 0.0, math.exp(0.5) - 1.5, 10.0],
    }
    for kind, values in expected.items():
        torch.testing.assert_close(kl_penalty(logp, ref, kind), torch.tensor(values), msg=kind)
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_penalty(logp, ref, "full")


def test_the_kl_loss_uses_the_configured_estimator():
    # A = 0: the loss is kl_coef * k2 / tokens; its gradient kl_coef * (logp - ref) / tokens
    config = PolicyLossConfig(kl_coef=0.5, kl_loss_type="k2")
    loss, stats, grad = _run([[0.0, 0.0]], [[1, 1]], divisor=2, config=config, ref=[[-1.0, 0.5]])
    assert loss == pytest.approx(0.5 * (0.5 * 1 + 0.5 * 0.25) / 2)
    assert float(stats["kl_sum"]) == pytest.approx(0.5 + 0.125)
    torch.testing.assert_close(grad, torch.tensor([[0.5 * 1 / 2, 0.5 * -0.5 / 2]]))


# -- IcePop ----------------------------------------------------------------------------------------------------
def test_icepop_zeroes_tokens_outside_its_window_and_weights_the_others_by_the_ratio():
    k = [0.4, 0.6, 2.0, 4.5, 6.0]  # pi_old / pi_rollout
    log_k = [[math.log(x) for x in k]]
    config = PolicyLossConfig(icepop_low=0.5, icepop_high=5.0)
    loss, stats, grad = _run([[1.0] * 5], [[1] * 5], divisor=5, config=config, log_k=log_k)
    weights = [0.0, 0.6, 2.0, 4.5, 0.0]  # M(k) = k inside [0.5, 5], else 0
    # the masked tokens stay in the token-mean's denominator (5), as in IcePop's objective and NeMo-RL
    assert loss == pytest.approx(-sum(weights) / 5, rel=1e-6)
    torch.testing.assert_close(grad, -torch.tensor([weights]) / 5)
    assert reduce_stats([stats])["icepop_masked"] == pytest.approx(2 / 5)
    # with tis_cap too, the kept tokens' weight is truncated at the cap
    config = PolicyLossConfig(icepop_low=0.5, icepop_high=5.0, tis_cap=2.0)
    loss, stats, _ = _run([[1.0] * 5], [[1] * 5], divisor=5, config=config, log_k=log_k)
    assert loss == pytest.approx(-(0.6 + 2.0 + 2.0) / 5, rel=1e-6)
    assert float(stats["tis_clipped_sum"]) == 2  # 4.5 and 6 exceed the cap (6 is masked as well)


# -- the geometric-mean sequence mask --------------------------------------------------------------------------
def test_the_geometric_mask_drops_whole_sequences_by_the_mean_log_ratio_of_their_trained_tokens():
    nan = float("nan")
    config = PolicyLossConfig(geo_mask_low=0.99, geo_mask_high=1.01)
    # micro batch 1: geo e^0.001 (kept), e^0.02 (masked); micro batch 2: an empty row, and a row whose
    # observation token (mask 0) has a garbage rollout logprob: its trained tokens' mean is 0 (kept)
    first = _run([[1.0] * 4, [1.0] * 4], [[1, 1, 1, 0], [1, 1, 1, 1]], divisor=10, config=config,
                 log_k=[[0.001, 0.001, 0.001, 0.0], [0.02] * 4])  # fmt: skip
    second = _run([[1.0] * 4, [1.0] * 4], [[0, 0, 0, 0], [1, 0, 1, 1]], divisor=10, config=config,
                  log_k=[[0.0] * 4, [0.0, nan, 0.0, 0.0]])  # fmt: skip
    assert first[0] + second[0] == pytest.approx(-6 / 10)  # 3 + 3 kept tokens of 10, all in the denominator
    torch.testing.assert_close(first[2], -torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]]) / 10.0)
    torch.testing.assert_close(second[2], -torch.tensor([[0, 0, 0, 0], [1, 0, 1, 1]]) / 10.0)
    stats = reduce_stats([first[1], second[1]])
    assert stats["seqs"] == 3  # the empty row is no sequence to count
    assert stats["geo_masked_seq"] == pytest.approx(1 / 3)
    assert stats["geo_masked"] == pytest.approx(4 / 10)
    assert stats["geo_ratio_seq"] == pytest.approx((math.exp(0.001) + math.exp(0.02) + 1) / 3, rel=1e-6)
    assert stats["tokens"] == 10


def test_a_correction_without_the_engines_logprobs_is_refused():
    with pytest.raises(ValueError, match="geo_mask_low is set"):
        _run([[1.0]], [[1]], divisor=1, config=PolicyLossConfig(geo_mask_low=0.9, geo_mask_high=1.1))


# -- loss_agg_mode (verl agg_loss) --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "divisor", "loss", "row1_grad"),
    [
        ("token-mean", 4, -8 / 4, -1 / 4),  # sum / tokens
        ("seq-mean-token-mean", 3, (-2 / 1 - 6 / 3) / 3, -1 / (3 * 3)),  # mean over 3 rows of each row's mean
        ("seq-mean-token-sum", 3, -8 / 3, -1 / 3),  # mean over 3 rows of each row's sum
        ("seq-mean-token-sum-norm", 1, -8 / 4, -1 / 4),  # sum / loss_scale_factor (4)
    ],
)
def test_each_loss_agg_mode_equals_its_hand_computed_aggregate(mode, divisor, loss, row1_grad):
    # rows of 1, 3 and 0 trained tokens; token loss -A (ratio 1)
    advantages = [[2.0, 0.0, 0.0], [1.0, 1.0, 4.0], [5.0, 5.0, 5.0]]
    mask = [[1, 0, 0], [1, 1, 1], [0, 0, 0]]
    config = PolicyLossConfig(loss_agg_mode=mode, loss_scale_factor=4.0 if mode.endswith("norm") else None)
    value, _, grad = _run(advantages, mask, divisor=divisor, config=config)
    assert value == pytest.approx(loss)
    torch.testing.assert_close(grad[1], torch.tensor([1.0, 1.0, 4.0]) * row1_grad)
    assert float(grad[2].abs().sum()) == 0


# -- the algorithm group is the loss's config ------------------------------------------------------------------
def test_the_loss_reads_the_checked_algorithm_group_itself():
    """One declaration: the ``algorithm`` group is the loss's config (no copy built from same-named fields), and the
    loss module names the one declaration (``afm_core.config.policy_loss``)."""
    from afm_core.config import policy_loss as declared
    from afm_core.rl import losses

    algorithm = AlgorithmConfig(icepop_low=0.5, icepop_high=5.0)
    assert isinstance(algorithm, PolicyLossConfig) and losses.PolicyLossConfig is declared.PolicyLossConfig
    advantages, mask = [[1.0, -2.0, 0.5]], [[1, 1, 0]]
    log_k = [[0.1, 2.0, 0.0]]  # the second token is outside IcePop's window (e^2 > 5)
    as_group = _run(advantages, mask, divisor=2, config=algorithm, log_k=log_k)
    as_loss = _run(advantages, mask, divisor=2, config=PolicyLossConfig(icepop_low=0.5, icepop_high=5.0), log_k=log_k)
    assert as_group[0] == as_loss[0] and torch.equal(as_group[2], as_loss[2])


def test_an_off_policy_correction_is_tis_icepop_or_the_geometric_mask():
    assert not has_off_policy_correction(AlgorithmConfig())
    assert has_off_policy_correction(AlgorithmConfig(tis_cap=2.0))
    assert has_off_policy_correction(AlgorithmConfig(icepop_low=0.5, icepop_high=5.0))
    assert has_off_policy_correction(AlgorithmConfig(geo_mask_low=0.999, geo_mask_high=1.002))


# -- through the policy trainer ---------------------------------------------------------------------------
@pytest.mark.slow
def test_the_policy_update_reports_the_corrections_per_step_under_actor_keys(tmp_path):
    """policy_update (what the RL job runs each step) on the test config's model with every correction set: the engine's
    logprobs are 0 (p = 1) against the trainer's ~log(1/V), so k ~ 0: every token and sequence is masked."""
    import json

    from afm_core.utils.ports import free_port
    from tests.ranks import start_ranks
    from tests.rl.test_driver import _config, _update_rank

    cfg = _config(
        tmp_path / "run",
        "rollout.n=2",
        "algorithm.mini_batch_size=2",
        "algorithm.train_batch_size=2",
        "trainer.micro_batch_size=2",
        "algorithm.tis_cap=2.0",
        "algorithm.icepop_low=0.5",
        "algorithm.icepop_high=5.0",
        "algorithm.geo_mask_low=0.999",
        "algorithm.geo_mask_high=1.002",
    )
    out = tmp_path / "update.json"
    start_ranks(_update_rank, args=(1, free_port(), cfg, str(out)), nprocs=1)
    stats = json.loads(out.read_text())["stats"]
    assert stats["actor/tokens"] == 4 * 7 and stats["actor/seqs"] == 4
    assert stats["actor/icepop_masked"] == 1 and stats["actor/geo_masked"] == 1 and stats["actor/geo_masked_seq"] == 1
    assert stats["actor/tis_clipped"] == 0 and 0 < stats["actor/geo_ratio_seq"] < 0.5
    assert stats["actor/pg_loss"] == 0  # nothing left to train on
