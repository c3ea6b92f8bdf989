"""The staged context length of an RL run (``rollout.context_schedule``): which response budget, and which trainer
sequence length, each rollout step gets.

AFM's RL recipes grow the response budget in stages (e.g. 16k tokens until step 40, then 32k; AFM
``scripts/train/*/run_*_rl.sh``); one stage is active per rollout step, and the trainer's sequence length follows
it (:func:`train_seq_length`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from afm_core.config.rl import ContextStage


@dataclass(frozen=True)
class Stage:
    """One stage of the context schedule: ``max_response_len`` tokens per trajectory (model + observation
    tokens) until rollout step ``until_step`` (exclusive; None: to the end)."""

    index: int
    max_response_len: int
    until_step: int | None


def parse_schedule(schedule: Sequence[ContextStage] | None, default_len: int) -> list[Stage]:
    """``rollout.context_schedule`` (:class:`~afm_core.config.rl.ContextStage` s, e.g. ``until_step=40,
    max_response_len=16384`` then ``max_response_len=32768``) -> stages; none: one stage of ``default_len`` tokens
    (``rollout.max_response_len``). :class:`~afm_core.config.rl.RolloutConfig` checks the same at submit.

    Raises:
        ValueError: a stage without a positive ``max_response_len``, ``until_step`` not increasing, or a stage
            other than the last without ``until_step`` (names the stage: ``rollout.context_schedule[i]``).
    """
    if not schedule:
        return [Stage(0, int(default_len), None)]
    stages, last = [], 0
    for i, entry in enumerate(schedule):
        where = f"rollout.context_schedule[{i}]"
        length = entry.max_response_len
        if not isinstance(length, int) or length < 1:  # omegaconf's MISSING ("???") when a stage has none
            raise ValueError(f"{where}.max_response_len: a positive token count is required")
        until = entry.until_step
        if until is None and i != len(schedule) - 1:
            raise ValueError(f"{where}.until_step: only the last stage may omit it")
        if until is not None and until <= last:
            raise ValueError(f"{where}.until_step={until}: must be above the previous stage's ({last})")
        last = until if until is not None else last
        stages.append(Stage(i, length, until))
    return stages


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
