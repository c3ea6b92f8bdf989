"""``samples.jsonl``: one line per (benchmark, problem, sample), appended as each sample is graded.

The file is the eval's checkpoint: a restarted eval reads it and skips the samples it holds, so nothing is
recomputed or duplicated. A torn last line (a kill mid-write) is dropped (:func:`read_jsonl_log`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from afm_core.utils.jsonlog import read_jsonl_log

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
