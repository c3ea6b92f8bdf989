"""The job layer on this machine: submitit LocalExecutor ranks, env:// export, preemption relay, requeue, status.

The per-rank function is the stand-in trainer (tests/slurm/stand_in_trainer.py: real gloo world, checkpoints,
metrics.jsonl, the trainer's stop contract) so each job takes seconds; the real trainer runs in
tests/test_jobs_sft.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import submitit
from omegaconf import OmegaConf
from submitit.core.utils import FailedJobError

from afm_core.launch.distributed import rendezvous_vars
from afm_core.launch.executor import ClusterConfigError, make_executor, world_size
from afm_core.launch.placement import compress_ranks, parse_tasks_per_node, rank_nodes
from afm_core.launch.records import (
    read_events,
    read_job_record,
    record_start,
    write_job_record,
)
from afm_core.launch.status import collect
from afm_core.launch.submit import submit
from afm_core.launch.teardown import stop_process_trees
from afm_core.utils.paths import repo_root
from jobs import status as status_cli

STAND_IN = "tests.slurm.stand_in_trainer.run"
STOP_HOOK = "tests.slurm.stand_in_trainer.request_checkpoint"
LOADER = "tests.slurm.stand_in_trainer.mark_loaded"


@pytest.fixture(autouse=True)
def _importable_tests(monkeypatch):
    """Jobs import tests.slurm.stand_in_trainer: the repo root must be on their PYTHONPATH."""
    paths = [str(repo_root()), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))


def local_cfg(run_dir: Path, *, tp: int = 1, max_steps: int = 5, step_s: float = 0.05, **cluster):
    base = OmegaConf.load(repo_root() / "conf" / "cluster" / "local.yaml")
    return OmegaConf.create(
        {
            "run_dir": str(run_dir),
            "cluster": OmegaConf.merge(base, {"gpus_per_node": 0, **cluster}),
            "parallel": {"tp": tp, "pp": 1, "cp": 1},
            "trainer": {"max_steps": max_steps, "step_s": step_s, "save_interval": 1000},
        }
    )


#: What a submitter started by torch.distributed (a notebook, an ``srun`` step, a torchrun worker) inherits.
STALE_RENDEZVOUS = {"MASTER_ADDR": "10.255.255.1", "MASTER_PORT": "29999", "RANK": "1", "WORLD_SIZE": "8",
                    "LOCAL_RANK": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip


def expected_weight(steps: int) -> float:
    weight = 1.0
    for step in range(1, steps + 1):
        weight = weight * 1.0001 + step / 7.0
    return weight


def train_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


# -- executor from the cluster config ----------------------------------------------------------------------------
def test_world_size_and_config_errors():
    assert world_size({"name": "local", "dp": 2}, {"tp": 2, "pp": 1}) == 4
    assert world_size({"name": "slurm", "nodes": 2, "tasks_per_node": 4}, {"tp": 2, "pp": 2}) == 8
    with pytest.raises(ClusterConfigError, match=r"cluster\.name must be one of"):
        world_size({"name": "k8s"}, {})
    with pytest.raises(ClusterConfigError, match=r"conf/cluster/slurm.yaml: .* 3 ranks is not a multiple of .* = 2"):
        world_size({"name": "slurm", "nodes": 1, "tasks_per_node": 3}, {"tp": 2})
    with pytest.raises(ClusterConfigError, match=r"conf/cluster/local.yaml: cluster.dp must be a positive integer"):
        world_size({"name": "local", "dp": 0}, {"tp": 1})


def test_slurm_executor_gets_every_cluster_field(tmp_path):
    cluster = OmegaConf.to_container(OmegaConf.load(repo_root() / "conf" / "cluster" / "slurm.yaml"))
    del cluster["defaults"]
    cluster.update(
        partition="gpu",
        nodes=2,
        tasks_per_node=4,
        gpus_per_node=4,
        cpus_per_task=8,
        mem="64G",
        time=240,
        account="proj",
        qos="high",
        constraint="h100",
        exclusive=True,
        additional_parameters={"reservation": "r1"},
        setup=["module load cuda/12.4"],
    )
    executor = make_executor(cluster, {"tp": 4, "pp": 2}, tmp_path, "sft")
    params = executor.parameters
    assert {
        k: params[k]
        for k in (
            "partition",
            "nodes",
            "ntasks_per_node",
            "gpus_per_node",
            "cpus_per_task",
            "time",
            "account",
            "qos",
            "constraint",
            "exclusive",
            "job_name",
        )
    } == {
        "partition": "gpu",
        "nodes": 2,
        "ntasks_per_node": 4,
        "gpus_per_node": 4,
        "cpus_per_task": 8,
        "time": 240,
        "account": "proj",
        "qos": "high",
        "constraint": "h100",
        "exclusive": True,
        "job_name": "sft",
    }
    assert params["mem"] == "64G"
    assert params["additional_parameters"] == {"requeue": True, "reservation": "r1"}
    assert params["setup"] == ["module load cuda/12.4"]
    assert params["signal_delay_s"] == 120 and executor.max_num_timeout == 3
    assert params["srun_args"] == ["--kill-on-bad-exit=1"]


def test_inherited_rendezvous_variables_do_not_reach_sbatch(tmp_path, monkeypatch):
    """sbatch gets the submitter's environment without the rendezvous variables it inherited, and with the user's
    ``SBATCH_*`` defaults; the submitter's own environment is left as it was. ``sbatch`` here is a stand-in that
    records its environment and answers as sbatch does (jobs on the real cluster: tests/slurm/)."""
    bin_dir, seen = tmp_path / "bin", tmp_path / "sbatch.env"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\nenv -0 > {seen}\necho 'Submitted batch job 4242'\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # no srun probe
    for name, value in {**STALE_RENDEZVOUS, "SBATCH_PARTITION": "debug"}.items():
        monkeypatch.setenv(name, value)
    cluster = OmegaConf.load(repo_root() / "conf" / "cluster" / "slurm.yaml")
    del cluster["defaults"]
    cfg = OmegaConf.create({"run_dir": str(tmp_path / "run"), "cluster": cluster, "parallel": {"tp": 1, "pp": 1}})

    assert submit(STAND_IN, cfg, on_preempt=STOP_HOOK, job_name="t") is None  # cluster.wait=false: submitted
    env = dict(entry.split("=", 1) for entry in seen.read_text().split("\0") if "=" in entry)
    assert rendezvous_vars(env) == [] and env["SBATCH_PARTITION"] == "debug"
    assert read_job_record(tmp_path / "run" / "logs")["job_id"] == "4242"
    assert {name: os.environ[name] for name in STALE_RENDEZVOUS} == STALE_RENDEZVOUS


def test_slurm_config_selects_the_array_callback():
    out = subprocess.run(
        [sys.executable, "-m", "jobs.sft", "cluster=slurm", "--cfg", "hydra", "-p", "hydra.callbacks"],
        cwd=repo_root(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "afm_core.launch.sweep.SlurmArraySweep" in out


# -- placement ----------------------------------------------------------------------------------------------------
def test_rank_placement_follows_slurms_task_layout():
    assert parse_tasks_per_node("8(x4)") == [8, 8, 8, 8]
    assert parse_tasks_per_node("3,1") == [3, 1] and parse_tasks_per_node("2(x2),1") == [2, 2, 1]
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE='x'"):
        parse_tasks_per_node("x")
    assert rank_nodes(["a", "b"], [3, 1]) == ["a", "a", "a", "b"]
    assert rank_nodes(["a", "b"], [3, 1], "cyclic:block") == ["a", "b", "a", "a"]
    assert compress_ranks([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"


def test_a_start_recorded_before_the_submitters_record_is_kept(tmp_path):
    """A job can start (rank 0 writes ``start``) before the submitter writes job.json: neither write is lost."""
    write_job_record(tmp_path, {"cluster": "slurm", "job_id": "7"})  # an earlier job of this run dir
    record_start(tmp_path, {"job_id": "8", "nodelist": "n[1-2]"})
    write_job_record(tmp_path, {"cluster": "slurm", "job_id": "8"})
    assert read_job_record(tmp_path) == {
        "cluster": "slurm",
        "job_id": "8",
        "start": {"job_id": "8", "nodelist": "n[1-2]"},
    }
    write_job_record(tmp_path, {"cluster": "slurm", "job_id": "9"})  # a later job: the old start is not its own
    assert "start" not in read_job_record(tmp_path)


# -- local jobs ----------------------------------------------------------------------------------------------
def test_local_two_ranks_stream_rank0_and_return_the_summary(tmp_path, capfd, monkeypatch):
    from afm_core.launch.distributed import rendezvous_vars

    for name in rendezvous_vars():  # left in this worker by earlier in-process tests (an engine, an export)
        monkeypatch.delenv(name)
    for name, value in STALE_RENDEZVOUS.items():  # inherited ones do not reach the ranks: they rendezvous on their own
        monkeypatch.setenv(name, value)
    run_dir = tmp_path / "run"
    summary = submit(STAND_IN, local_cfg(run_dir, tp=2), on_preempt=STOP_HOOK, job_name="t")

    assert summary["world_size"] == 2 and summary["ranks_seen"] == 2 and summary["rank"] == 0
    assert summary["master"].startswith("127.0.0.1:") and summary["stopped_early"] is False
    assert summary["weight"] == expected_weight(5)
    out = capfd.readouterr()
    assert "stand-in: rank 0 of 2, starting at step 0" in out.out  # rank 0's stdout, streamed
    assert f"not passed to the job (inherited rendezvous variables): {', '.join(sorted(STALE_RENDEZVOUS))}" in out.out
    host = socket.gethostname()
    assert f"[afm]   {host}: rank(s) 0-1" in out.out and f"[afm] rank 0/2 on {host} (local rank 0)" in out.out
    record = read_job_record(run_dir / "logs")
    assert record["cluster"] == "local" and record["world_size"] == 2
    start = record["start"]
    assert start["job_id"] == record["job_id"] and start["master_addr"] == "127.0.0.1"
    assert f"127.0.0.1:{start['master_port']}" == summary["master"]
    assert start["ranks"] == {host: [0, 1]} and start["world_size"] == 2
    assert Path(record["stdout"]).parent == run_dir / "logs" and Path(record["stdout"]).is_file()
    assert [e["event"] for e in read_events(run_dir / "logs")] == ["start", "completed"]


def test_a_failing_rank_fails_the_job_with_its_traceback(tmp_path):
    cfg = local_cfg(tmp_path / "run")
    cfg.trainer.max_steps = "not a number"
    with pytest.raises(FailedJobError, match="TypeError"):
        submit(STAND_IN, cfg, on_preempt=STOP_HOOK, job_name="t")
    events = read_events(tmp_path / "run" / "logs")
    assert [e["event"] for e in events] == ["start", "failed"] and "TypeError" in events[-1]["error"]


def _wait_for(condition, what: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.05)


def _starts(run_dir: Path) -> int:
    return sum(e["event"] == "start" for e in read_events(run_dir / "logs"))


def _signal_ranks_at(run_dir: Path, steps: list[int]) -> None:
    """SIGUSR2 to every rank (as ``scancel --signal=USR2`` does) once attempt ``i`` has logged ``steps[i]``."""
    for attempt, step in enumerate(steps, start=1):
        _wait_for(
            lambda attempt=attempt, step=step: (
                _starts(run_dir) == attempt
                and (run_dir / "metrics.jsonl").exists()
                and train_steps(run_dir)[-1:] >= [step]
            ),
            f"attempt {attempt} at step {step}",
        )
        controller = psutil.Process(int(read_job_record(run_dir / "logs")["job_id"]))
        for rank in controller.children():
            rank.send_signal(signal.SIGUSR2)


@pytest.mark.slow
def test_local_preemption_checkpoints_at_a_step_boundary_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    cfg = local_cfg(run_dir, tp=2, max_steps=40, step_s=0.1)
    result = {}
    waiter = threading.Thread(target=lambda: result.update(submit(STAND_IN, cfg, on_preempt=STOP_HOOK, job_name="t")))
    waiter.start()
    _signal_ranks_at(run_dir, [5, 20])
    waiter.join(timeout=300)

    assert result["step"] == 40 and result["weight"] == expected_weight(40)  # as if never interrupted
    assert train_steps(run_dir) == list(range(1, 41))  # every step exactly once
    events = read_events(run_dir / "logs")
    assert [e["event"] for e in events] == ["start", "requeued", "start", "requeued", "start", "completed"]
    assert all(e["reason"] == "preempted" for e in events if e["event"] == "requeued")
    assert [row.restarts for row in collect(run_dir)] == [2]


@pytest.mark.slow
def test_the_ranks_get_the_config_load_cfg_makes_while_the_job_keeps_the_plain_one(tmp_path):
    """``load_cfg`` runs on each rank before ``fn`` (as ``jobs.rl``'s ``rl_config``); the pickled job, which a
    requeue starts again and a sweep reads, holds the plain containers; a loader that cannot import is refused at
    submit."""
    run_dir = tmp_path / "run"
    summary = submit(STAND_IN, local_cfg(run_dir, max_steps=1), on_preempt=STOP_HOOK, job_name="t", load_cfg=LOADER)
    assert summary["loaded_by"] == "mark_loaded" and summary["step"] == 1
    (pickled,) = (run_dir / "logs").glob("*_submitted.pkl")
    job = submitit.core.utils.DelayedSubmission.load(pickled).function
    assert job.load_cfg == LOADER and type(job.cfg) is dict and "loaded_by" not in job.cfg
    with pytest.raises(ValueError, match=r"no importable module 'tests\.slurm\.nope'"):
        submit(STAND_IN, local_cfg(run_dir), on_preempt=STOP_HOOK, job_name="t", load_cfg="tests.slurm.nope.load")


def test_local_timeout_requeues_until_max_num_timeout_then_fails(tmp_path):
    """A USR2 this close to the limit counts as a timeout (submitit's rule): 1 requeue allowed, then failure."""
    run_dir = tmp_path / "run"
    cfg = local_cfg(run_dir, max_steps=10_000, step_s=0.05, timeout_min=1, signal_delay_s=55, max_num_timeout=1)
    with pytest.raises(FailedJobError, match="timed-out too many times"):
        submit(STAND_IN, cfg, on_preempt=STOP_HOOK, job_name="t")
    events = read_events(run_dir / "logs")
    assert [e["event"] for e in events] == ["start", "requeued", "start", "failed"]
    assert events[1]["reason"] == "timed-out" and events[1]["step"] < events[3]["step"]
    steps = train_steps(run_dir)
    assert steps == list(range(1, len(steps) + 1))  # resumed, never repeated


@pytest.mark.parametrize(("returncode", "requeued"), [(-signal.SIGTERM, True), (1, False)])
def test_a_scontrol_requeue_terminated_by_the_steps_cancellation_counts_as_the_requeue(returncode, requeued):
    """Slurm answers ``scontrol requeue`` by cancelling the job's step, whose SIGTERM can reach ``scontrol`` before
    it exits (the two-node Slurm test, under load): the relay then exits as a requeue does (SystemExit: the job
    records ``requeued``, no error result); a requeue that failed otherwise still raises."""
    from afm_core.launch.requeue import PreemptionRelay

    def submitits_handler(signum, frame):  # submitit's checkpoint_and_try_requeue, as far as its scontrol call
        raise subprocess.CalledProcessError(returncode, ["scontrol", "requeue", "66"])

    signum = signal.Signals["SIG" + submitit.JobEnvironment.USR_SIG]
    previous = signal.signal(signum, submitits_handler)
    try:
        relay = PreemptionRelay()
        with pytest.raises(SystemExit if requeued else subprocess.CalledProcessError):
            relay.requeue()
    finally:
        signal.signal(signum, previous)


_ROOT_THAT_LEAVES_A_CHILD = """
import signal, subprocess
signal.signal(signal.SIGINT, signal.SIG_DFL)
subprocess.Popen(["sleep", "60"], preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
signal.pause()
"""


def test_stopping_a_process_tree_reaches_what_its_root_leaves_behind():
    """What a stopped submitter does to a child (afm_core.launch.teardown): SIGINT; a root that exits at once leaves
    its own child behind (here a ``sleep`` that ignores SIGINT, as a shell's background jobs do): that orphan gets
    SIGTERM at once, without waiting out the grace time, and nothing of the tree runs afterwards.

    The root is a Python process with SIGINT at its default action (killed by it), set before it starts the child.
    It was ``sh -c "sleep 60 & wait"``: dash catches SIGINT under ``-c`` and exits from its own handler, and in one
    full suite run the shell outlived the SIGINT for the whole grace time and was ended by the SIGTERM (400 runs of
    the test alone never did it again). What is tested is the teardown, not a shell's signal handling."""
    root = subprocess.Popen([sys.executable, "-c", _ROOT_THAT_LEAVES_A_CHILD])
    _wait_for(lambda: len(psutil.Process(root.pid).children()) == 1, "the background sleep", 30)
    [orphan] = psutil.Process(root.pid).children()
    started = time.monotonic()
    stopped = stop_process_trees([psutil.Process(root.pid)], grace_s=30)
    assert stopped == [orphan] and time.monotonic() - started < 10
    assert root.wait(5) == -signal.SIGINT and not orphan.is_running()


# -- status ----------------------------------------------------------------------------------------------------
def test_status_table_of_a_sweep(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    for i, state in enumerate(["completed", "failed"]):
        logs = sweep / str(i) / "logs"
        logs.mkdir(parents=True)
        (logs / "job.json").write_text(
            json.dumps(
                {
                    "cluster": "local",
                    "job_id": "999999999",
                    "stdout": str(logs / "out"),
                    "stderr": str(logs / "err"),
                    "submitit_folder": str(logs),
                }
            )
        )
        (logs / "events.jsonl").write_text("".join(json.dumps({"event": e}) + "\n" for e in ["start", state]))
        (sweep / str(i) / "metrics.jsonl").write_text(
            json.dumps({"step": 0, "split": "eval", "loss": 3.0})
            + "\n"
            + json.dumps({"step": 7, "split": "train", "loss": 2.5})
            + "\n"
        )
        (sweep / str(i) / "checkpoints" / "step_00000005").mkdir(parents=True)
        (sweep / str(i) / "checkpoints" / "step_00000005" / "COMPLETE").write_text("{}")
        (sweep / str(i) / "checkpoints" / "step_00000007").mkdir()  # no COMPLETE marker: partial
        (sweep / str(i) / ".hydra").mkdir()
        (sweep / str(i) / ".hydra" / "config.yaml").write_text("trainer:\n  max_steps: 20\n")

    rows = collect(sweep)
    assert [
        (r.run_dir.name, r.state, r.step, r.max_steps, r.train_loss, r.eval_loss, r.checkpoint, r.restarts)
        for r in rows
    ] == [("0", "COMPLETED", 7, 20, 2.5, 3.0, "step_00000005", 0), ("1", "FAILED", 7, 20, 2.5, 3.0, "step_00000005", 0)]
    assert status_cli.main([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "COMPLETED" in out and "FAILED" in out and "7/20" in out and "3.0000@0" in out
    assert status_cli.main([str(tmp_path / "nothing")]) == 1

    (sweep / "0" / "logs" / "out").write_text("rank 0 says hi\n")
    assert status_cli.main([str(sweep / "0"), "--follow"]) == 0  # ended: streams the log, prints the row
    assert "rank 0 says hi" in capsys.readouterr().out
    assert status_cli.main([str(sweep), "--follow", "--interval", "0.1"]) == 2  # one member failed
