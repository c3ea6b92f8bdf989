"""Multi-node jobs on the real local two-node Slurm cluster (afm-n1, afm-n2) with the real SFT trainer.

- ``cluster.nodes=2 cluster.tasks_per_node=1 parallel.pp=2``: one pipeline stage per node, the same losses as the
  local pp=2 run (<= 1e-6); data parallelism across the nodes (DP=2) likewise against the local ``cluster.dp=2`` run;
  the rank -> node map, MASTER_ADDR and world size are in the ranks' logs, in ``job.json`` and in ``jobs.status``;
- the same two-node job, preempted with ``scancel --signal=USR2``, ends bitwise equal to the uninterrupted run
  with every step once in metrics.jsonl (once: a resume of a resumed run is tested in process by
  tests/test_train_engine.py::test_exact_resume_after_two_preemption_signals, two requeues of one job by
  tests/test_jobs_launch.py::test_local_preemption_checkpoints_at_a_step_boundary_and_resumes);
- a three-member sweep with ``cluster.nodes=2`` is one job array and every member completes.

Every run goes through the real CLI (``python -m jobs.sft ... cluster=slurm``). One torch thread per rank, so the
two-node and the local runs do the same arithmetic.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from afm_core.launch.records import read_job_record
from afm_core.utils.paths import repo_root, shared_data_dir
from tests.slurm.tiny_sft import (
    TINY,
    assert_resumed_bitwise,
    interrupt_with_usr2,
    jobs_sft,
    submit_slurm,
    train_losses,
    wait_finished,
)

MAX_STEPS = 12
TWO_NODES = ["cluster.nodes=2", "cluster.tasks_per_node=1", "trainer.num_threads=1"]
PP2 = [*TWO_NODES, "parallel.pp=2", f"trainer.max_steps={MAX_STEPS}"]
DP2 = [*TWO_NODES, f"trainer.max_steps={MAX_STEPS}"]
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.usefixtures("slurm_cluster"),
    pytest.mark.skipif(not shared_data_dir().is_dir(), reason=f"no shared data at {shared_data_dir()}"),
]


@pytest.fixture(scope="module")
def two_node_runs(tmp_path_factory) -> dict[str, Path]:
    """Uninterrupted two-node runs, submitted together: ``pp2`` (a stage per node) and ``dp2`` (a replica per node)."""
    root = tmp_path_factory.mktemp("two-nodes")
    runs = {"pp2": root / "pp2", "dp2": root / "dp2"}
    submit_slurm(runs["pp2"], *PP2)
    submit_slurm(runs["dp2"], *DP2)
    for run_dir in runs.values():
        wait_finished(run_dir)
    return runs


def assert_losses_close(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    assert [s for s, _ in got] == [s for s, _ in expected] == list(range(1, MAX_STEPS + 1))
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, expected)) <= 1e-6


def assert_one_rank_per_node(run_dir: Path) -> None:
    """job.json, the ranks' logs and jobs.status agree: rank 0 on afm-n1 (MASTER_ADDR), rank 1 on afm-n2."""
    record = read_job_record(run_dir / "logs")
    start = record["start"]
    assert start["job_id"] == record["job_id"] and start["world_size"] == record["world_size"] == 2
    assert start["nodes"] == ["afm-n1", "afm-n2"] and start["nodelist"] == "afm-n[1-2]"
    assert start["ranks"] == {"afm-n1": [0], "afm-n2": [1]} and start["master_addr"] == "afm-n1"
    rank0 = Path(record["stdout"]).read_text()
    assert "world size 2 on 2 node(s) afm-n[1-2]; MASTER_ADDR=afm-n1" in rank0
    assert "[afm]   afm-n2: rank(s) 1" in rank0
    rank1 = Path(record["stdout"].replace("_0_log.out", "_1_log.out")).read_text()
    assert "[afm] rank 1/2 on afm-n2 (local rank 0)" in rank1
    status = subprocess.run(
        [sys.executable, "-m", "jobs.status", str(run_dir)], cwd=repo_root(), capture_output=True, text=True, check=True
    ).stdout
    assert "afm-n[1-2]" in status and "COMPLETED" in status


@pytest.mark.parametrize(("layout", "local_layout"), [("pp2", "parallel.pp=2"), ("dp2", "cluster.dp=2")])
def test_one_rank_per_node_matches_the_local_run(two_node_runs, layout, local_layout, tmp_path):
    """pp2: a pipeline stage per node; dp2: a data-parallel replica per node; against the same layout locally."""
    local = tmp_path / f"local-{layout}"
    jobs_sft(*TINY, local_layout, "trainer.num_threads=1", f"trainer.max_steps={MAX_STEPS}", f"hydra.run.dir={local}")
    assert_losses_close(train_losses(two_node_runs[layout]), train_losses(local))
    assert_one_rank_per_node(two_node_runs[layout])


def test_two_node_job_preempted_resumes_bitwise(two_node_runs, tmp_path):
    run_dir = tmp_path / "interrupted"
    job_id = submit_slurm(run_dir, *PP2)
    interrupt_with_usr2(run_dir, job_id, times=1)
    assert_resumed_bitwise(run_dir, two_node_runs["pp2"], job_id, times=1, max_steps=MAX_STEPS)


def test_two_node_sweep_of_three_values_is_one_array(tmp_path):
    sweep = tmp_path / "sweep"
    out = jobs_sft(
        "-m",
        *TINY,
        "cluster=slurm",
        *TWO_NODES,
        "cluster.array_parallelism=2",
        "trainer.max_steps=3",
        "optim.lr=1e-4,2e-4,4e-4",
        f"hydra.sweep.dir={sweep}",
    )
    records = [read_job_record(sweep / str(i) / "logs") for i in range(3)]
    array_id = records[0]["job_id"].split("_")[0]
    assert [r["job_id"] for r in records] == [f"{array_id}_{i}" for i in range(3)]
    assert f"Submitted Slurm job array {array_id}: 3 members, at most 2 at once, 2 rank(s) each" in out

    for i in range(3):
        wait_finished(sweep / str(i))
    lrs = [OmegaConf.load(sweep / str(i) / ".hydra" / "config.yaml").optim.lr for i in range(3)]
    assert lrs == [1e-4, 2e-4, 4e-4]  # one run dir (config, metrics, checkpoints) per member
    starts = [read_job_record(sweep / str(i) / "logs")["start"] for i in range(3)]
    assert all(s["ranks"] == {"afm-n1": [0], "afm-n2": [1]} for s in starts)
    # members running at once on the same first node rendezvous on different ports, below the ephemeral range
    ports = [s["master_port"] for s in starts]
    assert len(set(ports)) == 3 and all(15000 <= port < 25000 for port in ports), ports
    status = subprocess.run(
        [sys.executable, "-m", "jobs.status", str(sweep)], cwd=repo_root(), capture_output=True, text=True, check=True
    ).stdout
    assert status.count("COMPLETED") == 3 and all(f"slurm:{array_id}_{i}" in status for i in range(3))
    assert status.count("3/3") == 3 and status.count("afm-n[1-2]") == 3
