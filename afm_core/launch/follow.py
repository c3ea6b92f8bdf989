"""Stream a job's rank-0 log files to the terminal while waiting for it.

Bytes are copied as written (``\\r`` progress-bar updates included) from ``<job id>_0_log.out`` to stdout and
``<job id>_0_log.err`` to stderr. A requeued Slurm job appends to the same files, so following survives restarts.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

import submitit

STUCK_AFTER_S = 60.0  # a rank finished this long ago while others still run: they wait in a collective


class LogTail:
    """Copy what gets appended to files onto binary streams (from each file's current start).

    Args:
        pairs: ``(file, stream)``; a file that does not exist yet is picked up once it appears.
    """

    def __init__(self, pairs: list[tuple[Path, BinaryIO]]):
        self.pairs = [(Path(path), stream) for path, stream in pairs]
        self.offsets = [0] * len(self.pairs)

    def pump(self) -> None:
        """Copy the new bytes of every file."""
        for i, (path, stream) in enumerate(self.pairs):
            try:
                with path.open("rb") as handle:
                    handle.seek(self.offsets[i])
                    data = handle.read()
            except FileNotFoundError:
                continue
            if data:
                self.offsets[i] += len(data)
                stream.write(data)
                stream.flush()


def rank0_tail(job: submitit.Job[Any]) -> LogTail:
    """A :class:`LogTail` of ``job``'s rank-0 stdout and stderr onto this process's stdout and stderr."""
    return LogTail([(job.paths.stdout, sys.stdout.buffer), (job.paths.stderr, sys.stderr.buffer)])


def wait_streaming(job: submitit.Job[Any], poll_s: float = 0.5, *, cancel_on_interrupt: bool = True) -> Any:
    """Stream rank 0's output until ``job`` ends; return rank 0's result.

    A job whose ranks did not all finish within :data:`STUCK_AFTER_S` seconds of the first one (one rank failed,
    the others wait for it in a collective) is cancelled. Ctrl-C or SIGTERM cancels the job (with
    ``cancel_on_interrupt``; a local job's submitter stops its processes itself instead:
    :mod:`afm_core.launch.teardown`), then ``KeyboardInterrupt`` is raised.

    Raises:
        submitit.core.utils.FailedJobError: a rank raised (the message holds its traceback).
        submitit.core.utils.UncompletedJobError: the job ended without a result (cancelled, killed, out of
            requeues).
    """
    tail = rank0_tail(job)
    tasks = [job.task(k) for k in range(job.num_tasks)]
    first_done_at, cancelled = None, False
    in_main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt) if in_main_thread else None
    try:
        while not job.done():
            tail.pump()
            if first_done_at is None and any(t.paths.result_pickle.exists() for t in tasks):
                first_done_at = time.monotonic()
            if not cancelled and first_done_at is not None and time.monotonic() - first_done_at > STUCK_AFTER_S:
                print(
                    f"[afm] a rank of job {job.job_id} finished {STUCK_AFTER_S:.0f} s ago but others still run "
                    "(stuck in a collective?): cancelling the job",
                    file=sys.stderr,
                )
                job.cancel()
                cancelled = True
            time.sleep(poll_s)
    except KeyboardInterrupt:
        if cancel_on_interrupt:
            print(f"\n[afm] interrupted: cancelling job {job.job_id}", file=sys.stderr)
            job.cancel()
        raise
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_sigterm)
        tail.pump()
    return job.results()[0]


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    """SIGTERM while following (``kill``, a terminal closing) cancels the job like Ctrl-C does."""
    raise KeyboardInterrupt
