"""What the job layer leaves in ``RUN_DIR/logs/`` besides the ranks' logs.

- ``job.json``: the submission record, written atomically by the submitter: ``cluster`` ("local" | "slurm"),
  ``job_id`` (Slurm job id, ``ARRAY_INDEX`` form for sweep members; the controller PID for local jobs),
  ``job_name``, ``world_size``, ``submitted_at`` (unix seconds), ``stdout`` / ``stderr`` (rank 0's log files),
  ``submitit_folder``, ``command`` (argv of the submitter); and, once the job has started, ``start``: where its
  latest start runs, written by rank 0 (:func:`afm_core.launch.placement.job_placement`: ``job_id``, ``time``,
  ``world_size``, ``master_addr``, ``master_port``, ``nodelist``, ``nodes``, ``ranks`` = {node: [rank, ...]}).
  Both writers merge under an ``flock`` on ``job.json.lock`` (a job may start before its submitter has written
  the record); a ``start`` of another job id (an earlier job of the same run dir) is dropped.
- ``events.jsonl``: one line per life event of the job, appended by rank 0: ``start`` (each start, the first and
  every restart after a requeue), ``requeued`` (after the checkpoint, with ``reason`` "preempted" | "timed-out",
  ``step`` and ``signal_time``, the unix seconds at which the job's signal handler ran), ``completed`` (with
  ``step``), ``failed`` (with ``error``). Lines are single ``O_APPEND`` writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from afm_core.utils.atomic import atomic_write_json
from afm_core.utils.jsonlog import read_jsonl_log

JOB_RECORD = "job.json"
EVENTS = "events.jsonl"


def job_record(job: Any, job_name: str, cluster: str, world_size: int) -> dict[str, Any]:
    """The ``job.json`` content for a just-submitted ``submitit.Job``."""
    return {
        "cluster": cluster,
        "job_id": str(job.job_id),
        "job_name": job_name,
        "world_size": world_size,
        "submitted_at": time.time(),
        "stdout": str(job.paths.stdout),
        "stderr": str(job.paths.stderr),
        "submitit_folder": str(job.paths.folder),
        "command": sys.argv,
    }


@contextlib.contextmanager
def _record_lock(log_dir: Path) -> Iterator[None]:
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{JOB_RECORD}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_job_record(log_dir: str | Path, record: dict[str, Any]) -> Path:
    """Write the submitter's ``log_dir/job.json`` atomically (keeping the ``start`` of the same job); its path."""
    log_dir = Path(log_dir)
    with _record_lock(log_dir):
        start = (read_job_record(log_dir) or {}).get("start")
        if start and start.get("job_id") == record["job_id"]:
            record = {**record, "start": start}
        atomic_write_json(log_dir / JOB_RECORD, record)
    return log_dir / JOB_RECORD


def record_start(log_dir: str | Path, start: dict[str, Any]) -> Path:
    """Set ``start`` (with its ``job_id``) in ``log_dir/job.json`` atomically.

    If the submitter has not written this job's record yet, the start waits in the old record (or in a record
    holding only ``start``) and the submitter keeps it (:func:`write_job_record`).
    """
    log_dir = Path(log_dir)
    with _record_lock(log_dir):
        record = read_job_record(log_dir) or {}
        atomic_write_json(log_dir / JOB_RECORD, {**record, "start": start})
    return log_dir / JOB_RECORD


def current_start(record: dict[str, Any]) -> dict[str, Any] | None:
    """The record's ``start`` if it belongs to the record's job, else None (not started yet)."""
    start = record.get("start")
    return start if start and start.get("job_id") == record.get("job_id") else None


def read_job_record(log_dir: str | Path) -> dict[str, Any] | None:
    """``log_dir/job.json``, or None when absent.

    Raises:
        ValueError: the file is not a JSON object (names the file).
    """
    path = Path(log_dir) / JOB_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:1: expected a JSON object, got {type(record).__name__}")
    return record


def append_event(log_dir: str | Path, event: str, **fields: Any) -> None:
    """Append ``{"event": event, "time": <unix s>, **fields}`` as one line to ``log_dir/events.jsonl``."""
    path = Path(log_dir) / EVENTS
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"event": event, "time": time.time(), **fields}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    try:
        os.write(fd, line.encode("utf-8"))
    finally:
        os.close(fd)


def read_events(log_dir: str | Path) -> list[dict[str, Any]]:
    """All complete lines of ``log_dir/events.jsonl`` (a torn last line is skipped); [] when absent.

    Raises:
        ValueError: a line other than the last is not JSON (names the file and line).
    """
    return read_jsonl_log(Path(log_dir) / EVENTS)
