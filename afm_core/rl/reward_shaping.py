"""The trajectory reward from its grade (:func:`shaped_reward`: score, format, DAPO's overlong penalty)."""

from __future__ import annotations

import torch

from afm_core.config.rl import REWARD_MODES, RewardConfig


def shaped_reward(score: float, fmt: float, length: int, reward_cfg: RewardConfig, max_len: int) -> float:
    """The trajectory reward: ``score x format`` (``reward.mode: score_x_format``, the default), ``score``, or
    ``score - reward.format_penalty`` when the format is invalid (``score_minus_format_penalty``: AutoCoA's exact
    match plus a format penalty, arXiv 2503.06580 §3.3.1), plus DAPO's overlong penalty
    (:func:`overlong_penalty`) over the stage's ``max_len`` when ``reward.overlong_buffer_len`` > 0.

    Args:
        score: the grader's score in [0, 1]; fmt: the CoA format score (0 or 1); length: response tokens
            (model + observation); max_len: the stage's response budget in tokens; reward_cfg: the ``reward``
            group (:class:`~afm_core.config.rl.RewardConfig`).
    Raises:
        ValueError: an unknown ``reward.mode``.
    """
    mode = reward_cfg.mode
    if mode not in REWARD_MODES:
        raise ValueError(f"reward.mode={mode!r}: expected one of {', '.join(REWARD_MODES)}")
    reward = score * fmt if mode == "score_x_format" else score
    if mode == "score_minus_format_penalty":
        reward -= reward_cfg.format_penalty * (1.0 - fmt)
    buffer = reward_cfg.overlong_buffer_len
    if buffer > 0:
        buffer = min(buffer, max_len)
        penalty = overlong_penalty(torch.tensor([length]), max_len, buffer, factor=reward_cfg.overlong_penalty_factor)
        reward += float(penalty[0])
    return reward


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_length: int, *, factor: float = 1.0
) -> torch.Tensor:
    """The soft overlong punishment of DAPO (arXiv 2503.14476, section 3.4, eq. 13), added to the reward.

    With ``L_max = max_length`` and ``L_cache = buffer_length``::

        R_length(|y|) = 0                                       if |y| <= L_max - L_cache
                      = ((L_max - L_cache) - |y|) / L_cache     if L_max - L_cache < |y| <= L_max
                      = -1                                      if |y| > L_max

    times ``factor`` (verl/AFM ``overlong_penalty_factor``, 1.0 in the DAPO recipe; AFM
    ``verl/workers/reward_manager/dapo.py`` computes ``min(0, -(|y| - (L_max - L_cache)) / L_cache * factor)``,
    identical up to L_max since generation stops there). The DAPO recipe uses L_max = 20480, L_cache = 4096.
    Which tokens count in ``|y|`` is the caller's choice (for tool trajectories: the whole response, tool
    observations included, since they consume the same context budget).

    Args:
        lengths: ``[N]`` response lengths in tokens (int or float).
        max_length: L_max in tokens.
        buffer_length: L_cache in tokens, ``0 < buffer_length <= max_length``.
    Returns:
        ``[N]`` float32 penalties in ``[-factor, 0]``.
    Raises:
        ValueError: ``buffer_length`` not in ``(0, max_length]``.
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"overlong buffer_length={buffer_length} must be in (0, max_length={max_length}]")
    lengths = lengths.to(torch.float32)
    expected = max_length - buffer_length
    linear = (expected - lengths) / buffer_length
    penalty = torch.where(lengths <= expected, torch.zeros_like(lengths), linear)
    penalty = torch.where(lengths > max_length, torch.full_like(lengths, -1.0), penalty)
    return penalty * factor
