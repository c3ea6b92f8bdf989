"""``python -m jobs.sft`` on this machine with the real trainer: rank-0 output and the summary on the terminal,
logs in RUN_DIR/logs, manual resume with ``resume=RUN_DIR``, and a SIGTERM that leaves no process behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import psutil
import pytest

from afm_core.engine.metrics import read_metrics
from afm_core.launch.records import read_events, read_job_record
from afm_core.utils.paths import repo_root, shared_data_dir
from tests.slurm.tiny_sft import TINY, jobs_sft, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not shared_data_dir().is_dir(), reason=f"no shared data at {shared_data_dir()}"),
]


def test_local_run_then_manual_resume(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    out = jobs_sft(*TINY, "trainer.max_steps=3", f"hydra.run.dir={first}")
    assert "[sft] done at step 3/3" in out  # rank 0's own summary, streamed while waiting
    summary = json.loads(out[out.index("\n{") + 1 :])  # then the returned summary
    assert summary["step"] == 3 and summary["stopped_early"] is False and summary["run_dir"] == str(first)
    record = read_job_record(first / "logs")
    assert record["cluster"] == "local" and record["stdout"].startswith(str(first / "logs"))
    assert [e["event"] for e in read_events(first / "logs")] == ["start", "completed"]

    out = jobs_sft(*TINY, "trainer.max_steps=5", f"resume={first}", f"hydra.run.dir={second}")
    summary = json.loads(out[out.index("\n{") + 1 :])
    assert summary["resumed_from"] == str(first / "checkpoints" / "step_00000003") and summary["step"] == 5
    steps = [r["step"] for r in read_metrics(second / "metrics.jsonl") if r["split"] == "train"]
    assert steps == [1, 2, 3, 4, 5]  # the first run's history, then the resumed steps, each once


def test_sigterm_to_a_local_job_stops_every_process_it_started(tmp_path):
    """SIGTERM to ``python -m jobs.sft`` in its training loop: once it has exited, nothing it started runs (the
    submitit controller and the rank); before, it exited at once and left them to stop on their own, if at all."""
    run_dir = tmp_path / "run"
    submitter = subprocess.Popen([sys.executable, "-m", "jobs.sft", *TINY, "trainer.max_steps=100000",
                                  "trainer.num_threads=1", f"hydra.run.dir={run_dir}"], cwd=repo_root(),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        wait_until(lambda: (run_dir / "metrics.jsonl").exists() or submitter.poll() is not None, "a training step", 300)
        assert submitter.poll() is None, submitter.communicate()[1][-3000:]
        started = psutil.Process(submitter.pid).children(recursive=True)
        assert len(started) >= 2  # submitit's controller and the rank
        submitter.send_signal(signal.SIGTERM)
        _, err = submitter.communicate(timeout=60)
    finally:
        if submitter.poll() is None:
            submitter.kill()
    alive = [p for p in started if _running(p)]
    assert submitter.returncode != 0 and alive == [], (alive, err[-3000:])
    assert b"[afm] interrupted: stopping 1 child process(es) and theirs" in err


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
