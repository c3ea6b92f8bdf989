"""The DAPO / PPO policy loss and the PPO value loss, token-mean over the global batch, with additive statistics.

All per-token tensors are ``[B, T]`` and aligned with the trained targets (see :mod:`afm_core.rl.batch`);
``response_mask`` ``[B, T]`` is 1 exactly on model-generated response tokens. Positions where it is 0 (prompt,
tool observations, padding) never enter the loss: their inputs are replaced before any arithmetic, so even
non-finite garbage there (e.g. old logprobs of observation tokens) changes neither the loss nor the gradient.

Token-mean over the GLOBAL batch (DAPO arXiv 2503.14476 section 3.3, eq. 12: the sum over every valid token of
the mini-batch divided by its total valid-token count): the loss of one micro batch is

    loss = sum_{valid tokens of this micro batch} l_t / global_num_tokens

where ``global_num_tokens`` is the number of valid tokens of the whole mini-batch (all micro batches, all
data-parallel ranks). Summing the losses (and gradients) over micro batches and
DP ranks gives the token mean exactly, whatever the lengths of the sequences; a per-micro-batch mean would
weight tokens of short micro batches more (verl ``verl/workers/engine/megatron/transformer_impl.py``
all-reduces ``batch_num_tokens`` for the same reason). With Megatron's ``calculate_per_token_loss=True``
(which divides the gradients by the all-reduced token count itself), pass ``global_num_tokens=1``: see
:func:`afm_core.rl.actor.megatron_policy_loss` (the only way production calls it; checked against a hand-computed
token mean over micro batches and DP ranks in ``tests/rl/test_policy_normalization.py``).

Other aggregations (``loss_agg_mode``, verl ``verl/trainer/ppo/core_algos.py::agg_loss`` with the global-batch
arguments its engine workers pass, ``verl/workers/utils/losses.py::ppo_loss``): ``seq-mean-token-mean`` and
``seq-mean-token-sum`` divide the sum over sequences of each sequence's token mean (token sum) by the number of
sequences of the mini-batch (verl's ``global_batch_size``: every sample of it, also one without a trained token);
``seq-mean-token-sum-norm`` (Dr. GRPO) divides the token sum by ``loss_scale_factor`` and by nothing global, so its
gradient is that of ``sum / (loss_scale_factor * DP)`` as in verl, whose data-parallel gradient reduction averages
over DP ranks while this mode's ``agg_loss`` branch, unlike the others, does not multiply by ``dp_size``.

Statistics are returned as sums over this micro batch's valid tokens (``*_sum``), counts and maxima
(``*_max``), so that :func:`reduce_stats` can add them over micro batches and ranks and divide once; sums over
sequences (``*_seq_sum``) are divided by the count of sequences with a trained token (``seqs``).

The file is one thing, the RL losses and their statistics: every loss here returns its micro batch's ``*_sum`` /
``*_max`` / ``*_seq_sum`` tensors and :func:`reduce_stats` is the one reader of those names, so the convention and
its reduction stay together. The policy loss's settings are declared and bounded once, outside it:
:class:`afm_core.config.policy_loss.PolicyLossConfig` (the ``algorithm.*`` keys; the RL job passes its checked
``AlgorithmConfig``, which extends it).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from afm_core.config.policy_loss import KL_LOSS_TYPES, PolicyLossConfig

LOG_RATIO_CLAMP = 20.0  # verl clamps log(pi/pi_old) to +-20 before exp
KL_CLAMP = 10.0  # verl clamps the k3 estimate to +-10


def _check_shapes(reference: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {tuple(reference.shape)} (the response_mask's)"
            )


def low_var_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(pi || pi_ref) per token: ``exp(ref - logp) - (ref - logp) - 1``, clamped to +-10.

    Schulman, "Approximating KL Divergence" (2020), k3; the GRPO KL term (DeepSeekMath arXiv 2402.03300 eq. 4);
    verl ``core_algos.py::kl_penalty`` ``low_var_kl``. Unbiased, always >= 0, low variance.
    """
    kl = (ref_log_prob - log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(kl) - kl - 1).clamp(-KL_CLAMP, KL_CLAMP)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_loss_type: str = "low_var_kl") -> torch.Tensor:
    """A per-token estimate of KL(pi || pi_ref) from the sampled token's logprobs, as verl
    ``verl/trainer/ppo/core_algos.py::kl_penalty_forward`` defines them (Schulman, "Approximating KL Divergence",
    2020), with ``d = logp - logp_ref``:

    - ``k1`` / ``kl``: ``d`` (unbiased, can be negative);
    - ``abs``: ``|d|``;
    - ``k2`` / ``mse``: ``d^2 / 2`` (its gradient is the one of KL's, in expectation);
    - ``low_var_kl`` / ``k3``: :func:`low_var_kl` (log-ratio clamped to +-20, estimate to +-10).

    No clamp on the first three, as in verl. Args are ``[B, T]``; returns ``[B, T]``.

    Raises:
        ValueError: an unknown ``kl_loss_type``.
    """
    if kl_loss_type in ("low_var_kl", "k3"):
        return low_var_kl(log_prob, ref_log_prob)
    d = log_prob - ref_log_prob
    if kl_loss_type in ("k1", "kl"):
        return d
    if kl_loss_type == "abs":
        return d.abs()
    if kl_loss_type in ("k2", "mse"):
        return 0.5 * d.square()
    raise ValueError(f"kl_loss_type={kl_loss_type!r}: one of {', '.join(KL_LOSS_TYPES)}")


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    global_num_tokens: float | torch.Tensor,
    config: PolicyLossConfig | None = None,
    ref_log_prob: torch.Tensor | None = None,
    rollout_log_prob: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate policy loss (PPO/GRPO/DAPO) for one micro batch, aggregated, / ``global_num_tokens``.

    Per valid token, with ``r = exp(logp - logp_old)`` (log-ratio clamped to +-20), advantage ``A`` and the
    trainer/engine ratio ``k = exp(logp_old - logp_rollout)`` (log clamped to +-20)::

        l = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))          # DAPO eq. 10 (clip-higher)
        l = min(l, -A * c)            if A < 0 and clip_ratio_c is set    # dual-clip (Ye et al., arXiv 1912.09729)
        l = l * w                     if a correction is set (below)
        l = l + kl_coef * KL_t        if kl_coef > 0                      # GRPO KL (arXiv 2402.03300 eq. 3-4),
                                                                          # KL_t = kl_penalty(logp, logp_ref)
        l = l - entropy_coeff * H_t   if entropy_coeff > 0

    The off-policy weight ``w`` (detached, a constant per token) is the product of those set:

    - ``tis_cap = C``: ``min(k, C)`` (truncated IS, Yao et al. 2025; slime ``--use-tis``);
    - ``icepop_low/high = [a, b]``: IcePop's ``M(k) = k if a <= k <= b else 0`` (Ling team, "Every Step
      Evolves", arXiv 2510.18855, the IcePop objective; NeMo-RL ``nemo_rl/algorithms/loss/loss_functions.py``
      ``truncated_importance_sampling_type: icepop``): a token in the window is weighted by ``k`` (by
      ``min(k, C)`` with ``tis_cap`` too), one outside it gets no gradient;
    - ``geo_mask_low/high = [a, b]``: 0 on every token of a sequence whose geometric-mean ratio
      ``exp(mean_t log k)`` over its trained tokens is outside ``[a, b]``, else 1 (verl ``rollout_rs:
      seq_mean_k1`` Geo-RS, ``docs/algo/rollout_corr.md``; NeMo-RL ``seq-mask-tis``, whose kept sequences are
      weighted by the untruncated ``k`` besides; SkyRL ``sequence_mask_metric: geometric``).

    Both windows are closed, as in NeMo-RL and verl. A masked token stays in the denominator (the mini-batch's
    token count, or its sequence's token count and the sequence count): NeMo-RL's normalisation and IcePop's
    ``1 / sum |y_i|``; verl removes rejected tokens from ``response_mask`` instead, and so from the denominator.
    The KL and entropy terms are not weighted (as the TIS weight in slime, NeMo-RL).

    The sum over tokens is aggregated by ``config.loss_agg_mode`` (module docstring): ``token-mean`` sums the
    tokens; ``seq-mean-token-mean`` sums each sequence's token mean (a sequence = a row); ``seq-mean-token-sum``
    sums the tokens; ``seq-mean-token-sum-norm`` sums the tokens / ``loss_scale_factor``. PPO: Schulman et al.,
    arXiv 1707.06347 eq. 7; the form above is verl ``core_algos.py::compute_policy_loss_vanilla``.

    Args:
        log_prob: ``[B, T]`` logprobs of the response tokens under the current policy (with grad).
        old_log_prob: ``[B, T]`` the trainer's logprobs before this rollout step's updates (recomputed).
        advantages: ``[B, T]`` token-level advantages.
        response_mask: ``[B, T]`` 1 = trained response token; row ``i`` is one trajectory.
        global_num_tokens: the divisor: the mini-batch's valid tokens over all micro batches and DP ranks
            (``token-mean``), its sequences (``seq-mean-token-mean/sum``), the DP size (``-norm``); 1 returns the
            micro batch's aggregate (Megatron per-token-loss mode, :func:`afm_core.rl.actor.megatron_policy_loss`).
        config: the ``algorithm.*`` loss settings (:class:`~afm_core.config.policy_loss.PolicyLossConfig`, which
            the job's :class:`~afm_core.config.rl.AlgorithmConfig` is); None: the defaults.
        ref_log_prob: ``[B, T]`` reference-policy logprobs; required when ``config.kl_coef > 0``.
        rollout_log_prob: ``[B, T]`` the inference engine's logprobs of the sampled tokens (after temperature);
            required when ``config.tis_cap``, the IcePop or the geometric window is set; when given, the
            trainer/engine gap is reported.
        entropy: ``[B, T]`` per-token entropy of the current policy; reported when given; required (with
            grad) when ``config.entropy_coeff > 0``.
    Returns:
        ``(loss, stats)``: the scalar loss, and additive statistics over this micro batch's valid tokens (all
        detached fp32): ``tokens``, ``pg_loss_sum`` (the weighted per-token policy-gradient loss, whatever the
        aggregation), ``clip_frac_sum`` (tokens where clipping changed the loss, verl ``pg_clipfrac``),
        ``clip_frac_dual_sum`` (the dual clip did, verl ``pg_clipfrac_lower``), ``ppo_kl_sum``
        (``logp_old - logp``), and when applicable ``kl_sum``, ``entropy_sum``, the trainer/engine gap of
        :func:`logprob_gap_stats` (``logprob_gap_sum``, ``logprob_gap_max``, ``prob_ratio_error_sum``),
        ``tis_weight_sum``, ``tis_clipped_sum``, ``icepop_masked_sum`` (tokens outside IcePop's window), and
        for the geometric mask ``geo_masked_sum`` (tokens of masked sequences), ``seqs`` (sequences with a
        trained token), ``geo_masked_seq_sum`` (those masked) and ``geo_ratio_seq_sum`` (their geometric-mean
        ratios).
    Raises:
        ValueError: shapes differ, or an input that the config needs is missing.
    """
    config = PolicyLossConfig() if config is None else config
    _check_shapes(
        response_mask,
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        ref_log_prob=ref_log_prob,
        rollout_log_prob=rollout_log_prob,
        entropy=entropy,
    )
    if config.kl_coef > 0 and ref_log_prob is None:
        raise ValueError("kl_coef > 0 needs ref_log_prob")
    for name in ("tis_cap", "icepop_low", "geo_mask_low"):
        if getattr(config, name) is not None and rollout_log_prob is None:
            raise ValueError(f"{name} is set but rollout_log_prob is missing")
    if config.entropy_coeff > 0 and entropy is None:
        raise ValueError("entropy_coeff > 0 needs entropy")

    mask = response_mask.to(torch.bool)
    zero = torch.zeros((), dtype=torch.float32, device=log_prob.device)
    logp = log_prob.float()
    detached = logp.detach()
    # Masked positions take neutral inputs (ratio 1, advantage 0) so nothing non-finite reaches the graph.
    old = torch.where(mask, old_log_prob.float(), detached)
    adv = torch.where(mask, advantages.float(), zero)

    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    dual = torch.zeros_like(mask)
    if config.clip_ratio_c is not None:
        bound = -adv * config.clip_ratio_c
        dual = (adv < 0) & (per_token > bound)
        per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)

    stats: dict[str, torch.Tensor] = {}
    if rollout_log_prob is not None:
        rollout = torch.where(mask, rollout_log_prob.float(), old)
        gap = (old - rollout).detach()
        stats.update(_gap_sums(gap, mask))
        weight = _off_policy_weight(gap.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), mask, config, stats)
        if weight is not None:
            per_token = per_token * weight
    pg_per_token = per_token

    if config.kl_coef > 0:
        if ref_log_prob is None:
            raise ValueError("kl_coef > 0 needs ref_log_prob (the reference policy's log-probs)")
        ref = torch.where(mask, ref_log_prob.float(), detached)
        kl = kl_penalty(logp, ref, config.kl_loss_type)
        per_token = per_token + config.kl_coef * kl
        stats["kl_sum"] = _masked_sum(kl.detach(), mask)
    if entropy is not None:
        ent = torch.where(mask, entropy.float(), zero)
        stats["entropy_sum"] = _masked_sum(ent.detach(), mask)
        if config.entropy_coeff > 0:
            per_token = per_token - config.entropy_coeff * ent

    loss = _aggregate(torch.where(mask, per_token, zero), mask, config) / global_num_tokens
    stats.update(
        tokens=mask.sum().float(),
        pg_loss_sum=_masked_sum(pg_per_token.detach(), mask),
        clip_frac_sum=_masked_sum(clipped.float(), mask),
        clip_frac_dual_sum=_masked_sum(dual.float(), mask),
        ppo_kl_sum=_masked_sum(-log_ratio.detach(), mask),
    )
    return loss, stats


def _off_policy_weight(
    log_k: torch.Tensor, mask: torch.Tensor, config: PolicyLossConfig, stats: dict[str, torch.Tensor]
) -> torch.Tensor | None:
    """The detached per-token weight ``w`` of :func:`policy_loss` (None when no correction is set) from the clamped
    ``log k = log pi_old - log pi_rollout`` ``[B, T]``; adds the corrections' statistics to ``stats``."""
    weight: torch.Tensor | None = None
    if config.tis_cap is not None or config.icepop_low is not None:
        raw = torch.exp(log_k)
        weight = raw
        if config.tis_cap is not None:
            weight = raw.clamp(max=config.tis_cap)
            stats["tis_weight_sum"] = _masked_sum(weight, mask)
            stats["tis_clipped_sum"] = _masked_sum((raw > config.tis_cap).float(), mask)
        if config.icepop_low is not None:
            keep = (raw >= config.icepop_low) & (raw <= config.icepop_high)
            weight = torch.where(keep, weight, torch.zeros((), dtype=weight.dtype, device=weight.device))
            stats["icepop_masked_sum"] = _masked_sum((~keep).float(), mask)
    if config.geo_mask_low is not None:
        counts = mask.sum(dim=-1)  # [B] trained tokens per sequence
        trained = counts > 0
        geo = torch.exp(_masked_sum_rows(log_k, mask) / counts.clamp(min=1))  # [B]
        kept = ((geo >= config.geo_mask_low) & (geo <= config.geo_mask_high)) | ~trained
        seq_weight = kept.to(log_k.dtype).unsqueeze(-1)  # [B, 1]
        weight = seq_weight if weight is None else weight * seq_weight
        stats["geo_masked_sum"] = _masked_sum((~kept).unsqueeze(-1).expand_as(mask).float(), mask)
        stats["seqs"] = trained.sum().float()
        stats["geo_masked_seq_sum"] = (~kept).sum().float()
        stats["geo_ratio_seq_sum"] = torch.where(trained, geo, geo.new_zeros(())).sum().float()
    return weight


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, config: PolicyLossConfig) -> torch.Tensor:
    """The micro batch's numerator of ``config.loss_agg_mode`` from the masked per-token losses ``[B, T]``."""
    mode = config.loss_agg_mode
    if mode == "seq-mean-token-mean":
        return (per_token.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).sum()
    if mode == "seq-mean-token-sum-norm":
        assert config.loss_scale_factor is not None  # PolicyLossConfig checks it (afm_core.config.policy_loss)
        return per_token.sum() / config.loss_scale_factor
    return per_token.sum()  # token-mean and seq-mean-token-sum: the same numerator, different divisors


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    global_num_tokens: float | torch.Tensor,
    clip_range_value: float | None = 0.5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss of a PPO critic, token-summed / ``global_num_tokens`` (see the module docstring).

    ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)`` per valid token (PPO value clipping as in
    OpenAI baselines ppo2; verl ``core_algos.py::compute_value_loss``, ``cliprange_value`` 0.5 by default).

    Args:
        values: ``[B, T]`` current critic predictions (with grad).
        old_values: ``[B, T]`` predictions at rollout time (used for the GAE advantages).
        returns: ``[B, T]`` GAE returns (:func:`afm_core.rl.advantages.gae_advantages`).
        clip_range_value: ``c``; None disables clipping.
    Returns:
        ``(loss, stats)`` with ``tokens``, ``vf_loss_sum``, ``vf_clip_frac_sum``.
    """
    _check_shapes(response_mask, values=values, old_values=old_values, returns=returns)
    mask = response_mask.to(torch.bool)
    zero = torch.zeros((), dtype=torch.float32, device=values.device)
    v = values.float()
    old = torch.where(mask, old_values.float(), v.detach())
    ret = torch.where(mask, returns.float(), v.detach())
    loss_unclipped = (v - ret) ** 2
    if clip_range_value is None:
        per_token, clipped = loss_unclipped, torch.zeros_like(mask)
    else:
        v_clipped = old + (v - old).clamp(-clip_range_value, clip_range_value)
        loss_clipped = (v_clipped - ret) ** 2
        per_token, clipped = torch.maximum(loss_unclipped, loss_clipped), loss_clipped > loss_unclipped
    per_token = 0.5 * per_token
    loss = torch.where(mask, per_token, zero).sum() / global_num_tokens
    return loss, {
        "tokens": mask.sum().float(),
        "vf_loss_sum": _masked_sum(per_token.detach(), mask),
        "vf_clip_frac_sum": _masked_sum(clipped.float(), mask),
    }


def logprob_gap_stats(
    log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The trainer/inference-engine mismatch of one micro batch, as additive statistics for :func:`reduce_stats`.

    Args:
        log_prob: ``[B, T]`` the trainer's recomputed logprobs (the old logprobs of the rollout step).
        rollout_log_prob: ``[B, T]`` the engine's logprobs of the same sampled tokens (vLLM
            ``processed_logprobs``: after temperature).
        response_mask: ``[B, T]``.
    Returns:
        ``tokens``, ``logprob_gap_sum`` (sum of ``|log_prob - rollout_log_prob|``), ``logprob_gap_max`` and
        ``prob_ratio_error_sum`` (sum of ``exp(|gap|) - 1``: NeMo RL's ``token_mult_prob_error`` minus one,
        which should stay near 0; a steady climb means broken weight sync), over valid tokens.
    """
    _check_shapes(response_mask, log_prob=log_prob, rollout_log_prob=rollout_log_prob)
    mask = response_mask.to(torch.bool)
    trainer = log_prob.detach().float()
    gap = trainer - torch.where(mask, rollout_log_prob.float(), trainer)
    return {"tokens": mask.sum().float(), **_gap_sums(gap, mask)}


