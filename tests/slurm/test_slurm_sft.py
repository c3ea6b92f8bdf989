"""Acceptance of the job layer on the real local Slurm cluster with the real SFT trainer (tiny-llama, CPU, gloo).

- a 2-task Slurm run with parallel.tp=2 gives the same losses as the local tp=2 run;
- the same run interrupted 3 times by ``scancel --signal=USR2`` at different steps completes with final weights
  bitwise equal to the uninterrupted run and every step exactly once in metrics.jsonl;
- a job in the ``high`` partition preempts a running SFT job, which is requeued, resumes and completes;
- a sweep of 3 values is one job array; all members complete and ``jobs.status`` shows them.

Every run goes through the real CLI: ``python -m jobs.sft ... cluster=slurm``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from afm_core.launch.records import read_events, read_job_record
from afm_core.launch.status import TERMINAL_STATES, collect, slurm_states
from afm_core.train.metrics import read_metrics
from afm_core.utils.paths import repo_root, shared_data_dir
from tests.slurm.tiny_sft import TINY, jobs_sft

MAX_STEPS = 20
pytestmark = [
    pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster"),
    pytest.mark.skipif(not shared_data_dir().is_dir(), reason=f"no shared data at {shared_data_dir()}"),
]

def submit_slurm(run_dir: Path, *overrides: str) -> str:
    """Submit an SFT job to Slurm (returns at once); its job id."""
    out = jobs_sft(*TINY, "cluster=slurm", "cluster.time=20", f"hydra.run.dir={run_dir}", *overrides)
    job_id = read_job_record(run_dir / "logs")["job_id"]
    assert f"Submitted Slurm job {job_id}" in out and f"python -m jobs.status {run_dir} --follow" in out
    return job_id


def wait_until(condition, what: str, timeout_s: float = 600.0, poll_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(poll_s)


def wait_finished(run_dir: Path, timeout_s: float = 900.0):
    """Wait until Slurm accounting has the run's job in a final state; its status row (COMPLETED asserted)."""
    job_id = read_job_record(run_dir / "logs")["job_id"]
    wait_until(lambda: slurm_states([job_id]).get(job_id) in TERMINAL_STATES, f"job {job_id} ({run_dir}) to end",
               timeout_s, poll_s=2.0)
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


@pytest.fixture(scope="module")
def uninterrupted_tp2(tmp_path_factory) -> Path:
    """A 2-task, tp=2 SFT run on Slurm, never interrupted."""
    run_dir = tmp_path_factory.mktemp("slurm") / "tp2"
    submit_slurm(run_dir, "cluster.tasks_per_node=2", "parallel.tp=2", f"trainer.max_steps={MAX_STEPS}")
    wait_finished(run_dir)
    return run_dir


def test_slurm_tp2_matches_local_tp2(uninterrupted_tp2, tmp_path):
    local = tmp_path / "local-tp2"
    out = jobs_sft(*TINY, "parallel.tp=2", f"trainer.max_steps={MAX_STEPS}", f"hydra.run.dir={local}")
    assert "held-out masked loss" in out  # rank 0's summary, streamed to the terminal

    slurm_losses = train_losses(uninterrupted_tp2)
    assert [s for s, _ in slurm_losses] == list(range(1, MAX_STEPS + 1))
    assert slurm_losses == train_losses(local)
    assert read_job_record(uninterrupted_tp2 / "logs")["world_size"] == 2


def test_three_usr2_interrupts_resume_bitwise(uninterrupted_tp2, tmp_path):
    run_dir = tmp_path / "interrupted"
    job_id = submit_slurm(run_dir, "cluster.tasks_per_node=2", "parallel.tp=2", f"trainer.max_steps={MAX_STEPS}")
    target = 0
    for attempt in (1, 2, 3):
        target += 3  # a few steps past the last checkpoint: every interrupt lands at a different step
        wait_until(lambda: len(events_of(run_dir, "start")) == attempt and last_step(run_dir) >= target,
                   f"attempt {attempt} past step {target}")
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
        wait_until(lambda: len(events_of(run_dir, "requeued")) == attempt, f"requeue {attempt}")
        target = events_of(run_dir, "requeued")[-1]["step"]
    row = wait_finished(run_dir)

    stops = [e["step"] for e in events_of(run_dir, "requeued")]
    assert len(set(stops)) == 3 and stops == sorted(stops) and stops[-1] < MAX_STEPS
    assert all(e["reason"] == "preempted" for e in events_of(run_dir, "requeued"))  # time=20 >= 13 min
    assert row.restarts == 3 and row.step == MAX_STEPS
    assert train_losses(run_dir) == train_losses(uninterrupted_tp2)  # every step once, same losses
    reference = hf_weights(uninterrupted_tp2)
    resumed = hf_weights(run_dir)
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[k], reference[k]) for k in reference)
    history = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-o", "State", "-j", job_id], capture_output=True,
                             text=True, check=True).stdout.split()
    assert history.count("REQUEUED") == 3 and history[-1] == "COMPLETED"


def test_high_partition_preempts_and_the_job_resumes(tmp_path):
    run_dir = tmp_path / "preempted"
    node_cpus = int(subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True, check=True)
                    .stdout.split()[0])
    job_id = submit_slurm(run_dir, f"cluster.cpus_per_task={node_cpus}", f"trainer.max_steps={MAX_STEPS}")
    wait_until(lambda: last_step(run_dir) >= 2, "the SFT job to train")
    high = subprocess.run(["sbatch", "--parsable", "-p", "high", "-c", "1", "-o", str(tmp_path / "high.out"),
                           "--wrap", "sleep 2"], capture_output=True, text=True, check=True).stdout.strip()
    row = wait_finished(run_dir)

    assert slurm_states([high]) == {high: "COMPLETED"}
    requeues = events_of(run_dir, "requeued")
    assert [e["reason"] for e in requeues] == ["preempted"] and row.restarts == 1
    assert [s for s, _ in train_losses(run_dir)] == list(range(1, MAX_STEPS + 1))
    history = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-o", "State", "-j", job_id], capture_output=True,
                             text=True, check=True).stdout.split()
    assert history[-1] == "COMPLETED" and len(history) == 2


def test_sweep_of_three_values_is_one_array(tmp_path):
    sweep = tmp_path / "sweep"
    out = jobs_sft("-m", *TINY, "cluster=slurm", "cluster.array_parallelism=2", "trainer.max_steps=3",
                   "optim.lr=1e-4,2e-4,4e-4", f"hydra.sweep.dir={sweep}")
    records = [read_job_record(sweep / str(i) / "logs") for i in range(3)]
    array_id = records[0]["job_id"].split("_")[0]
    assert [r["job_id"] for r in records] == [f"{array_id}_{i}" for i in range(3)]
    assert f"Submitted Slurm job array {array_id}: 3 members, at most 2 at once" in out

    for i in range(3):
        wait_finished(sweep / str(i))
    lrs = [OmegaConf.load(sweep / str(i) / ".hydra" / "config.yaml").optim.lr for i in range(3)]
    assert lrs == [1e-4, 2e-4, 4e-4]  # one run dir (config, metrics, checkpoints) per member
    status = subprocess.run([sys.executable, "-m", "jobs.status", str(sweep)], cwd=repo_root(),
                            capture_output=True, text=True, check=True).stdout
    assert status.count("COMPLETED") == 3 and all(f"slurm:{array_id}_{i}" in status for i in range(3))
    assert status.count("3/3") == 3
