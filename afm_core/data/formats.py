"""Foreign formats: LLaMA-Factory alpaca JSON (SFT) and the AFM/verl RL parquet.

**LLaMA-Factory alpaca** (afm-reference §2.3): a JSON list of ``{"instruction", "input", "output"
[, "system", "history"]}``. Upstream AFM's SFT sets use it with the task prompt and question in
``instruction`` and the WHOLE CoA trajectory, observations inline, as one ``output`` string. Export:
``instruction`` = our user-turn prompt, ``input`` = ``""``, ``output`` = the rendered response.
Import parses ``output`` back into steps.

**AFM/verl RL parquet** (afm-reference §2.4): one row per task, ``data_source`` (string), ``prompt``
(list of ``{content, role}`` chat messages), ``ability`` (string), ``reward_model`` (``{ground_truth,
style}``; ``ground_truth`` a plain answer or a JSON string such as ``{"stdin": [...],
"expected_output": [...]}``) and ``extra_info`` (a struct holding a unique ``index``, which verl uses
as the GRPO group id, plus tool kwargs and anything else).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from afm_core.coa.parse import parse_steps
from afm_core.coa.prompts import TASK_TOOLS, split_user_prompt, task_of_prompt
from afm_core.coa.render import render_response
from afm_core.coa.trajectory import Trajectory
from afm_core.data.converters.answer_check import boxed_content
from afm_core.data.converters.base import Converter, Rejected
from afm_core.data.io import DataFormatError, Where, read_json_list, require
from afm_core.utils.atomic import atomic_path, atomic_write_json

# --------------------------------------------------------------------------------------------------
# LLaMA-Factory alpaca JSON


def to_alpaca(trajectory: Trajectory) -> dict[str, str]:
    """``{"instruction": prompt, "input": "", "output": rendered response}`` for one trajectory."""
    return {"instruction": trajectory.prompt, "input": "", "output": render_response(trajectory.steps)}


def write_alpaca(path: str | os.PathLike[str], trajectories: Iterable[Trajectory]) -> None:
    """Write trajectories as a LLaMA-Factory alpaca JSON list, atomically."""
    atomic_write_json(path, [to_alpaca(t) for t in trajectories])


def _infer_task(prompt: str, tools: set[str]) -> str | None:
    if task := task_of_prompt(prompt):
        return task
    if tools & {"web_search", "crawl_page"}:
        return "web"
    if "wiki_search" in tools:
        return "mhqa"
    if "code" in tools:
        return "math"
    return None


def alpaca_converter(task: str | None = None) -> Converter:
    """A converter of LLaMA-Factory alpaca JSON files into trajectories (source ``llamafactory``).

    Args:
        task: the task family of every record; None infers it from the prompt (one of ours) or else
            from the tools used (web_search/crawl_page: web, wiki_search: mhqa, code: math).

    The user turn is ``instruction`` (+ ``"\\n\\n" + input`` when ``input`` is set); the question is
    what follows its last ``"\\n\\nQuestion: "``; ``system`` is kept in ``meta``. The answer is the
    final ``<answer>`` content (``\\boxed{}`` removed); correctness is unknown (None).

    Rejection reasons: ``has_history`` (multi-turn records), ``unknown_task``, ``grammar:<code>``.
    Malformed records (missing ``instruction``/``output``) raise ``DataFormatError``.
    """

    def convert_record(where: Where, record: dict[str, Any]) -> Trajectory:
        instruction = require(record, "instruction", str, where)
        output = require(record, "output", str, where)
        extra = record.get("input") or ""
        if record.get("history"):
            raise Rejected("has_history", "multi-turn records are not CoA trajectories")
        prompt = f"{instruction}\n\n{extra}" if extra else instruction
        steps = parse_steps(output)
        record_task = task or _infer_task(prompt, {s.tag for s in steps if s.kind == "tool"})
        if record_task is None:
            raise Rejected("unknown_task", "no known task prompt and no tool call to infer it from")
        answers = [s.content for s in steps if s.tag == "answer"]
        final = answers[-1] if answers else ""
        source_id = f"{where.path.stem}:{where.record}"
        return Trajectory(
            id=f"llamafactory:{source_id}",
            task=record_task,
            question=split_user_prompt(prompt)[1],
            prompt=prompt,
            steps=steps,
            answer=boxed_content(final) or final,
            correct=None,
            source="llamafactory",
            source_id=source_id,
            meta={"file": where.path.name, **({"system": record["system"]} if record.get("system") else {})},
        )

    return Converter(name="llamafactory", files=(), convert_record=convert_record, read_records=read_json_list)


# --------------------------------------------------------------------------------------------------
# AFM / verl RL parquet

_MESSAGES_TYPE = pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))
_REWARD_MODEL_TYPE = pa.struct([("ground_truth", pa.string()), ("style", pa.string())])


@dataclass
class RLTask:
    """One RL task record of the AFM/verl parquet.

    Attributes:
        data_source: dataset name; verl groups validation metrics by it.
        prompt: chat messages ``[{"role": "user", "content": ...}]``.
        ground_truth: ``reward_model.ground_truth``: a plain answer or a JSON string.
        extra_info: the ``extra_info`` struct as a dict; ``extra_info["index"]`` is the task's unique
            id (verl's GRPO group id).
        ability: ``ability`` column (``"math"``, ``"coding"``, ``"fact-reasoning"``...), may be None.
        reward_style: ``reward_model.style`` (upstream: ``"rule"``).
    """

    data_source: str
    prompt: list[dict[str, str]]
    ground_truth: str
    extra_info: dict[str, Any] = field(default_factory=dict)
    ability: str | None = None
    reward_style: str | None = "rule"

    @property
    def index(self) -> str:
        """``extra_info["index"]`` as a string."""
        return str(self.extra_info["index"])

    @property
    def question(self) -> str:
        """The last user message with any task prompt removed (see :func:`~afm_core.coa.prompts.split_user_prompt`)."""
        users = [m["content"] for m in self.prompt if m.get("role") == "user"]
        return split_user_prompt(users[-1])[1] if users else ""

    def ground_truth_value(self) -> Any:
        """``ground_truth`` decoded when it is a JSON object or list, else the plain string."""
        text = self.ground_truth.strip()
        if text[:1] in ("{", "["):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                pass
        return self.ground_truth

    def to_row(self) -> dict[str, Any]:
        return {
            "data_source": self.data_source,
            "prompt": [{"content": m["content"], "role": m["role"]} for m in self.prompt],
            "ability": self.ability,
            "reward_model": {"ground_truth": self.ground_truth, "style": self.reward_style},
            "extra_info": self.extra_info,
        }


def rl_task_from_row(row: dict[str, Any], where: Where) -> RLTask:
    """One :class:`RLTask` from a parquet row or JSON object of the AFM/verl RL layout.

    Raises:
        DataFormatError: a missing or mistyped field, named with ``where`` (file and line or record).
    """
    data_source = require(row, "data_source", str, where)
    messages = require(row, "prompt", list, where)
    prompt = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise where.error(f"prompt[{i}] must be a message object, got {type(message).__name__}")
        prompt.append({"content": require(message, "content", str, where, owner=f"prompt[{i}]"),
                       "role": require(message, "role", str, where, owner=f"prompt[{i}]")})  # fmt: skip
    reward_model = require(row, "reward_model", dict, where)
    ground_truth = require(reward_model, "ground_truth", (str, dict, list), where, owner="reward_model")
    if not isinstance(ground_truth, str):
        ground_truth = json.dumps(ground_truth, ensure_ascii=False)
    extra_info = dict(require(row, "extra_info", dict, where))
    if extra_info.get("index") is None:
        raise where.error("missing field 'extra_info.index' (verl's GRPO group id; every task needs a unique one)")
    if isinstance(extra_info.get("tools_kwargs"), dict):
        # A parquet struct has the union of all rows' keys: a tool absent from this row reads back as null.
        extra_info["tools_kwargs"] = {k: v for k, v in extra_info["tools_kwargs"].items() if v is not None}
    return RLTask(
        data_source=data_source,
        prompt=prompt,
        ground_truth=ground_truth,
        extra_info=extra_info,
        ability=row.get("ability"),
        reward_style=reward_model.get("style"),
    )


def read_rl_tasks(path: str | os.PathLike[str]) -> list[RLTask]:
    """Read an AFM/verl RL parquet file into :class:`RLTask` records.

    Raises:
        DataFormatError: a missing or mistyped column/field, or a missing or duplicate
            ``extra_info.index`` (``file: record 7: duplicate extra_info.index '3' (first at record 2)``).
        FileNotFoundError: no such file.
    """
    path = Path(path)
    tasks: list[RLTask] = []
    first_row: dict[str, int] = {}
    for i, row in enumerate(pq.read_table(path).to_pylist()):
        where = Where(path, record=i)
        task = rl_task_from_row(row, where)
        if task.index in first_row:
            raise where.error(f"duplicate extra_info.index {task.index!r} (first at record {first_row[task.index]})")
        first_row[task.index] = i
        tasks.append(task)
    return tasks


def write_rl_tasks(path: str | os.PathLike[str], tasks: Sequence[RLTask]) -> None:
    """Write :class:`RLTask` records as an AFM/verl RL parquet file, atomically.

    Columns ``data_source, prompt, ability, reward_model, extra_info`` with the upstream types;
    ``extra_info``'s struct type is inferred from the records, as pandas does upstream.

    Raises:
        DataFormatError: duplicate ``extra_info.index`` values.
    """
    seen: set[str] = set()
    for task in tasks:
        if task.index in seen:
            raise DataFormatError(f"{path}: duplicate extra_info.index {task.index!r}")
        seen.add(task.index)
    rows = [task.to_row() for task in tasks]
    table = pa.table(
        {
            "data_source": pa.array([r["data_source"] for r in rows], pa.string()),
            "prompt": pa.array([r["prompt"] for r in rows], _MESSAGES_TYPE),
            "ability": pa.array([r["ability"] for r in rows], pa.string()),
            "reward_model": pa.array([r["reward_model"] for r in rows], _REWARD_MODEL_TYPE),
            "extra_info": pa.array([r["extra_info"] for r in rows]),
        }
    )
    with atomic_path(path) as temp:
        pq.write_table(table, temp)


def rl_task_from_trajectory(trajectory: Trajectory, split: str) -> RLTask:
    """The RL task of a prepared trajectory, laid out like upstream ``AFM/data/prepare_data.py``.

    ``data_source`` = the trajectory's source, ``prompt`` = its user turn, ``ability`` = its task
    family, ``ground_truth`` = its reference answer (plain string), ``extra_info`` = ``{index (the
    trajectory id), split, question, answer, need_tools_kwargs, tools_kwargs: {tool: {create_kwargs:
    {ground_truth, question, data_source}}}}`` for the task's tools.
    """
    create_kwargs = {
        "ground_truth": trajectory.answer,
        "question": trajectory.question,
        "data_source": trajectory.source,
    }
    return RLTask(
        data_source=trajectory.source,
        prompt=[{"role": "user", "content": trajectory.prompt}],
        ground_truth=trajectory.answer,
        extra_info={
            "index": trajectory.id,
            "split": split,
            "question": trajectory.question,
            "answer": trajectory.answer,
            "need_tools_kwargs": True,
            "tools_kwargs": {tool: {"create_kwargs": dict(create_kwargs)} for tool in TASK_TOOLS[trajectory.task]},
        },
        ability=trajectory.task,
        reward_style="rule",
    )
