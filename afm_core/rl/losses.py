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

Statistics are returned as sums over this micro batch's valid tokens (``*_sum``), counts and maxima
(``*_max``), so that :func:`reduce_stats` can add them over micro batches and ranks and divide once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

LOG_RATIO_CLAMP = 20.0  # verl clamps log(pi/pi_old) to +-20 before exp
KL_CLAMP = 10.0  # verl clamps the k3 estimate to +-10


@dataclass(frozen=True)
class PolicyLossConfig:
    """Policy loss settings (field names follow verl's actor config).

    clip_ratio_low / clip_ratio_high: the ratio is clipped to ``[1 - low, 1 + high]`` (DAPO clip-higher:
        0.2 / 0.28).
    clip_ratio_c: dual-clip bound for negative advantages (verl default 3.0, DAPO recipe and AFM web agent 10.0);
        None disables it.
    kl_coef: coefficient of the k3 (low-variance) KL penalty against the reference policy; 0 = no KL (DAPO).
    tis_cap: truncated importance sampling cap C on ``pi_old(trainer) / pi_rollout(vLLM)``; None disables it.
    entropy_coeff: entropy bonus coefficient (0 in DAPO).
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float | None = None
    kl_coef: float = 0.0
    tis_cap: float | None = None
    entropy_coeff: float = 0.0

    def __post_init__(self) -> None:
        if not (0 <= self.clip_ratio_low < 1 and self.clip_ratio_high >= 0):
            raise ValueError(f"clip ratios low={self.clip_ratio_low} (in [0, 1)), high={self.clip_ratio_high} (>= 0)")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c={self.clip_ratio_c}: the dual-clip bound must be > 1")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap={self.tis_cap}: must be positive")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef={self.kl_coef}: must be >= 0")


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


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    global_num_tokens: float | torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(),
    ref_log_prob: torch.Tensor | None = None,
    rollout_log_prob: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate policy loss (PPO/GRPO/DAPO) for one micro batch, token-summed / ``global_num_tokens``.

    Per valid token, with ``r = exp(logp - logp_old)`` (log-ratio clamped to +-20) and advantage ``A``::

        l = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))          # DAPO eq. 10 (clip-higher)
        l = min(l, -A * c)            if A < 0 and clip_ratio_c is set    # dual-clip (Ye et al., arXiv 1912.09729)
        l = l * min(exp(logp_old - logp_rollout), C)   if tis_cap = C     # truncated IS (Yao et al. 2025; slime --use-tis)
        l = l + kl_coef * k3(logp, logp_ref)          if kl_coef > 0      # GRPO KL (arXiv 2402.03300 eq. 3-4)
        l = l - entropy_coeff * H_t                   if entropy_coeff > 0

    PPO: Schulman et al., arXiv 1707.06347 eq. 7; the form above is verl ``core_algos.py::
    compute_policy_loss_vanilla``. The TIS weight is detached (a constant per token).

    Args:
        log_prob: ``[B, T]`` logprobs of the response tokens under the current policy (with grad).
        old_log_prob: ``[B, T]`` the trainer's logprobs before this rollout step's updates (recomputed).
        advantages: ``[B, T]`` token-level advantages.
        response_mask: ``[B, T]`` 1 = trained response token.
        global_num_tokens: valid tokens of the whole mini-batch over all micro batches and DP ranks; 1 returns
            the plain sum (Megatron per-token-loss mode).
        config: :class:`PolicyLossConfig`.
        ref_log_prob: ``[B, T]`` reference-policy logprobs; required when ``config.kl_coef > 0``.
        rollout_log_prob: ``[B, T]`` the inference engine's logprobs of the sampled tokens (after temperature);
            required when ``config.tis_cap`` is set; when given, the trainer/engine gap is reported.
        entropy: ``[B, T]`` per-token entropy of the current policy; reported when given; required (with
            grad) when ``config.entropy_coeff > 0``.
    Returns:
        ``(loss, stats)``: the scalar loss, and additive statistics over this micro batch's valid tokens (all
        detached fp32): ``tokens``, ``pg_loss_sum``, ``clip_frac_sum`` (tokens where clipping changed the
        loss, verl ``pg_clipfrac``), ``clip_frac_dual_sum`` (the dual clip did, verl ``pg_clipfrac_lower``),
        ``ppo_kl_sum`` (``logp_old - logp``), and when applicable ``kl_sum``, ``entropy_sum``, the
        trainer/engine gap of :func:`logprob_gap_stats` (``logprob_gap_sum``, ``logprob_gap_max``,
        ``prob_ratio_error_sum``), ``tis_weight_sum``, ``tis_clipped_sum``.
    Raises:
        ValueError: shapes differ, or an input that the config needs is missing.
    """
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
    if config.tis_cap is not None and rollout_log_prob is None:
        raise ValueError("tis_cap is set but rollout_log_prob is missing")
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
        if config.tis_cap is not None:
            raw = torch.exp(gap.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            weight = raw.clamp(max=config.tis_cap)
            per_token = per_token * weight
            stats["tis_weight_sum"] = _masked_sum(weight, mask)
            stats["tis_clipped_sum"] = _masked_sum((raw > config.tis_cap).float(), mask)
    pg_per_token = per_token

    if config.kl_coef > 0:
        if ref_log_prob is None:
            raise ValueError("kl_coef > 0 needs ref_log_prob (the reference policy's log-probs)")
        ref = torch.where(mask, ref_log_prob.float(), detached)
        kl = low_var_kl(logp, ref)
        per_token = per_token + config.kl_coef * kl
        stats["kl_sum"] = _masked_sum(kl.detach(), mask)
    if entropy is not None:
        ent = torch.where(mask, entropy.float(), zero)
        stats["entropy_sum"] = _masked_sum(ent.detach(), mask)
        if config.entropy_coeff > 0:
            per_token = per_token - config.entropy_coeff * ent

    loss = torch.where(mask, per_token, zero).sum() / global_num_tokens
    stats.update(
        tokens=mask.sum().float(),
        pg_loss_sum=_masked_sum(pg_per_token.detach(), mask),
        clip_frac_sum=_masked_sum(clipped.float(), mask),
        clip_frac_dual_sum=_masked_sum(dual.float(), mask),
        ppo_kl_sum=_masked_sum(-log_ratio.detach(), mask),
    )
    return loss, stats


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
    """Means over the valid tokens of all micro batches and the ranks of ``group`` (the DP group).

    Sums keys ``*_sum`` and ``tokens`` (then divides: ``clip_frac_sum`` -> ``clip_frac``), takes the maximum of
    ``*_max``. Collective over ``group`` when torch.distributed is initialised; every rank gets the same dict.

    Returns:
        ``{"tokens": int, "<name>": mean, "<name>_max": max}`` (a mean is nan when no token was valid).
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
    for key, value in sums.items():
        out[key.removesuffix("_sum")] = value / tokens if tokens else float("nan")
    out.update(maxima)
    return out
