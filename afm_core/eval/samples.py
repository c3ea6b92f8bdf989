"""``samples.jsonl``: one line per (benchmark, problem, sample), appended as each sample is graded.

The file is the eval's checkpoint: a restarted eval reads it and skips the samples it holds, so nothing is
recomputed or duplicated. A torn last line (a kill mid-write) is dropped (:func:`read_jsonl_log`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from afm_core.utils.atomic import atomic_write_json
from afm_core.utils.jsonlog import read_jsonl_log
from afm_core.utils.tracking import flatten

#: Beside the sample log: the settings its samples were drawn under (:func:`check_sample_settings`).
SETTINGS_FILE = "sample_settings.json"

SampleKey = tuple[str, str, int]


def sample_key(record: dict[str, Any]) -> SampleKey:
    return (record["benchmark"], str(record["problem_id"]), int(record["sample"]))


def samples_todo(benchmarks: Iterable[Any], k_of: Callable[[Any], int], done: Iterable[SampleKey] = ()) -> list[Any]:
    """Every ``(task, sample index)`` of ``benchmarks`` (objects with ``.name`` and ``.tasks``; ``k_of(bench)``
    samples each) whose key is not in ``done``, problem-major: the samples of a problem follow one another, as
    verl's ``DataProto.repeat(interleave=True)`` lays out rollout.n. They are then in flight together, so the
    engine's prefix cache serves their shared prompt, and a stopped run leaves whole problems (a complete pass@k,
    what RL prompt filtering reads) rather than sample 0 of every problem."""
    skip = set(done)  # empty: tasks need no problem_id (RL validation's)
    return [(task, sample) for bench in benchmarks for task in bench.tasks for sample in range(k_of(bench))
            if not skip or (bench.name, str(task.meta["problem_id"]), sample) not in skip]  # fmt: skip


def check_sample_settings(
    run_dir: str | Path, settings: Mapping[str, Any], resuming: bool, *, record: bool = True, what: str = "samples"
) -> None:
    """Record what decides a sample (model, seeds, sampling and agent limits) in ``run_dir/sample_settings.json``,
    and refuse to add samples drawn under other settings to a log that holds some. Eval and RL filtering guard
    ``samples.jsonl`` with it, distillation its ``runs.jsonl`` (:func:`afm_core.distill.runner.check_resume`).

    ``settings``: ``{"model": ..., "engine": {...}, "eval": {...}, "benchmarks": {name: {...}}}`` (JSON values).
    Top-level entries must match the recorded ones; under ``benchmarks`` only the benchmarks both hold are compared
    (a benchmark added to a resumed run has no samples yet; one left out keeps its record). Settings that do not
    change a sample (``k``, ``limit``, ``concurrency``, timeouts) do not belong here: raising ``k`` or ``limit`` on a
    resume adds samples, as it should. A log without a settings file (written before it existed) is adopted as is.

    Args:
        resuming: the sample log already holds records.
        record: write the settings file (False: only check, e.g. before the job is queued).
        what: what the log holds, for the message ("samples", "runs").

    Raises:
        ValueError: a resumed log was sampled under other settings; names the file and each field (old -> new).
    """
    path = Path(run_dir) / SETTINGS_FILE
    new = json.loads(json.dumps(settings, sort_keys=True, default=str))
    old = json.loads(path.read_text(encoding="utf-8")) if resuming and path.is_file() else None
    if old is not None:
        old_benches, new_benches = old.get("benchmarks") or {}, new.get("benchmarks") or {}
        shared = set(old_benches) & set(new_benches)
        before = flatten({**old, "benchmarks": {name: old_benches[name] for name in shared}})
        after = flatten({**new, "benchmarks": {name: new_benches[name] for name in shared}})
        changed = [f"{key}: {before.get(key)!r} -> {after.get(key)!r}"
                   for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)]  # fmt: skip
        if changed:
            raise ValueError(
                f"{path}: the {what} in {path.parent} were drawn under other settings ({'; '.join(changed)}); "
                "resuming would mix the two in one result. Restore those settings, or start a new run dir "
                "(hydra.run.dir=...)"
            )
        if old_benches or new_benches:
            new["benchmarks"] = {**old_benches, **new_benches}
    if record:
        atomic_write_json(path, new)


def read_samples(path: str | Path) -> list[dict[str, Any]]:
    """The complete, distinct sample records of ``path`` (the first of duplicate keys wins)."""
    seen: set[SampleKey] = set()
    records = []
    for record in read_jsonl_log(path):
        key = sample_key(record)
        if key not in seen:
            seen.add(key)
            records.append(record)
    return records


class SampleWriter:
    """Appends sample records to ``samples.jsonl``, one flushed line each; drops a torn tail first."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            data = self.path.read_bytes()
            if data and not data.endswith(b"\n"):  # a torn last line: cut it before appending
                with self.path.open("r+b") as handle:
                    handle.truncate(data.rfind(b"\n") + 1)
        self._handle = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._handle.flush()

    def write_many(self, records: Iterable[dict[str, Any]]) -> None:
        for record in records:
            self.write(record)

    def close(self) -> None:
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
