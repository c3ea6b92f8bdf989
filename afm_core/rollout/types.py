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
    - ``error``: the engine raised; the message is in :attr:`Rollout.error`.
    """

    ANSWER = "answer"
    EOS = "eos"
    MAX_TURNS = "max_turns"
    LENGTH = "length"
    TIMEOUT = "timeout"
    ABORT = "abort"
    ERROR = "error"


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
        seconds: wall-clock seconds of the whole trajectory.
        error: the engine error message when ``finish_reason`` is ``error``.
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