def _gap_sums(gap: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    zero = torch.zeros((), dtype=torch.float32, device=gap.device)
    size = gap.abs().clamp(max=LOG_RATIO_CLAMP)
    return {
        "logprob_gap_sum": _masked_sum(size, mask),
        "logprob_gap_max": torch.where(mask, size, zero).max() if mask.any() else zero.clone(),
        "prob_ratio_error_sum": _masked_sum(torch.expm1(size), mask),
    }


def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values.float(), torch.zeros((), dtype=torch.float32, device=values.device)).sum()


def _masked_sum_rows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values.float(), torch.zeros((), dtype=torch.float32, device=values.device)).sum(-1)


def _distributed(group: torch.distributed.ProcessGroup | None) -> bool:
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size(group) > 1
    )


def _all_reduce(
    values: torch.Tensor,
    group: torch.distributed.ProcessGroup | None,
    op: torch.distributed.ReduceOp = torch.distributed.ReduceOp.SUM,
) -> torch.Tensor:
    """All-reduce a small CPU tensor over ``group`` (on the GPU for NCCL); a no-op outside a multi-rank world."""
    if not _distributed(group) or not values.numel():
        return values
    device = "cuda" if torch.distributed.get_backend(group) == "nccl" else "cpu"
    on_device = values.to(device)
    torch.distributed.all_reduce(on_device, op=op, group=group)
    return on_device.cpu()


