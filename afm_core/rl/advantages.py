"""Advantage estimators: GRPO group-normalised outcome advantages and GAE with a critic, on response tokens.

Shapes: ``N`` trajectories (``rollout.n`` samples per prompt, grouped by a prompt uid), ``T`` token positions.
Per-token tensors ``[N, T]`` are aligned with the trained targets (see :mod:`afm_core.rl.batch`): the
``response_mask`` is 1 exactly on the model-generated response tokens, 0 on the prompt, the tool observations
and the padding. Nothing here touches positions where the mask is 0 except to write 0 there.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

GRPO_EPS = 1e-6  # verl compute_grpo_outcome_advantage epsilon; slime uses the same


def group_index(group_ids: Sequence[Hashable] | torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map group ids (prompt uids: any hashable, or an int tensor) to dense indices in order of first appearance.

    Returns:
        ``(index [N] int64, number of groups)``.
    """
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in group_ids]
    return torch.tensor(index, dtype=torch.long), len(dense)


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = GRPO_EPS,
) -> torch.Tensor:
    """GRPO outcome advantages: each reward normalised within its prompt's group of samples.

    ``A_i = (r_i - mean(r_g)) / (std(r_g) + eps)`` for sample ``i`` of group ``g`` (DeepSeekMath, arXiv
    2402.03300, section 4.1.2 "outcome supervision"; DAPO arXiv 2503.14476 eq. 9), with the unbiased standard
    deviation (``torch.std``) and eps 1e-6 as in verl ``verl/trainer/ppo/core_algos.py::
    compute_grpo_outcome_advantage``. ``norm_by_std=False`` gives ``A_i = r_i - mean(r_g)`` (Dr.GRPO, arXiv
    2503.20783; verl ``norm_adv_by_std_in_grpo=False``). A group of one sample gets mean 0 and std 1 (verl).

    Args:
        rewards: ``[N]`` scalar reward per trajectory (any float dtype; computed in float64).
        group_ids: ``N`` prompt uids; samples with equal ids form a group.
    Returns:
        ``[N]`` float32 advantages (broadcast them with :func:`broadcast_to_tokens`).
    Raises:
        ValueError: ``rewards`` is not 1-D or its length differs from ``group_ids``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N], got shape {tuple(rewards.shape)}")
    index, num_groups = group_index(group_ids)
    if index.numel() != rewards.numel():
        raise ValueError(f"{rewards.numel()} rewards but {index.numel()} group ids")
    r = rewards.detach().to(torch.float64).cpu()
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, torch.ones_like(r))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, r) / count
    centred = r - mean[index]
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, centred**2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    single = count[index] == 1  # a lone sample: mean 0, std 1 (verl)
    adv = torch.where(single, r, centred)
    if norm_by_std:
        adv = adv / (torch.where(single, torch.ones_like(r), std[index]) + eps)
    return adv.to(torch.float32).to(rewards.device)


def broadcast_to_tokens(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token-level advantages: each trajectory's scalar on its response tokens, 0 elsewhere.

    Args:
        advantages: ``[N]``.
        response_mask: ``[N, T]`` (1 = model-generated response token).
    Returns:
        ``[N, T]`` float32 (verl ``scores.unsqueeze(-1) * response_mask``).
    """
    if advantages.shape != response_mask.shape[:1]:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} do not match response_mask {tuple(response_mask.shape)}"
        )
    mask = response_mask.to(torch.bool)
    return torch.where(mask, advantages.to(torch.float32).unsqueeze(-1), torch.zeros((), dtype=torch.float32))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the positions where ``mask`` is 1 (unbiased var), 0 elsewhere.

    As verl ``verl/utils/torch_functional.py::masked_whiten`` (``shift_mean=True``), applied to GAE advantages.
    """
    keep = mask.to(torch.bool)
    x = values[keep].to(torch.float64)
    if x.numel() < 2:
        raise ValueError(f"masked_whiten needs at least 2 unmasked values, got {x.numel()}")
    whitened = (values.to(torch.float64) - x.mean()) / torch.sqrt(x.var(unbiased=True) + eps)
    return torch.where(keep, whitened, torch.zeros((), dtype=torch.float64)).to(values.dtype)


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation for PPO with a critic, skipping observation tokens.

    Backwards over positions ``t`` with response tokens only: ``delta_t = r_t + gamma * V_next - V_t``,
    ``A_t = delta_t + gamma * lam * A_next``, where ``V_next`` / ``A_next`` belong to the next *response* token
    (0 after the last one): positions with mask 0 (tool observations, prompt, padding) pass both through
    unchanged, so a tool call's value bootstraps from the first token generated after its observation.
    Returns ``R_t = A_t + V_t``. Schulman et al., "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation", arXiv 1506.02438, eqs. 11-16; the observation skipping is verl's
    ``verl/trainer/ppo/core_algos.py::compute_gae_advantage_return`` (which also whitens the advantages over
    the batch's response tokens: ``whiten=True``, :func:`masked_whiten`).

    Args:
        token_rewards: ``[N, T]`` rewards (the outcome reward on the last response token; 0 elsewhere).
        values: ``[N, T]`` critic values V(s_t) at the same positions (old values, no grad needed).
        response_mask: ``[N, T]``.
        gamma, lam: discount and GAE lambda (the PPO MHQA recipe uses 1.0 / 1.0; verl's defaults).
    Returns:
        ``(advantages [N, T], returns [N, T])`` float32, both 0 where the mask is 0.
    """
    if not (token_rewards.shape == values.shape == response_mask.shape) or token_rewards.dim() != 2:
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must all be the same [N, T]"
        )
    with torch.no_grad():
        mask = response_mask.to(torch.float64)
        rewards, vals = token_rewards.to(torch.float64), values.to(torch.float64)
        next_value = torch.zeros(rewards.shape[0], dtype=torch.float64, device=rewards.device)
        next_adv = torch.zeros_like(next_value)
        adv = torch.zeros_like(rewards)
        for t in range(rewards.shape[1] - 1, -1, -1):
            delta = rewards[:, t] + gamma * next_value - vals[:, t]
            here = delta + gamma * lam * next_adv
            m = mask[:, t]
            next_value = m * vals[:, t] + (1 - m) * next_value
            next_adv = m * here + (1 - m) * next_adv
            adv[:, t] = next_adv
        returns = (adv + vals) * mask
        adv = adv * mask
        if whiten:
            adv = masked_whiten(adv, response_mask)
    return adv.to(torch.float32), returns.to(torch.float32)


@dataclass
class Advantages:
    """One train batch's advantages: ``values`` ``[N]`` (GRPO, one per trajectory) or per-token lists as long as
    each response (GAE); for PPO also the critic's ``old_values`` and the ``returns`` (per-token lists); ``times``
    in seconds (``values_s``)."""

    values: torch.Tensor | list[list[float]]
    old_values: list[list[float]] | None = None
    returns: list[list[float]] | None = None
    times: dict[str, float] = field(default_factory=dict)
