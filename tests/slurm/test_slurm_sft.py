"""Acceptance of the job layer on the real local Slurm cluster with the real SFT trainer (tiny-llama, CPU, gloo).

- a 2-task Slurm run with parallel.tp=2 gives the same losses as the local tp=2 run;
- a job in the ``high`` partition preempts a running SFT job, which is requeued, resumes and completes.

Two-node jobs, sweeps, and a job interrupted twice by ``scancel --signal=USR2`` ending bitwise equal to the
uninterrupted run: tests/slurm/test_slurm_two_nodes.py (the same submission, requeue and resume path as one node).

Every run goes through the real CLI: ``python -m jobs.sft ... cluster=slurm``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from afm_core.launch.records import read_job_record
from afm_core.launch.status import slurm_states
from afm_core.utils.paths import shared_data_dir
from tests.slurm.tiny_sft import (
    TINY,
    events_of,
    jobs_sft,
    last_step,
    submit_slurm,
    train_losses,
    wait_finished,
    wait_until,
)

MAX_STEPS = 20
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.usefixtures("slurm_cluster"),
    pytest.mark.skipif(not shared_data_dir().is_dir(), reason=f"no shared data at {shared_data_dir()}"),
]


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


def test_high_partition_preempts_and_the_job_resumes(tmp_path):
    run_dir = tmp_path / "preempted"
    node_cpus = int(
        subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True, check=True).stdout.split()[0]
    )
    job_id = submit_slurm(run_dir, f"cluster.cpus_per_task={node_cpus}", f"trainer.max_steps={MAX_STEPS}")
    wait_until(lambda: last_step(run_dir) >= 2, "the SFT job to train")
    # The `high` job takes a CPU on every node (%D: the partition's node count), so also on the SFT job's.
    nodes = subprocess.run(
        ["sinfo", "-h", "-p", "high", "-o", "%D"], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    high = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-p",
            "high",
            "-N",
            nodes,
            "-c",
            "1",
            "-o",
            str(tmp_path / "high.out"),
            "--wrap",
            "sleep 2",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    row = wait_finished(run_dir)

    assert slurm_states([high]) == {high: "COMPLETED"}
    requeues = events_of(run_dir, "requeued")
    assert [e["reason"] for e in requeues] == ["preempted"] and row.restarts == 1
    assert [s for s, _ in train_losses(run_dir)] == list(range(1, MAX_STEPS + 1))
    history = subprocess.run(
        ["sacct", "-D", "-X", "-n", "-P", "-o", "State", "-j", job_id], capture_output=True, text=True, check=True
    ).stdout.split()
    assert history[-1] == "COMPLETED" and len(history) == 2
