"""The real SFT job at test size, run through its CLI (``python -m jobs.sft``), and what the Slurm tests read back."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from afm_core.engine.metrics import read_metrics
from afm_core.launch.records import read_events, read_job_record
from afm_core.launch.status import TERMINAL_STATES, collect, slurm_states
from afm_core.utils.paths import repo_root

TINY = [  # tiny-llama on a 114-trajectory slice of the real traces (its own cache dir, prepared once)
    "model=tiny-llama",
    "data.name=jobs-tests",
    "data.sources.gsm8k=60",
    "data.sources.fireact=20",
    "data.sources.r1searcher=20",
    "data.sources.tora=20",
    "trainer.global_batch_size=2",
    "trainer.eval_interval=1000",
    "trainer.eval_sequences=2",
    "trainer.save_interval=1000",
    "trainer.keep_last=1",
    "trainer.progress=false",
]


def jobs_sft(*overrides: str) -> str:
    """Run ``python -m jobs.sft *overrides``; its stdout (the test fails on a non-zero exit)."""
    done = subprocess.run(
        [sys.executable, "-m", "jobs.sft", *overrides], cwd=repo_root(), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"jobs.sft {' '.join(overrides)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def submit_slurm(run_dir: Path, *overrides: str) -> str:
    """Submit an SFT job to Slurm (returns at once); its job id."""
    out = jobs_sft(*TINY, "cluster=slurm", "cluster.time=20", f"hydra.run.dir={run_dir}", *overrides)
    job_id = read_job_record(run_dir / "logs")["job_id"]
    assert f"Submitted Slurm job {job_id}" in out and f"python -m jobs.status {run_dir} --follow" in out
    return job_id


def cluster_snapshot(run_dir: Path | None = None) -> str:
    """What the cluster says now, for a timeout's message: the queue with pending reasons, the nodes' states and
    reasons, and the tails of the run's rank-0 logs (when ``run_dir`` has a job record)."""
    commands = [
        ["squeue", "-a", "-o", "%.12i %.9P %.8T %.10M %.6D %R"],
        ["sinfo", "-N", "-o", "%N %P %T %C %E"],
    ]
    parts = []
    for command in commands:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        parts.append(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}")
    if run_dir is not None and (run_dir / "logs" / "job.json").is_file():
        record = read_job_record(run_dir / "logs")
        for key in ("stdout", "stderr"):
            log = Path(record[key])
            tail = log.read_text(errors="replace")[-3000:] if log.is_file() else "(absent)"
            parts.append(f"--- {log} (last 3000 characters)\n{tail}")
    return "\n".join(parts)


def wait_until(
    condition, what: str, timeout_s: float = 600.0, poll_s: float = 0.1, run_dir: Path | None = None
) -> None:
    """Poll ``condition`` until it holds; past ``timeout_s`` a TimeoutError with :func:`cluster_snapshot`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}\n{cluster_snapshot(run_dir)}")
        time.sleep(poll_s)


def wait_trained(run_dir: Path, job_id: str, step: int, timeout_s: float = 600.0) -> None:
    """Wait until the run's metrics reach ``step``; fails at once (with the logs) if the job ends before."""

    def reached() -> bool:
        if last_step(run_dir) >= step:
            return True
        state = slurm_states([job_id]).get(job_id)
        assert state not in TERMINAL_STATES, (
            f"job {job_id} ended {state} before step {step}\n{cluster_snapshot(run_dir)}"
        )
        return False

    wait_until(reached, f"job {job_id} to reach step {step}", timeout_s, poll_s=1.0, run_dir=run_dir)


def wait_finished(run_dir: Path, timeout_s: float = 900.0):
    """Wait until Slurm accounting has the run's job in a final state; its status row (COMPLETED asserted)."""
    job_id = read_job_record(run_dir / "logs")["job_id"]
    wait_until(
        lambda: slurm_states([job_id]).get(job_id) in TERMINAL_STATES,
        f"job {job_id} ({run_dir}) to end",
        timeout_s,
        poll_s=2.0,
        run_dir=run_dir,
    )
    row = collect(run_dir)[0]
    assert row.state == "COMPLETED", f"{run_dir}: {row.state}; log {row.stderr}"
    return row


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl") if r["split"] == "train"]


def last_step(run_dir: Path) -> int:
    steps = train_losses(run_dir)
    return steps[-1][0] if steps else 0


def hf_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted((run_dir / "hf").glob("*.safetensors")):
        tensors.update(load_file(path))
    assert tensors, f"no HF export in {run_dir}/hf"
    return tensors


def events_of(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir / "logs") if e["event"] == kind]


def interrupt_with_usr2(run_dir: Path, job_id: str, times: int) -> None:
    """``scancel --signal=USR2`` the job ``times`` times, each a few steps past the last stop (so at different
    steps), waiting for each requeue."""
    target = 0
    for attempt in range(1, times + 1):
        target += 3
        wait_until(
            lambda n=attempt, step=target: len(events_of(run_dir, "start")) == n and last_step(run_dir) >= step,
            f"attempt {attempt} past step {target}",
            run_dir=run_dir,
        )
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
        wait_until(lambda n=attempt: len(events_of(run_dir, "requeued")) == n, f"requeue {attempt}", run_dir=run_dir)
        target = events_of(run_dir, "requeued")[-1]["step"]


def assert_resumed_bitwise(run_dir: Path, reference: Path, job_id: str, times: int, max_steps: int) -> None:
    """The interrupted run completed with ``times`` preemption requeues at distinct steps, every step once with
    the reference's losses, and final weights bitwise equal to the reference's."""
    row = wait_finished(run_dir)
    stops = [e["step"] for e in events_of(run_dir, "requeued")]
    assert len(set(stops)) == times and stops == sorted(stops) and stops[-1] < max_steps
    assert all(e["reason"] == "preempted" for e in events_of(run_dir, "requeued"))  # time=20 >= 13 min
    assert row.restarts == times and row.step == max_steps
    assert train_losses(run_dir) == train_losses(reference)  # every step once, same losses
    expected, resumed = hf_weights(reference), hf_weights(run_dir)
    assert resumed.keys() == expected.keys()
    assert all(torch.equal(resumed[k], expected[k]) for k in expected)
    history = subprocess.run(
        ["sacct", "-D", "-X", "-n", "-P", "-o", "State", "-j", job_id], capture_output=True, text=True, check=True
    ).stdout.split()
    assert history.count("REQUEUED") == times and history[-1] == "COMPLETED"
