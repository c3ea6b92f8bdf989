"""The staged context length of an RL run (``rollout.context_schedule``): which response budget, and which trainer
sequence length, each rollout step gets.

AFM's RL recipes grow the response budget in stages (e.g. 16k tokens until step 40, then 32k; AFM
``scripts/train/*/run_*_rl.sh``); one stage is active per rollout step, and the trainer's sequence length follows
it (:func:`train_seq_length`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from afm_core.config.rl import RolloutConfig


@dataclass(frozen=True)
class Stage:
    """One stage of the context schedule: ``max_response_len`` tokens per trajectory (model + observation
    tokens) until rollout step ``until_step`` (exclusive; None: to the end)."""

    index: int
    max_response_len: int
    until_step: int | None


def build_stages(rollout: RolloutConfig) -> list[Stage]:
    """The stages of ``rollout.context_schedule`` (e.g. ``until_step=40, max_response_len=16384`` then
    ``max_response_len=32768``), in order; an empty schedule: one stage of ``rollout.max_response_len`` tokens.
    The schedule is valid as :class:`~afm_core.config.rl.RolloutConfig` checks it (positive lengths, ``until_step``
    increasing from 1, only the last stage without one), so this raises nothing."""
    if not rollout.context_schedule:
        return [Stage(0, rollout.max_response_len, None)]
    return [Stage(i, s.max_response_len, s.until_step) for i, s in enumerate(rollout.context_schedule)]


def stage_at(stages: Sequence[Stage], step: int) -> Stage:
    """The stage of rollout step ``step`` (0-based: the step being generated)."""
    for stage in stages:
        if stage.until_step is None or step < stage.until_step:
            return stage
    return stages[-1]


def train_seq_length(stage: Stage, max_prompt_len: int, lengths: Sequence[int], pipeline_stages: int) -> int:
    """The trainer's sequence length for one train batch of trajectories of ``lengths`` tokens (prompt +
    response): the stage's cap ``max_prompt_len + stage.max_response_len`` with pipeline stages (megatron's p2p
    shapes are fixed), else the longest trajectory (never above the cap)."""
    return max_prompt_len + stage.max_response_len if pipeline_stages > 1 else max(lengths)