def reduce_stats(
    stats: Iterable[dict[str, torch.Tensor]], group: torch.distributed.ProcessGroup | None = None
) -> dict[str, float]:
    """Means over the valid tokens (and sequences) of all micro batches and the ranks of ``group`` (the DP group).

    Sums keys ``*_sum`` and ``tokens`` (then divides: ``clip_frac_sum`` -> ``clip_frac``), takes the maximum of
    ``*_max``; a sum over sequences, ``*_seq_sum``, is divided by the summed ``seqs`` instead
    (``geo_masked_seq_sum`` -> ``geo_masked_seq``, the fraction of sequences masked). Collective over ``group`` when
    torch.distributed is initialised; every rank gets the same dict.

    Returns:
        ``{"tokens": int, "<name>": mean, "<name>_max": max}``, and ``"seqs": int`` when reported (a mean is nan
        when no token, or no sequence, was valid).
    """
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    for one in stats:
        for key, value in one.items():
            if key.endswith("_max"):
                maxima[key] = max(maxima.get(key, float("-inf")), float(value))
            else:
                sums[key] = sums.get(key, 0.0) + float(value)
    sum_keys, max_keys = sorted(sums), sorted(maxima)
    if _distributed(group):
        gathered: list[list[str]] = [None] * torch.distributed.get_world_size(group)  # type: ignore[list-item]
        torch.distributed.all_gather_object(gathered, [*sum_keys, "|", *max_keys], group=group)
        if any(g != gathered[0] for g in gathered):
            raise ValueError(f"reduce_stats: ranks report different statistics: {gathered}")
        s = _all_reduce(torch.tensor([sums[k] for k in sum_keys], dtype=torch.float64), group)
        m = _all_reduce(
            torch.tensor([maxima[k] for k in max_keys], dtype=torch.float64), group, torch.distributed.ReduceOp.MAX
        )
        sums, maxima = dict(zip(sum_keys, s.tolist())), dict(zip(max_keys, m.tolist()))
    tokens = sums.pop("tokens", 0.0)
    out: dict[str, float] = {"tokens": int(tokens)}
    if "seqs" in sums:
        out["seqs"] = int(sums["seqs"])
    seqs = sums.pop("seqs", 0.0)
    for key, value in sums.items():
        count = seqs if key.endswith("_seq_sum") else tokens
        out[key.removesuffix("_sum")] = value / count if count else float("nan")
    out.update(maxima)
    return out
