"""The RL job on the real local Slurm cluster (acceptance g): ``python -m jobs.rl recipe=rl_smoke cluster=slurm``
preempted by ``scancel --signal=USR2`` completes with every rollout step exactly once in metrics.jsonl, and
its last checkpoint's data position (prompt stream, dynamic sampler), stage and step equal those of the same run
left uninterrupted; and the same job on two nodes (DP=2), with a vLLM engine and the tool servers on each node.

Every run goes through the real CLI; the job starts its own sandbox server and vLLM engine inside the
allocation. Run these with the cluster lock held: ``flock /tmp/afm-slurm.lock .venv/bin/python -m pytest
tests/slurm/test_slurm_rl.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from afm_core.engine.metrics import read_metrics
from afm_core.launch.records import read_job_record
from afm_core.utils.paths import repo_root, shared_data_dir
from tests.slurm.tiny_sft import events_of, wait_finished, wait_until

MAX_STEPS = 4  # the stage switch at step 4: crossed by the resumed run wherever the stop lands
SMOKE = [
    "recipe=rl_smoke",
    f"trainer.max_steps={MAX_STEPS}",
    "rollout.context_schedule=[{until_step: 3, max_response_len: 32}, {max_response_len: 48}]",
    "trainer.num_threads=1",
    "cluster=slurm",
    "cluster.time=20",  # >= 13 min: submitit counts a USR2 as a preemption, not a timeout
    "cluster.cpus_per_task=2",
    "tools.cache=null",
]
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.usefixtures("slurm_cluster"),
    pytest.mark.skipif(not shared_data_dir().is_dir(), reason=f"no shared data at {shared_data_dir()}"),
]


def submit_rl(run_dir: Path, *overrides: str) -> str:
    """``python -m jobs.rl ... cluster=slurm`` (returns at once); the Slurm job id."""
    done = subprocess.run(
        [sys.executable, "-m", "jobs.rl", *SMOKE, f"hydra.run.dir={run_dir}", *overrides],
        cwd=repo_root(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"jobs.rl failed:\n{done.stdout}\n{done.stderr}"
    job_id = read_job_record(run_dir / "logs")["job_id"]
    assert f"Submitted Slurm job {job_id}" in done.stdout and f"python -m jobs.status {run_dir} --follow" in done.stdout
    return job_id


def steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]


def last_checkpoint_common(run_dir: Path) -> dict:
    from megatron.core.dist_checkpointing import load_common_state_dict

    from afm_core.engine.checkpoint_dirs import latest_complete_checkpoint

    path = latest_complete_checkpoint(run_dir / "checkpoints")
    assert path is not None, f"no complete checkpoint in {run_dir}"
    return load_common_state_dict(str(path))["afm"]


def test_rl_smoke_preempted_on_slurm_logs_every_step_once_with_the_uninterrupted_data_position(tmp_path):
    # once, not twice: a resume of a resumed run is covered in process (tests/test_train_engine.py::
    # test_exact_resume_after_two_preemption_signals), two requeues of one job by tests/test_jobs_launch.py::
    # test_local_preemption_checkpoints_at_a_step_boundary_and_resumes (CI time)
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    submit_rl(straight)
    job_id = submit_rl(interrupted)

    wait_until(lambda: bool(steps(interrupted)), "a first rollout step", timeout_s=900, run_dir=interrupted)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    wait_until(lambda: len(events_of(interrupted, "requeued")) == 1, "the requeue", 900, run_dir=interrupted)
    row = wait_finished(interrupted, timeout_s=1200)
    wait_finished(straight, timeout_s=1200)

    requeues = events_of(interrupted, "requeued")
    assert [e["reason"] for e in requeues] == ["preempted"] and row.restarts == 1
    assert 0 < requeues[0]["step"] < MAX_STEPS, f"stopped mid-run: {requeues}"
    assert steps(interrupted) == steps(straight) == list(range(1, MAX_STEPS + 1)), "every rollout step once"

    # the checkpointed data position and stage equal the uninterrupted run's
    resumed, expected = last_checkpoint_common(interrupted), last_checkpoint_common(straight)
    assert resumed["prompts"] == expected["prompts"] and resumed["sampler"] == expected["sampler"]
    assert resumed["progress"]["stage"] == expected["progress"]["stage"] == 1
    assert resumed["progress"]["rollout_step"] == expected["progress"]["rollout_step"] == MAX_STEPS
    keys = ("stage", "max_response_len", "data_epoch", "data_offset", "prompts_consumed")
    by_step = {r["step"]: [r[k] for k in keys] for r in read_metrics(straight / "metrics.jsonl")}
    assert [[r[k] for k in keys] for r in read_metrics(interrupted / "metrics.jsonl")] == list(by_step.values())
    history = subprocess.run(
        ["sacct", "-D", "-X", "-n", "-P", "-o", "State", "-j", job_id], capture_output=True, text=True, check=True
    ).stdout.split()
    assert history.count("REQUEUED") == 1 and history[-1] == "COMPLETED"


def test_rl_smoke_on_two_nodes_runs_an_engine_and_its_own_tool_servers_on_each_node(tmp_path):
    run_dir = tmp_path / "two-nodes"
    submit_rl(run_dir, "cluster.nodes=2", "cluster.tasks_per_node=1", "parallel.tp=1", "trainer.micro_batch_size=1",
              "trainer.precision=fp32")  # the 1e-3 logprob bound below is fp32's  # fmt: skip
    wait_finished(run_dir, timeout_s=1200)
    assert read_job_record(run_dir / "logs")["start"]["ranks"] == {"afm-n1": [0], "afm-n2": [1]}
    assert steps(run_dir) == list(range(1, MAX_STEPS + 1))
    for record in read_metrics(run_dir / "metrics.jsonl"):
        assert record["logprob_gap_vllm_trainer"] <= 1e-3, "each node's engine serves the trainer's weights"
    # the first rank of each node started its node's sandbox on loopback: no tool call crosses nodes
    assert sorted(p.name for p in (run_dir / "logs" / "tool_servers").iterdir()) == ["afm-n1", "afm-n2"]
