"""Benchmarks as :class:`~afm_core.rollout.AgentTask` lists: presets (``conf/eval_benchmarks/<name>.yaml``) and user files.

A preset names a loader, a data file (relative to the shared data folder unless absolute), the CoA task
family, the grader, optional per-benchmark sampling settings and, for GSM8K, ``max_calculator_steps`` (keep the
problems whose reference uses at most that many calculator steps). A test-only set (SVAMP, MAWPS) is split by the
preset into disjoint RL prompts and held-out problems (``split``, ``heldout_size``, ``split_seed``:
:func:`split_problems`), after repeated questions are dropped. A user file (``benchmark_files=[...]``)
is read as the AFM/verl RL layout, parquet or JSON lines: ``prompt`` (chat messages), ``data_source``,
``ability``, ``reward_model.ground_truth``, ``extra_info``; its grader is chosen from ``data_source`` /
``ability`` (:func:`afm_core.rewards.grader_kind`) and its prompt is used as written.

A malformed record never stops a benchmark: it is reported with file, line (or record) and field, skipped,
and counted in :attr:`Benchmark.skipped`.
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from afm_core.coa.prompts import TASKS, user_prompt
from afm_core.data.formats import rl_task_from_row
from afm_core.data.io import DataFormatError, Where, read_jsonl, require
from afm_core.data.schema import task_id
from afm_core.rewards.code import BadTestsError, code_tests_from_ground_truth, humaneval_tests, mbpp_tests
from afm_core.rewards.grader import GRADER_KINDS, grader_kind
from afm_core.rollout.types import AgentTask
from afm_core.utils.paths import repo_root, shared_data_dir

log = logging.getLogger(__name__)

#: Keys of a preset file; the sampling keys are null to use the run's ``eval.*`` defaults.
PRESET_KEYS = ("name", "loader", "path", "task", "grader", "k", "temperature", "top_p", "max_response_tokens",
               "max_tool_calls", "skip", "limit", "max_calculator_steps", "split", "heldout_size", "split_seed",
               "description")  # fmt: skip
SPLITS = ("heldout", "train")
SAMPLING_KEYS = ("k", "temperature", "top_p", "max_response_tokens", "max_tool_calls", "limit")


@dataclass
class Benchmark:
    """A loaded benchmark.

    Attributes:
        name: the benchmark's name (the preset name, or the file stem for a user file).
        tasks: the problems, in file order; ``task.meta`` holds ``benchmark``, ``grader``, ``level`` and, for
            code, ``tests`` (:class:`~afm_core.rewards.CodeTests` as a dict).
        settings: per-benchmark sampling overrides (``k``, ``temperature``, ``top_p``, ``max_response_tokens``,
            ``max_tool_calls``, ``limit``), only the ones set.
        skipped: one message per malformed record (file, line or record, field).
        source: where the problems were read from (the data file's path).
    """

    name: str
    tasks: list[AgentTask]
    settings: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    source: str = ""


def presets_dir() -> Path:
    return repo_root() / "conf" / "eval_benchmarks"


def available_presets() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def read_preset(name: str) -> dict[str, Any]:
    """``conf/eval_benchmarks/<name>.yaml`` as a dict.

    Raises:
        ValueError: unknown preset (lists the available ones), unknown keys, a bad loader/task/grader.
    """
    path = presets_dir() / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(
            f"unknown benchmark {name!r}: {path} does not exist (available: {', '.join(available_presets())})"
        )
    values = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(values) - set(PRESET_KEYS))
    if unknown:
        raise ValueError(f"{path}: unknown field {unknown[0]!r} (fields: {', '.join(PRESET_KEYS)})")
    if values.get("loader") not in LOADERS:
        raise ValueError(f"{path}: field 'loader' must be one of {', '.join(LOADERS)}, got {values.get('loader')!r}")
    if values.get("task") not in TASKS:
        raise ValueError(f"{path}: field 'task' must be one of {', '.join(TASKS)}, got {values.get('task')!r}")
    if values.get("grader") not in GRADER_KINDS:
        raise ValueError(
            f"{path}: field 'grader' must be one of {', '.join(GRADER_KINDS)}, got {values.get('grader')!r}"
        )
    split = values.get("split")
    if split is not None and split not in SPLITS:
        raise ValueError(f"{path}: field 'split' must be one of {', '.join(SPLITS)} or null, got {split!r}")
    size = values.get("heldout_size")
    if (split is None) != (size is None) or (size is not None and (isinstance(size, bool) or not isinstance(size, int)
                                                                    or size < 1)):  # fmt: skip
        raise ValueError(
            f"{path}: field 'heldout_size' is a positive integer exactly when 'split' is set, got {size!r}"
        )
    steps = values.get("max_calculator_steps")
    if steps is not None and (values["loader"] != "gsm8k" or isinstance(steps, bool) or not isinstance(steps, int)):
        raise ValueError(f"{path}: field 'max_calculator_steps' is an integer for the gsm8k loader, got {steps!r}")
    return values


def _records(path: Path, skipped: list[str]) -> Iterator[tuple[Where, dict[str, Any]]]:
    """Records of a ``.jsonl``/``.jsonl.gz``/``.json``/``.parquet`` file; malformed lines go to ``skipped``."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        for index, row in enumerate(pq.read_table(path).to_pylist()):
            yield Where(path, record=index), row
    elif name.endswith(".json"):
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise DataFormatError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        for index, record in enumerate(data):
            if isinstance(record, dict):
                yield Where(path, record=index), record
            else:
                skipped.append(f"{Where(path, record=index)}: expected a JSON object, got {type(record).__name__}")
    else:
        yield from read_jsonl(path, skipped)


def _task(
    name: str, index: Any, task: str, prompt: str, question: str, answer: str, grader: str, **meta: Any
) -> AgentTask:
    return AgentTask(id=f"{name}:{index}", task=task, prompt=prompt, question=question, answer=answer,
                     meta={"benchmark": name, "grader": grader, "problem_id": str(index), **meta})  # fmt: skip


def _gsm8k(where: Where, r: Mapping[str, Any], name: str, task: str, grader: str, index: int) -> AgentTask:
    question = require(r, "question", str, where)
    answer = require(r, "answer", str, where)
    if "####" not in answer:
        raise where.error("field 'answer' has no '####' final answer")
    gold = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return _task(
        name, index, task, user_prompt(task, question), question, gold, grader, calculator_steps=answer.count("<<")
    )  # the reference's <<a*b=c>> annotations


def _number(value: Any, where: Where, field_name: str) -> str:
    """A numeric answer as the grader's gold text: ``145.0`` -> ``"145"``, ``0.25`` -> ``"0.25"``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise where.error(f"field {field_name!r} is not a number: {value!r}") from None
    return str(int(number)) if number.is_integer() else repr(number)


def _svamp(where: Where, r: Mapping[str, Any], name: str, task: str, grader: str, index: int) -> AgentTask:
    """SVAMP (Patel et al., 2021, NAACL): ``Body`` + ``Question``, gold ``Answer``; ``Equation`` kept in meta."""
    question = f"{require(r, 'Body', str, where).strip()} {require(r, 'Question', str, where).strip()}"
    answer = _number(require(r, "Answer", (int, float, str), where), where, "Answer")
    return _task(name, r.get("ID", index), task, user_prompt(task, question), question, answer, grader,
                 equation=str(r.get("Equation", "")), level=str(r.get("Type", "")))  # fmt: skip


def _mawps(where: Where, r: Mapping[str, Any], name: str, task: str, grader: str, index: int) -> AgentTask:
    """MAWPS (Koncel-Kedziorski et al., 2016, NAACL) as math-evaluation-harness ships it: ``input``, ``target``."""
    question = require(r, "input", str, where).strip()
    answer = _number(require(r, "target", (int, float, str), where), where, "target")
    return _task(name, index, task, user_prompt(task, question), question, answer, grader, level=str(r.get("type", "")))


def question_key(question: str) -> str:
    """A question's identity for finding repeats: :func:`~afm_core.data.schema.task_id` (the id the SFT split and
    the RL prompt filter compare questions by) after dropping the spaces before punctuation that MAWPS's subsets
    differ by (``"beach ."`` for ``"beach."``)."""
    return task_id(re.sub(r"\s+([.,?!;:])", r"\1", question))


def split_problems(tasks: list[AgentTask], split: str, heldout_size: int, seed: int) -> list[AgentTask]:
    """One side of a fixed-seed split of a test-only set into held-out problems and RL prompts (disjoint).

    Repeated questions (:func:`question_key`) are dropped first, keeping the first; the rest are shuffled with
    ``random.Random(seed)`` and the first ``heldout_size`` are the held-out side, the others the train side; each
    side is returned in file order.

    Raises:
        ValueError: ``heldout_size`` leaves no train problem.
    """
    first: dict[str, AgentTask] = {}
    for task in tasks:
        first.setdefault(question_key(task.question), task)
    unique = list(first.values())
    if heldout_size >= len(unique):
        raise ValueError(f"heldout_size {heldout_size} leaves no train problem ({len(unique)} distinct questions)")
    order = list(range(len(unique)))
    random.Random(seed).shuffle(order)
    heldout = set(order[:heldout_size])
    return [t for i, t in enumerate(unique) if (i in heldout) == (split == "heldout")]


def _math_jsonl(where: Where, r: Mapping[str, Any], name: str, task: str, grader: str, index: int) -> AgentTask:
    question = require(r, "problem", str, where)
    answer = str(require(r, "answer", (str, int, float), where))
    return _task(name, r.get("unique_id", index), task, user_prompt(task, question), question, answer, grader,
                 level=str(r.get("level", "")), subject=r.get("subject"))  # fmt: skip


def _humaneval(where: Where, r: Mapping[str, Any], name: str, task: str, grader: str, index: int) -> AgentTask:
    stub = require(r, "prompt", str, where)
    require(r, "test", str, where)
    entry = require(r, "entry_point", str, where)
    question = (f"Complete the Python function `{entry}` below. The final answer is the complete function "
                f"(its imports, signature and body) in one ```py block.\n\n```py\n{stub.strip()}\n```")  # fmt: skip
    return _task(name, require(r, "task_id", str, where), task, user_prompt(task, question), question, "", grader,
                 tests=humaneval_tests(r).to_dict(), entry_point=entry)  # fmt: skip


def _mbpp(where: Where, r: Mapping[str, Any], name: str, task: str, grader: str, index: int) -> AgentTask:
    text = require(r, "prompt", str, where)
    tests = require(r, "test_list", list, where)
    if not tests:
        raise where.error("field 'test_list' is empty")
    question = (f"{text.strip()}\nYour function must pass tests like: {tests[0]}\nThe final answer is the complete "
                "function in one ```py block.")  # fmt: skip
    return _task(name, require(r, "task_id", (int, str), where), task, user_prompt(task, question), question, "",
                 grader, tests=mbpp_tests(r).to_dict())  # fmt: skip


def _hotpotqa(where: Where, r: Mapping[str, Any], name: str, task: str, grader: str, index: int) -> AgentTask:
    question = require(r, "question", str, where)
    golds = require(r, "golden_answers", list, where)
    if not golds:
        raise where.error("field 'golden_answers' is empty")
    return _task(name, r.get("id", index), task, user_prompt(task, question), question, "|".join(map(str, golds)),
                 grader, level=str(r.get("level", "")))  # fmt: skip


def _rl_record(
    where: Where, r: Mapping[str, Any], name: str, task: str | None, grader: str | None, index: int
) -> AgentTask:
    """A record of the AFM/verl RL layout (a JSON line holds the same fields as a parquet row)."""
    row = dict(r)
    for key in ("reward_model", "extra_info", "prompt"):  # jsonl writers sometimes store these as JSON text
        if isinstance(row.get(key), str) and row[key].strip()[:1] in "{[":
            try:
                row[key] = json.loads(row[key])
            except json.JSONDecodeError:
                pass
    rl = rl_task_from_row(row, where)
    kind = grader or grader_kind(rl.data_source, rl.ability)
    family = task or {"math": "math", "code": "code", "qa": "mhqa"}.get(kind, "web")
    users = [m["content"] for m in rl.prompt if m.get("role") == "user"]
    if not users:
        raise where.error("field 'prompt': no user message")
    systems = [m["content"] for m in rl.prompt if m.get("role") == "system"]
    meta: dict[str, Any] = {"data_source": rl.data_source, "ability": rl.ability,
                            "level": str(rl.extra_info.get("difficulty") or rl.extra_info.get("level") or "")}  # fmt: skip
    answer = rl.ground_truth
    if kind == "code":
        try:
            meta["tests"] = code_tests_from_ground_truth(rl.ground_truth).to_dict()
        except BadTestsError as e:
            raise where.error(f"field 'reward_model.ground_truth': {e}") from None
        answer = ""
    return AgentTask(id=f"{name}:{rl.index}", task=family, prompt=users[-1], question=rl.question, answer=answer,
                     system=systems[0] if systems else None,
                     meta={"benchmark": name, "grader": kind, "problem_id": rl.index, **meta})  # fmt: skip


LOADERS: dict[str, Callable[..., AgentTask]] = {
    "gsm8k": _gsm8k,
    "math_jsonl": _math_jsonl,
    "humaneval": _humaneval,
    "mbpp": _mbpp,
    "hotpotqa": _hotpotqa,
    "svamp": _svamp,
    "mawps": _mawps,
    "rl_file": _rl_record,
}


def _load(
    name: str, path: Path, loader: str, task: str | None, grader: str | None
) -> tuple[list[AgentTask], list[str]]:
    skipped: list[str] = []
    tasks: list[AgentTask] = []
    seen: set[str] = set()
    for index, (where, record) in enumerate(_records(path, skipped)):
        try:
            item = LOADERS[loader](where, record, name, task, grader, index)
        except DataFormatError as e:
            skipped.append(str(e))
            continue
        if item.id in seen:
            skipped.append(f"{where}: duplicate problem id {item.id!r}")
            continue
        seen.add(item.id)
        tasks.append(item)
    for message in skipped:
        log.warning("benchmark %s: skipped %s", name, message)
    return tasks, skipped


def within_calculator_steps(tasks: list[AgentTask], max_steps: int) -> list[AgentTask]:
    """The GSM8K tasks whose reference solution has at most ``max_steps`` ``<<a*b=c>>`` calculator annotations
    (``task.meta["calculator_steps"]``), in order: the short problems a small model can solve with ``<code>``."""
    return [t for t in tasks if t.meta.get("calculator_steps", 0) <= max_steps]


def load_preset(name: str, data_dir: Path | None = None) -> Benchmark:
    """A preset benchmark (``conf/eval_benchmarks/<name>.yaml``).

    Raises:
        ValueError: a bad preset (see :func:`read_preset`).
        FileNotFoundError: its data file is absent.
    """
    preset = read_preset(name)
    path = Path(preset["path"])
    if not path.is_absolute():
        path = (data_dir or shared_data_dir()) / path
    if not path.is_file():
        raise FileNotFoundError(
            f"benchmark {name}: data file {path} not found (conf/eval_benchmarks/{name}.yaml: field 'path')"
        )
    loader = preset["loader"]
    grader = None if loader == "rl_file" and preset.get("grader") is None else preset["grader"]
    tasks, skipped = _load(name, path, loader, preset["task"], grader)
    tasks = tasks[int(preset.get("skip") or 0) :]  # the file's first records (e.g. another job's training data)
    if preset.get("max_calculator_steps") is not None:
        tasks = within_calculator_steps(tasks, preset["max_calculator_steps"])
    if preset.get("split") is not None:
        tasks = split_problems(tasks, preset["split"], preset["heldout_size"], int(preset.get("split_seed") or 0))
    settings = {k: preset[k] for k in SAMPLING_KEYS if preset.get(k) is not None}
    return Benchmark(name, tasks, settings, skipped, source=f"preset {name}: {path}")


def load_file(path: str | Path) -> Benchmark:
    """A user's benchmark file in the AFM/verl RL layout (``.parquet``, ``.jsonl``, ``.jsonl.gz`` or ``.json``).

    Raises:
        FileNotFoundError: no such file.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"benchmark file {path} not found (benchmark_files)")
    name = re.sub(r"\.(jsonl|json|parquet)(\.gz)?$", "", path.name)
    tasks, skipped = _load(name, path, "rl_file", None, None)
    return Benchmark(name, tasks, {}, skipped, source=f"file {path}")


def load_sources(
    presets: Sequence[str] | None,
    files: Sequence[str | Path] | None,
    data_dir: str | Path | None,
    *,
    empty: str,
    unique: bool = True,
) -> list[Benchmark]:
    """The one task loader of eval, distillation, RL and the RL prompt filter: the ``presets`` (read with
    ``data_dir``, default :func:`~afm_core.utils.paths.shared_data_dir`) then the user ``files``, in order.

    Args:
        empty: the error message when neither names a source (names the config fields to set).
        unique: refuse two sources with the same name (their results are reported by name).
    Raises:
        ValueError: no source (``empty``), an unknown preset, or (``unique``) two sources with the same name.
        FileNotFoundError: a missing data file.
    """
    root = Path(data_dir) if data_dir else None
    benchmarks = [load_preset(name, root) for name in presets or []]
    benchmarks += [load_file(path) for path in files or []]
    if not benchmarks:
        raise ValueError(empty)
    names = [b.name for b in benchmarks]
    if unique and len(set(names)) != len(names):
        raise ValueError(f"two task sources share a name: {names}")
    return benchmarks
