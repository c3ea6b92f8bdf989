"""The ``Trajectory`` type: one task solved the Chain-of-Agents way, as a sequence of tagged steps."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from afm_core.coa.prompts import TASKS
from afm_core.coa.tags import tag_kind


@dataclass(frozen=True)
class Step:
    """One block of a trajectory: a role block, a tool call or an observation.

    Attributes:
        tag: one of :data:`afm_core.coa.tags.ALL_TAGS`.
        content: the block's inner text, stripped of surrounding whitespace (for a tool call: its
            ``query``, as upstream ``XMLToolParser`` strips it).

    Raises:
        ValueError: unknown tag, or content that is not a string.
    """

    tag: str
    content: str

    def __post_init__(self) -> None:
        tag_kind(self.tag)
        if not isinstance(self.content, str):
            raise ValueError(f"step <{self.tag}>: content must be a string, got {type(self.content).__name__}")
        object.__setattr__(self, "content", self.content.strip())

    @property
    def kind(self) -> str:
        """``"role"``, ``"tool"`` or ``"observation"``."""
        return tag_kind(self.tag)

    def to_dict(self) -> dict[str, str]:
        return {"tag": self.tag, "content": self.content}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Step:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: missing ``tag``/``content`` field, or bad values.
        """
        return cls(_field(data, "tag", str, "step"), _field(data, "content", str, "step"))


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], owner: str) -> Any:
    if not isinstance(data, Mapping):
        raise ValueError(f"{owner}: expected an object, got {type(data).__name__}")
    if name not in data:
        raise ValueError(f"{owner}: missing field {name!r}")
    value = data[name]
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ValueError(f"{owner}: field {name!r} must be {names}, got {type(value).__name__}")
    return value


@dataclass
class Trajectory:
    """A task and its CoA solution.

    Attributes:
        id: unique id, ``"<source>:<id in the source>"``.
        task: task family, one of :data:`afm_core.coa.prompts.TASKS`.
        question: the question or problem, without any task prompt.
        prompt: the whole user-turn text (task prompt + question), see :func:`~afm_core.coa.prompts.user_prompt`.
        steps: the blocks, in order; the model writes every step except observations.
        answer: the task's reference answer: the source's gold answer when it has one, else the
            trajectory's own final answer that the source judged correct. Plain text (no ``\\boxed{}``).
        correct: whether the trajectory's final answer was judged equal to the reference (by the
            converter, or by the source's own reward/judge); None when unknown.
        source: the converter or dataset it comes from (``"gsm8k"``, ``"fireact"``...).
        source_id: its id within the source (the line number when the source has no ids).
        meta: extra JSON-safe information (source file, judge verdicts, difficulty...).

    Raises:
        ValueError: unknown task, or steps that are not :class:`Step`.
    """

    id: str
    task: str
    question: str
    prompt: str
    steps: list[Step]
    answer: str
    correct: bool | None = None
    source: str = ""
    source_id: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"trajectory {self.id!r}: unknown task {self.task!r}; known tasks: {', '.join(TASKS)}")
        if not all(isinstance(step, Step) for step in self.steps):
            raise ValueError(f"trajectory {self.id!r}: steps must be Step objects")

    @property
    def final_answer(self) -> str | None:
        """Content of the last ``<answer>`` step (as rendered, e.g. ``\\boxed{72}``), or None."""
        answers = [step.content for step in self.steps if step.tag == "answer"]
        return answers[-1] if answers else None

    @property
    def num_tool_calls(self) -> int:
        return sum(step.kind == "tool" for step in self.steps)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (``json.dumps`` works on it)."""
        return {
            "id": self.id,
            "task": self.task,
            "question": self.question,
            "prompt": self.prompt,
            "steps": [step.to_dict() for step in self.steps],
            "answer": self.answer,
            "correct": self.correct,
            "source": self.source,
            "source_id": self.source_id,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trajectory:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: a missing or mistyped field, named in the message (``steps[3]: missing field 'tag'``).
        """
        owner = f"trajectory {data.get('id')!r}" if isinstance(data, Mapping) else "trajectory"
        steps_data = _field(data, "steps", list, owner)
        steps = []
        for i, step in enumerate(steps_data):
            try:
                steps.append(Step.from_dict(step))
            except ValueError as err:
                raise ValueError(f"{owner}: steps[{i}]: {err}") from None
        return cls(
            id=_field(data, "id", str, owner),
            task=_field(data, "task", str, owner),
            question=_field(data, "question", str, owner),
            prompt=_field(data, "prompt", str, owner),
            steps=steps,
            answer=_field(data, "answer", str, owner),
            correct=_field(data, "correct", (bool, type(None)), owner) if "correct" in data else None,
            source=_field(data, "source", str, owner) if "source" in data else "",
            source_id=_field(data, "source_id", str, owner) if "source_id" in data else "",
            meta=dict(_field(data, "meta", dict, owner)) if "meta" in data else {},
        )
