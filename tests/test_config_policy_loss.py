"""The policy-loss bounds (``algorithm.*``, :class:`afm_core.config.policy_loss.PolicyLossConfig`): every bound
refuses the values past it and takes the values at or inside it, on each side, whether the settings come as the
loss's config, as the ``algorithm`` group, or merged onto the schema as ``check_config`` merges a composed config;
a refusal names the key. The bounds and their sources (DAPO eq. 10, dual-clip PPO, TIS, IcePop, verl) are stated
beside each check in ``afm_core/config/policy_loss.py``."""

from __future__ import annotations

from dataclasses import fields

import pytest

from afm_core.config.checks import ConfigError, instantiate
from afm_core.config.policy_loss import KL_LOSS_TYPES, LOSS_AGG_MODES, PolicyLossConfig
from afm_core.config.rl import AlgorithmConfig

NORM = "seq-mean-token-sum-norm"


def _windows(name: str) -> tuple[list, list]:
    """IcePop's token window and the geometric-mean window: both bounds or none, 0 <= low <= 1 <= high, low < high."""
    low, high = f"{name}_low", f"{name}_high"
    refused = [
        ({low: 0.5}, high),  # one bound alone
        ({high: 2.0}, low),
        ({low: -0.1, high: 2.0}, low),  # low below 0
        ({low: 1.01, high: 2.0}, low),  # low above 1: the window misses ratio 1
        ({low: 0.5, high: 0.99}, high),  # high below 1
        ({low: 1.0, high: 1.0}, high),  # high not above low: the single point 1
    ]
    accepted = [{low: 0.0, high: 1.0}, {low: 1.0, high: 1.001}, {low: 0.5, high: 5.0}, {low: None, high: None}]
    return refused, accepted


REFUSED: list[tuple[dict, str]] = [
    # eps_low in (0, 1), open on both sides (DAPO eq. 10: the lower clip 1 - eps_low in (0, 1))
    ({"clip_ratio_low": 0.0}, "clip_ratio_low"),
    ({"clip_ratio_low": -0.1}, "clip_ratio_low"),
    ({"clip_ratio_low": 1.0}, "clip_ratio_low"),
    ({"clip_ratio_low": 1.5}, "clip_ratio_low"),
    # eps_high > 0, no upper limit
    ({"clip_ratio_high": 0.0}, "clip_ratio_high"),
    ({"clip_ratio_high": -0.5}, "clip_ratio_high"),
    # dual clip c > 1 (verl compute_policy_loss_vanilla), or null
    ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
    ({"clip_ratio_c": 0.5}, "clip_ratio_c"),
    # TIS cap C >= 1, or null
    ({"tis_cap": 0.999}, "tis_cap"),
    ({"tis_cap": 0.0}, "tis_cap"),
    ({"tis_cap": -2.0}, "tis_cap"),
    *_windows("icepop")[0],
    *_windows("geo_mask")[0],
    # verl's four aggregations only
    ({"loss_agg_mode": "seq-mean"}, "loss_agg_mode"),
    ({"loss_agg_mode": "sample-mean"}, "loss_agg_mode"),
    # loss_scale_factor: > 0 with seq-mean-token-sum-norm, null with every other mode
    ({"loss_agg_mode": NORM}, "loss_scale_factor"),
    ({"loss_agg_mode": NORM, "loss_scale_factor": 0.0}, "loss_scale_factor"),
    ({"loss_agg_mode": NORM, "loss_scale_factor": -1.0}, "loss_scale_factor"),
    ({"loss_scale_factor": 4096.0}, "loss_scale_factor"),
    # verl's estimators without full (NotImplementedError in verl) and the straight-through "+" variants
    ({"kl_loss_type": "full"}, "kl_loss_type"),
    ({"kl_loss_type": "k3+"}, "kl_loss_type"),
    # coefficients >= 0
    ({"kl_coef": -0.001}, "kl_coef"),
    ({"entropy_coeff": -0.001}, "entropy_coeff"),
]

ACCEPTED: list[dict] = [
    {"clip_ratio_low": 1e-6},
    {"clip_ratio_low": 0.999},
    {"clip_ratio_high": 1e-6},
    {"clip_ratio_high": 0.28},
    {"clip_ratio_high": 5.0},
    {"clip_ratio_c": None},
    {"clip_ratio_c": 1.001},
    {"clip_ratio_c": 10.0},
    {"tis_cap": None},
    {"tis_cap": 1.0},
    {"tis_cap": 2.0},
    *_windows("icepop")[1],
    *_windows("geo_mask")[1],
    *({"loss_agg_mode": m, "loss_scale_factor": 4096.0 if m == NORM else None} for m in LOSS_AGG_MODES),
    {"loss_agg_mode": NORM, "loss_scale_factor": 1e-3},
    *({"kl_loss_type": kind} for kind in KL_LOSS_TYPES),
    {"kl_coef": 0.0},
    {"kl_coef": 0.5},
    {"entropy_coeff": 0.0},
    {"entropy_coeff": 0.01},
]

BUILDS = {
    "the loss's config": lambda settings: PolicyLossConfig(**settings),
    "the algorithm group": lambda settings: AlgorithmConfig(**settings),
    "the merged schema": lambda settings: instantiate(AlgorithmConfig, settings, "algorithm."),
}


@pytest.mark.parametrize("build", BUILDS.values(), ids=BUILDS.keys())
@pytest.mark.parametrize(("settings", "key"), REFUSED, ids=[f"{k}:{s}" for s, k in REFUSED])
def test_a_value_past_a_policy_loss_bound_is_refused_naming_its_key(build, settings, key):
    with pytest.raises(ConfigError) as refused:
        build(settings)
    assert str(refused.value).startswith(f"algorithm.{key}="), str(refused.value)


@pytest.mark.parametrize("build", BUILDS.values(), ids=BUILDS.keys())
@pytest.mark.parametrize("settings", ACCEPTED, ids=[str(s) for s in ACCEPTED])
def test_a_value_at_or_inside_every_policy_loss_bound_is_accepted(build, settings):
    config = build(settings)
    assert all(getattr(config, name) == value for name, value in settings.items())


def test_every_policy_loss_setting_has_a_refused_value():
    """A new field of the loss's settings comes with its bound and a case above."""
    assert {key for _, key in REFUSED} == {f.name for f in fields(PolicyLossConfig)}


def test_the_algorithm_group_is_the_one_declaration_of_the_loss_settings():
    """``algorithm`` extends the loss's settings: the same fields and defaults, no second copy to drift."""
    assert issubclass(AlgorithmConfig, PolicyLossConfig)
    loss_fields = {f.name: f.default for f in fields(PolicyLossConfig)}
    assert loss_fields.items() <= {f.name: f.default for f in fields(AlgorithmConfig)}.items()
