"""What the job layer leaves in ``RUN_DIR/logs/`` besides the ranks' logs.

- ``job.json``: the submission record, written atomically by the submitter: ``cluster`` ("local" | "slurm"),
  ``job_id`` (Slurm job id, ``ARRAY_INDEX`` form for sweep members; the controller PID for local jobs),
  ``job_name``, ``world_size``, ``submitted_at`` (unix seconds), ``stdout`` / ``stderr`` (rank 0's log files),
  ``submitit_folder``, ``command`` (argv of the submitter).
- ``events.jsonl``: one line per life event of the job, appended by rank 0: ``start`` (each start, the first and
  every restart after a requeue), ``requeued`` (after the checkpoint, with ``reason`` "preempted" | "timed-out",
  ``step`` and ``signal_time``, the unix seconds at which the job's signal handler ran), ``completed`` (with
  ``step``), ``failed`` (with ``error``). Lines are single ``O_APPEND`` writes.
"""

from __future__ import annotations

import json
import os
import sys
import time
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


def write_job_record(log_dir: str | Path, record: dict[str, Any]) -> Path:
    """Write ``log_dir/job.json`` atomically; returns its path."""
    path = Path(log_dir) / JOB_RECORD
    atomic_write_json(path, record)
    return path


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
