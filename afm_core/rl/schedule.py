"""The staged context length of an RL run (``rollout.context_schedule``): which response budget, and which trainer
sequence length, each rollout step gets.

AFM's RL recipes grow the response budget in stages (e.g. 16k tokens until step 40, then 32k; AFM
``scripts/train/*/run_*_rl.sh``); one stage is active per rollout step, and the trainer's sequence length follows
it (:func:`train_seq_length`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stage:
    """One stage of the context schedule: ``max_response_len`` tokens per trajectory (model + observation
    tokens) until rollout step ``until_step`` (exclusive; None: to the end)."""

    index: int
    max_response_len: int
    until_step: int | None


def parse_schedule(schedule: Sequence[Mapping[str, Any]] | None, default_len: int) -> list[Stage]:
    """``[{until_step: 40, max_response_len: 16384}, {max_response_len: 32768}]`` -> stages.

    Raises:
        ValueError: a stage without ``max_response_len``, ``until_step`` not increasing, or a stage other than
            the last without ``until_step`` (names the stage: ``rollout.context_schedule[i]``).
    """
    if not schedule:
        return [Stage(0, int(default_len), None)]
    stages, last = [], 0
    for i, entry in enumerate(schedule):
        where = f"rollout.context_schedule[{i}]"
        unknown = set(entry) - {"until_step", "max_response_len"}
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; expected until_step, max_response_len")
        if entry.get("max_response_len") is None or int(entry["max_response_len"]) < 1:
            raise ValueError(f"{where}.max_response_len: a positive token count is required")
        until = entry.get("until_step")
        if until is None and i != len(schedule) - 1:
            raise ValueError(f"{where}.until_step: only the last stage may omit it")
        if until is not None and int(until) <= last:
            raise ValueError(f"{where}.until_step={until}: must be above the previous stage's ({last})")
        last = int(until) if until is not None else last
        stages.append(Stage(i, int(entry["max_response_len"]), None if until is None else int(until)))
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
