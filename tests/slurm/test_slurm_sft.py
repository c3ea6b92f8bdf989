"""Acceptance of the job layer on the real local Slurm cluster with the real SFT trainer (tiny-llama, CPU, gloo).

- a 2-task parallel.tp=2 SFT job that fills its node is preempted by a job in the ``high`` partition, requeued,
  resumed, and completes with the losses of the same tp=2 run made locally (one job proves both: the Slurm launch
  and the requeue change no arithmetic).

Two-node jobs, sweeps, and a job interrupted by ``scancel --signal=USR2`` ending bitwise equal to the
uninterrupted run: tests/slurm/test_slurm_two_nodes.py (the same submission, requeue and resume path as one node).

Every run goes through the real CLI: ``python -m jobs.sft ... cluster=slurm``.
"""

from __future__ import annotations

import subprocess

import pytest

from afm_core.launch.records import read_job_record
from afm_core.launch.status import slurm_states
from afm_core.utils.paths import shared_data_dir
from tests.slurm.tiny_sft import (
    TINY,
    events_of,
    jobs_sft,
    submit_slurm,
    train_losses,
    wait_finished,
    wait_trained,
)

MAX_STEPS = 20
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.usefixtures("slurm_cluster"),
    pytest.mark.skipif(not shared_data_dir().is_dir(), reason=f"no shared data at {shared_data_dir()}"),
]


# One job for what test_slurm_tp2_matches_local_tp2 (an uninterrupted tp=2 job) and
# test_high_partition_preempts_and_the_job_resumes (a one-rank job) asserted: a Slurm job less in CI.
def test_a_tp2_job_preempted_by_the_high_partition_resumes_to_the_local_tp2_runs_losses(tmp_path):
    run_dir = tmp_path / "preempted"
    node_cpus = int(
        subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True, check=True).stdout.split()[0]
    )
    # two ranks that take every CPU of their node; one torch thread each, as the local run below
    tp2 = ["parallel.tp=2", "trainer.num_threads=1", f"trainer.max_steps={MAX_STEPS}"]
    job_id = submit_slurm(run_dir, "cluster.tasks_per_node=2", f"cluster.cpus_per_task={node_cpus // 2}", *tp2)
    wait_trained(run_dir, job_id, 2)
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
    assert read_job_record(run_dir / "logs")["world_size"] == 2
    history = subprocess.run(
        ["sacct", "-D", "-X", "-n", "-P", "-o", "State", "-j", job_id], capture_output=True, text=True, check=True
    ).stdout.split()
    assert history[-1] == "COMPLETED" and len(history) == 2

    local = tmp_path / "local-tp2"
    out = jobs_sft(*TINY, *tp2, f"hydra.run.dir={local}")
    assert "held-out masked loss" in out  # rank 0's summary, streamed to the terminal
    slurm_losses = train_losses(run_dir)
    assert [s for s, _ in slurm_losses] == list(range(1, MAX_STEPS + 1))  # every step once
    assert slurm_losses == train_losses(local)
