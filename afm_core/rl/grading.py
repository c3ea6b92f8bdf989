"""Grading a rollout into the trainer's :class:`Sample`: the task's grader scores the answer, the CoA validator the
format, and :func:`~afm_core.rl.reward_shaping.shaped_reward` makes the reward.

:class:`Sample` is the rollout contract between generation and training (picklable, no text, gathered from every
rank): ``prompt_ids`` and ``response_ids`` (token ids; the response holds the model's tokens and the tool
observations' tokens in order), ``response_mask`` (1 = a model-generated token the loss trains, 0 = an
observation token), ``logprobs`` (vLLM's, one per response token, after temperature), ``reward`` (from ``score``
and ``format``) and ``finish_reason`` (the rollout's status: ``answer``, ``eos``, ``length``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from afm_core.rewards.format import grade_format
from afm_core.rl.reward_shaping import shaped_reward

if TYPE_CHECKING:
    from afm_core.config.rl import RewardConfig
    from afm_core.rewards.grader import Graders
    from afm_core.rollout.types import Rollout


@dataclass
class Sample:
    """One graded trajectory as the trainer needs it (see the module docstring); ``tool_calls`` are ``(tool name,
    error or None)``, ``seconds`` the rollout's wall time (pauses left out), ``tool_seconds`` its tool calls' summed
    time, ``versions`` ``[R]`` the policy version each response token was sampled under (observation tokens: the
    version of the turn before them; :mod:`afm_core.rl.rollout_buffer`), ``index`` its sample index in the group
    (0..n-1)."""

    uid: str
    task_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float]
    score: float
    format: float
    reward: float
    finish_reason: str
    tool_calls: list[tuple[str, str | None]] = field(default_factory=list)
    seconds: float = 0.0
    tool_seconds: float = 0.0
    versions: list[int] = field(default_factory=list)
    index: int = 0

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> Sample:
        """A Sample from ``dataclasses.asdict`` of one (how a checkpoint holds it: plain containers, which
        ``torch.load(weights_only=True)`` reads back)."""
        return cls(**{**fields, "tool_calls": [tuple(c) for c in fields.get("tool_calls", [])]})


async def grade_rollout(graders: Graders, rollout: Rollout, uid: str, reward: RewardConfig, max_len: int) -> Sample:
    """Grade one :class:`~afm_core.rollout.Rollout` of group ``uid`` (score from its task's grader, format from
    the CoA validator, reward shaped over the stage's ``max_len`` response tokens)."""
    task = rollout.task
    grade = await graders.grade(
        task.meta["grader"], rollout.response_text, gold=task.answer, question=task.question, meta=task.meta
    )
    fmt = grade_format(rollout.response_text).score
    shaped = shaped_reward(grade.score, fmt, len(rollout.response_ids), reward, max_len)
    return Sample(
        uid=uid,
        task_id=task.id,
        prompt_ids=list(rollout.prompt_ids),
        response_ids=list(rollout.response_ids),
        response_mask=list(rollout.response_mask),
        logprobs=list(rollout.logprobs),
        score=float(grade.score),
        format=float(fmt),
        reward=shaped,
        finish_reason=rollout.finish_reason.value,
        tool_calls=[(c.name, c.error) for c in rollout.tool_calls],
        seconds=rollout.seconds,
        tool_seconds=sum(c.seconds for c in rollout.tool_calls),
        versions=list(rollout.versions),
        index=rollout.sample,
    )
