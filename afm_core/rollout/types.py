"""The rollout contract: what one agent-loop trajectory hands to evaluation, RL and distillation.

After slime's ``Sample`` (THUDM/slime ``slime/utils/types.py``): token ids, a loss mask, the rollout
logprobs and a status, plus the CoA view of the same text. Trainer and rollout never import each other;
only these types cross between them.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from afm_core.coa.trajectory import Trajectory


class FinishReason(str, enum.Enum):
    """Why a trajectory ended.

    - ``answer``: the model closed ``</answer>`` (a stop string);
    - ``eos``: the model ended its turn (EOS / end-of-turn token) without an answer;
    - ``max_turns``: ``max_turns`` generations were used;
    - ``length``: the response budget (``max_response_tokens``, model + observation tokens) or the
      engine's context was exhausted;
    - ``timeout``: the per-trajectory wall-clock limit passed;
    - ``abort``: the engine aborted the request (e.g. a weight sync with ``abort`` mode);
    - ``error``: the engine raised; the message is in :attr:`Rollout.error`;
    - ``paused``: the engine was paused (:meth:`~afm_core.rollout.engine.GenerationEngine.pause`): the trajectory
      has not ended; :attr:`Rollout.paused` holds it, to continue with ``AgentLoop.run(..., resume=paused)``.
    """

    ANSWER = "answer"
    EOS = "eos"
    MAX_TURNS = "max_turns"
    LENGTH = "length"
    TIMEOUT = "timeout"
    ABORT = "abort"
    ERROR = "error"
    PAUSED = "paused"


@dataclass(frozen=True)
class AgentTask:
    """One problem for the agent loop.

    Attributes:
        id: a stable id (``"<benchmark>:<index>"``); with the sample index it keys resumable outputs.
        task: the CoA task family (``math``, ``mhqa``, ``web``, ``code``): picks tools and grader.
        prompt: the whole user-turn text (task prompt + question), see :func:`afm_core.coa.user_prompt`.
        question: the bare question (for graders, judges and tool context).
        answer: the reference answer as text (graders parse it); may be empty for test-graded code.
        system: a system message, or None to leave the chat template's default.
        meta: anything the grader needs (tests, entry point, level, data source...), JSON-safe.
    """

    id: str
    task: str
    prompt: str
    question: str = ""
    answer: str = ""
    system: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolCallRecord:
    """One tool call inside a trajectory.

    Attributes:
        turn: the 0-based generation turn that wrote the call.
        name: the tool's tag (``code``, ``wiki_search``...).
        query: the tag's stripped content.
        observation: the observation text returned (possibly an error observation).
        seconds: wall-clock seconds of the call.
        error: the error kind (``timeout``, ``connect``, ``http_5xx``...) when the call failed, else None.
    """

    turn: int
    name: str
    query: str
    observation: str
    seconds: float
    error: str | None = None


@dataclass
class PausedTrajectory:
    """A trajectory stopped at a token boundary by an engine pause: plain, picklable and ``dataclasses.asdict``-able
    (ints, floats, strings and :class:`ToolCallRecord`), so a rollout buffer can keep it across steps and in a
    checkpoint. ``AgentLoop.run(task, sample, resume=paused)`` continues it token-in: the next prompt is exactly
    ``prompt_ids + response_ids + turn_ids``, never re-rendered.

    The turn in progress at the pause (``turn_ids``) is the tokens its generation sampled before the pause, less
    the trailing ones rolled back (``rolled_back_tokens``): those whose text could begin a stop string that the
    continuation would complete (vLLM looks for stop strings in a request's own output text only, so a ``</cod``
    left at the end of a paused turn and an ``e>`` written by its continuation would never stop generation), and
    a trailing incomplete UTF-8 character. Any stop string of the whole turn then lies in the continuation.

    Attributes:
        task_id: the :class:`AgentTask` id.
        sample: the sample index of the trajectory for its task.
        base_seed: the trajectory's base sampling seed (turn t samples with ``base_seed + t``).
        prompt_ids: ``[P]`` prompt token ids.
        response_ids: ``[R]`` response token ids of the finished turns and their observations.
        response_mask: ``[R]`` 1 = sampled by the model, 0 = observation.
        logprobs: ``[R]`` sampling logprobs (0.0 for observations).
        versions: ``[R]`` the policy version each token was sampled under (an observation token: its turn's).
        turn_ids: ``[U]`` the unfinished turn's sampled ids so far (empty when paused between turns).
        turn_logprobs: ``[U]`` their logprobs (0.0 where the engine returned none).
        turn_versions: ``[U]`` their policy versions (a turn paused twice mixes two).
        text_parts: the response text so far, one part per finished turn and observation.
        tool_calls: the tool calls made so far.
        turns: generation turns finished (the unfinished one is not counted).
        seconds: wall-clock seconds the trajectory ran, the pauses not counted.
        rolled_back_tokens: sampled tokens dropped at this trajectory's pauses so far (to be sampled again).
        pauses: times this trajectory was paused so far.
    """

    task_id: str
    sample: int
    base_seed: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turn_ids: list[int]
    turn_logprobs: list[float]
    turn_versions: list[int]
    text_parts: list[str]
    tool_calls: list[ToolCallRecord]
    turns: int
    seconds: float
    rolled_back_tokens: int = 0
    pauses: int = 1

    @property
    def num_generated_tokens(self) -> int:
        """Tokens the model sampled and kept so far (finished turns and the unfinished one)."""
        return sum(self.response_mask) + len(self.turn_ids)


@dataclass
class Rollout:
    """One finished trajectory, token-exact.

    ``prompt_ids + response_ids`` is exactly what the model saw: the engine's sampled ids interleaved with
    the observation ids, never re-tokenized. Per response token: ``response_mask`` is 1 where the model
    sampled it and 0 for observation tokens; ``logprobs`` holds the sampling logprob of a sampled token
    (after temperature when the engine runs ``logprobs_mode=processed_logprobs``) and 0.0 for observations.

    Attributes:
        task: the :class:`AgentTask`.
        sample: the sample index of this trajectory for its task (0..k-1).
        prompt_ids: ``[P]`` prompt token ids.
        response_ids: ``[R]`` response token ids (model and observation tokens).
        response_mask: ``[R]`` 1 = sampled by the model, 0 = observation.
        logprobs: ``[R]`` float logprobs (0.0 where ``response_mask`` is 0).
        response_text: the response as text: decoded model segments and the observation texts.
        turns: generation calls made.
        tool_calls: every tool call, in order.
        finish_reason: see :class:`FinishReason`.
        trajectory: the response parsed into a CoA :class:`~afm_core.coa.Trajectory`, None if unparsable.
        format_issues: the CoA validator's issue codes for the response (empty = valid).
        seconds: wall-clock seconds of the whole trajectory (its pauses not counted).
        error: the engine error message when ``finish_reason`` is ``error``.
        versions: ``[R]`` the policy version each response token was sampled under (an observation token gets
            the version of the turn it follows); all 0 when the caller gave none.
        paused: the trajectory's state, set iff ``finish_reason`` is ``paused``.
        rolled_back_tokens: sampled tokens dropped at this trajectory's pauses (sampled again after the resume;
            see :class:`PausedTrajectory`), over all its pauses.
        pauses: times the trajectory was paused (a paused one counts its current pause).
    """

    task: AgentTask
    sample: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float]
    response_text: str
    turns: int
    tool_calls: list[ToolCallRecord]
    finish_reason: FinishReason
    trajectory: Trajectory | None
    format_issues: list[str]
    seconds: float
    error: str | None = None
    versions: list[int] = field(default_factory=list)
    paused: PausedTrajectory | None = None
    rolled_back_tokens: int = 0
    pauses: int = 0

    def __post_init__(self) -> None:
        if not self.versions:
            self.versions = [0] * len(self.response_ids)
        if (self.paused is not None) != (self.finish_reason == FinishReason.PAUSED):
            raise ValueError(f"Rollout.paused is set iff finish_reason is paused (finish_reason={self.finish_reason})")

    @property
    def num_generated_tokens(self) -> int:
        """Tokens the model sampled (``sum(response_mask)``)."""
        return sum(self.response_mask)

    @property
    def num_tool_errors(self) -> int:
        return sum(call.error is not None for call in self.tool_calls)

    @property
    def final_answer(self) -> str | None:
        """The content of the last ``<answer>`` block of the response text, or None."""
        start = self.response_text.rfind("<answer>")
        if start < 0:
            return None
        end = self.response_text.find("</answer>", start)
        return self.response_text[start + len("<answer>") : end if end >= 0 else None].strip()

    def summary(self) -> dict[str, Any]:
        """A JSON-safe summary (no token arrays) for logs and ``samples.jsonl``."""
        return {
            "task_id": self.task.id,
            "sample": self.sample,
            "finish_reason": self.finish_reason.value,
            "turns": self.turns,
            "num_tool_calls": len(self.tool_calls),
            "tool_errors": self.num_tool_errors,
            "prompt_tokens": len(self.prompt_ids),
            "response_tokens": len(self.response_ids),
            "generated_tokens": self.num_generated_tokens,
            "format_issues": list(self.format_issues),
            "seconds": round(self.seconds, 3),
            "tool_calls": [asdict(call) for call in self.tool_calls],
            "error": self.error,
        }
