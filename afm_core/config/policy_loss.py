"""The policy-loss settings, declared and checked once: :class:`PolicyLossConfig`.

They are ``algorithm.*`` keys of ``conf/rl.yaml``: :class:`afm_core.config.rl.AlgorithmConfig` extends this class
(the same fields, the same checks, at submit), and :func:`afm_core.rl.losses.policy_loss` reads the job's
``AlgorithmConfig`` as its ``PolicyLossConfig``, never a copy. It lives here, in ``config`` (layer 5), because the
loss (``rl``, layer 7) may import ``config`` and ``config`` may not import ``rl`` (docs/architecture.md, "Package
order").

Each bound is stated, with its source, beside its check in :meth:`PolicyLossConfig.__post_init__`: DAPO (Yu et al.
2025, arXiv 2503.14476, eq. 10: the ratio ``r`` clipped to ``[1 - eps_low, 1 + eps_high]``, section 3.1
"Clip-Higher"), dual-clip PPO (Ye et al. 2020, arXiv 1912.09729), truncated importance sampling (Yao et al. 2025),
IcePop (arXiv 2510.18855) and verl (``verl/trainer/config/actor/actor.yaml``, ``verl/workers/config/actor.py``
``ActorConfig``, ``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_vanilla`` / ``agg_loss`` /
``kl_penalty_forward``, ``verl/trainer/ppo/rollout_corr_helper.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from afm_core.config.checks import require

#: algorithm.loss_agg_mode: verl ``core_algos.py::agg_loss`` (and ``ActorConfig.__post_init__``'s valid modes)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
#: algorithm.kl_loss_type: verl ``core_algos.py::kl_penalty_forward`` names, aliases included (k1 = kl, k2 = mse,
#: k3 = low_var_kl); verl's straight-through ``+`` variants and ``full`` (NotImplementedError there) are not offered
KL_LOSS_TYPES = ("low_var_kl", "k3", "k1", "kl", "k2", "mse", "abs")


@dataclass
class PolicyLossConfig:
    """The settings of :func:`afm_core.rl.losses.policy_loss` (field names follow verl's actor config; each is the
    same-named ``algorithm.*`` key).

    Attributes:
        clip_ratio_low / clip_ratio_high: ``eps_low`` / ``eps_high``: the ratio is clipped to
            ``[1 - low, 1 + high]`` (DAPO clip-higher: 0.2 / 0.28).
        clip_ratio_c: dual-clip bound for negative advantages (verl default 3.0, DAPO recipe and AFM web agent
            10.0); None disables it.
        tis_cap: truncated importance sampling cap C on ``pi_old(trainer) / pi_rollout(vLLM)``; None disables it.
        icepop_low / icepop_high: IcePop's token window ``[a, b]`` on that ratio (IcePop's ``[0.5, 5]``); None: off.
        geo_mask_low / geo_mask_high: the window on a sequence's geometric-mean ratio (NeMo-RL ``seq-mask-tis``
            ``[0.999, 1.002]``, SkyRL ``[0.99, 1.01]``); None: off.
        loss_agg_mode: ``token-mean`` (DAPO) or a verl ``seq-mean-*`` mode (:mod:`afm_core.rl.losses`).
        loss_scale_factor: the constant of ``seq-mean-token-sum-norm`` (verl ``loss_scale_factor``).
        entropy_coeff: entropy bonus coefficient (0 in DAPO).
        kl_coef: coefficient of the KL loss against the reference policy; 0 = no KL (DAPO).
        kl_loss_type: its per-token estimator, :func:`afm_core.rl.losses.kl_penalty` (verl ``kl_loss_type``;
            default ``low_var_kl``, k3).

    Raises:
        ConfigError: a value outside its bound, naming the key (``algorithm.tis_cap=0.5: ...``) and the bound.
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float | None = None
    tis_cap: float | None = None
    icepop_low: float | None = None
    icepop_high: float | None = None
    geo_mask_low: float | None = None
    geo_mask_high: float | None = None
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    kl_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"

    def __post_init__(self) -> None:
        a = "algorithm."
        # eps_low in (0, 1): the lower clip 1 - eps_low must lie in (0, 1). Above 0 because the ratio is positive
        # (at eps_low >= 1 the clip never binds: DAPO section 3.1 keeps eps_low small, a larger one lets
        # low-probability tokens be pushed to 0); below 1 (eps_low > 0) because at eps_low = 0 the clip sits on the
        # on-policy ratio 1 and a token with A < 0 loses its gradient as soon as its ratio drops. DAPO eq. 10, 0.2.
        require(
            0 < self.clip_ratio_low < 1,
            a + "clip_ratio_low",
            self.clip_ratio_low,
            "in (0, 1): the PPO ratio is clipped to [1 - low, 1 + high] (DAPO eq. 10)",
        )
        # eps_high > 0: the upper clip 1 + eps_high above the on-policy ratio 1 (else a token with A > 0 loses its
        # gradient as soon as its ratio rises). No upper limit: DAPO's clip-higher raises it (0.28), and neither
        # eq. 10 nor verl (actor.yaml clip_ratio_high, compute_policy_loss_vanilla) bounds it.
        require(
            self.clip_ratio_high > 0,
            a + "clip_ratio_high",
            self.clip_ratio_high,
            "> 0: the PPO ratio is clipped to [1 - low, 1 + high] (DAPO eq. 10)",
        )
        # c > 1: dual clip bounds -A * r by -A * c for A < 0 (Ye et al. 2020); verl compute_policy_loss_vanilla
        # asserts clip_ratio_c > 1.0 (actor.yaml default 3.0). None: off.
        if self.clip_ratio_c is not None:
            require(self.clip_ratio_c > 1, a + "clip_ratio_c", self.clip_ratio_c, "> 1 (dual clip), or null")
        # C >= 1: the weight min(k, C) must leave an on-policy token's k = 1 whole; a cap below 1 scales every token
        # instead of truncating the large ratios. verl's rollout_is_threshold checks only > 0
        # (rollout_corr_helper.py) and puts the token-level range at 1.5-5 (trainer/config/algorithm.py). None: off.
        if self.tis_cap is not None:
            require(self.tis_cap >= 1, a + "tis_cap", self.tis_cap, ">= 1 (the on-policy weight 1 is kept), or null")
        # windows on pi_old / pi_rollout (IcePop per token, [0.5, 5]; the geometric mean of a sequence, verl Geo-RS
        # seq_mean_k1, whose lower bound defaults to 1 / upper): both bounds or none, 0 <= low <= 1 <= high and
        # low < high, so the window holds ratio 1 (on-policy tokens are trained) and is not the single point 1.
        for name in ("icepop", "geo_mask"):
            low, high = getattr(self, name + "_low"), getattr(self, name + "_high")
            if (low is None) != (high is None):
                unset, other = ("_low", "_high") if low is None else ("_high", "_low")
                require(False, a + name + unset, None, f"set with {a}{name}{other}: a window has both bounds")
            if low is not None:
                require(0 <= low <= 1, a + name + "_low", low, "in [0, 1]: the window holds ratio 1 (on-policy)")
                require(high >= 1 and high > low, a + name + "_high", high, f">= 1 and > {a}{name}_low={low}")
        # verl ActorConfig.__post_init__ refuses any other mode
        require(
            self.loss_agg_mode in LOSS_AGG_MODES,
            a + "loss_agg_mode",
            self.loss_agg_mode,
            f"one of {', '.join(LOSS_AGG_MODES)}",
        )
        # verl actor.yaml loss_scale_factor: the constant seq-mean-token-sum-norm divides by (null there: the response
        # length); here it is given with that mode, and only then
        if self.loss_agg_mode == "seq-mean-token-sum-norm":
            require(
                self.loss_scale_factor is not None and self.loss_scale_factor > 0,
                a + "loss_scale_factor",
                self.loss_scale_factor,
                "a positive constant with loss_agg_mode=seq-mean-token-sum-norm (Dr. GRPO's: the generation "
                "budget in tokens, the stage's max_response_len, which verl's default worker divides by)",
            )
        else:
            require(
                self.loss_scale_factor is None,
                a + "loss_scale_factor",
                self.loss_scale_factor,
                "null unless loss_agg_mode=seq-mean-token-sum-norm (the only mode that reads it)",
            )
        require(
            self.kl_loss_type in KL_LOSS_TYPES,
            a + "kl_loss_type",
            self.kl_loss_type,
            f"one of {', '.join(KL_LOSS_TYPES)}",
        )
        # coefficients >= 0: an entropy bonus and a KL penalty (verl entropy_coeff 0, kl_loss_coef 0.001); a
        # negative one would penalise entropy or reward divergence from the reference
        for key in ("entropy_coeff", "kl_coef"):
            require(getattr(self, key) >= 0, a + key, getattr(self, key), ">= 0")


def has_off_policy_correction(loss: PolicyLossConfig) -> bool:
    """Whether the loss corrects for rollouts sampled off the trainer's policy (pi_rollout != pi_old): token TIS
    (``algorithm.tis_cap``), IcePop's token mask (``algorithm.icepop_low/high``) or the sequence-level
    geometric-mean mask (``algorithm.geo_mask_low/high``); see :func:`afm_core.rl.losses.policy_loss`. Rollouts
    continued across weight updates (partial rollouts) are refused without one (:class:`afm_core.config.rl.RLConfig`)."""
    return loss.tis_cap is not None or loss.icepop_low is not None or loss.geo_mask_low is not None
