"""What a preemption costs an SFT job on the real local Slurm cluster (slurm/local-cluster.sh).

    python -m benchmarks.resume_overhead                        # preempt by the high partition, then scancel USR2
    python -m benchmarks.resume_overhead --interrupts preempt   # only the partition preemption
    python -m benchmarks.resume_overhead --out resume.json      # also write the figures as JSON

Submits one tiny SFT job (``python -m jobs.sft cluster=slurm``, tiny-llama on a 120-trajectory slice of the real
traces, :data:`TINY_JOB`) to the
default ``debug`` partition, waits until it trains, and interrupts it once per ``--interrupts`` entry, each after
the previous resume has trained a step:

- ``preempt``: ``sbatch -p high -w <the job's node>`` a job needing all the node's CPUs; slurmctld preempts the
  SFT job (requeue, and USR2 at once through ``SlurmctldParameters=preempt_send_user_signal``);
- ``usr2``: ``scancel --signal=USR2`` (what a Slurm time limit's ``--signal`` does).

For each interrupt it prints, from timestamps on the one machine clock (unix seconds):

- signal -> checkpoint complete: the ``signal_time`` of the ``requeued`` event (when the job's
  :class:`~afm_core.launch.requeue.PreemptionRelay` handler ran) to the mtime of the ``COMPLETE`` marker of the
  checkpoint written for that signal; split into the wait for the step in flight (its ``metrics.jsonl`` line) and
  the save;
- requeue -> first resumed step: the ``requeued`` event (written after submitit's ``scontrol requeue``) to the
  ``time`` of the first resumed train step's ``metrics.jsonl`` line; split into Slurm's restart delay (to the
  attempt's ``Start`` in ``sacct -D``, whole seconds; at least ``cred_expire`` + 1 s after the requeue), the job's
  boot (srun, interpreter, imports, up to the next ``start`` event) and the trainer's restart (model build,
  checkpoint load, one step); the data's share of that restart (rank 0's ``[sft] data:`` line: mapping the cached
  token arrays) is shown next to what the first attempt spent tokenizing and packing, which a restart no longer
  pays;
- steps lost: train steps logged before the job stopped that the checkpoint does not hold (they are trained again
  after the resume); 0 with checkpoint-on-signal, since the step in flight at the signal is finished and saved.

It starts the cluster (``slurm/local-cluster.sh start``, root) when it is not up, cancels the SFT job once the
figures are in, and exits 1 if an interrupt was not followed by a checkpoint and a resumed step in time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from afm_core.engine.metrics import read_metrics
from afm_core.launch.records import read_events, read_job_record
from afm_core.utils.paths import repo_root, shared_data_dir
from benchmarks.json_out import write_out

TINY_JOB = [  # tiny-llama on a 120-trajectory slice of the real traces (its own prepared dir and token cache)
    "model=tiny-llama",
    "data.name=resume-overhead",
    "data.sources.gsm8k.limit=60",
    "data.sources.fireact.limit=20",
    "data.sources.r1searcher.limit=20",
    "data.sources.tora.limit=20",
    "trainer.global_batch_size=2",
    "trainer.eval_interval=1000",
    "trainer.eval_sequences=2",
    "trainer.save_interval=1000",
    "trainer.keep_last=1",
    "trainer.progress=false",
]
CLUSTER_SCRIPT = repo_root() / "slurm" / "local-cluster.sh"
INTERRUPTS = ("preempt", "usr2")


def ensure_cluster() -> None:
    """Start the local cluster with slurm/local-cluster.sh when ``status`` says it is not up.

    Raises:
        RuntimeError: the script failed (its output is in the message).
    """
    if subprocess.run([CLUSTER_SCRIPT, "status"], capture_output=True, check=False).returncode == 0:
        return
    print("starting the local Slurm cluster (slurm/local-cluster.sh start)...", flush=True)
    started = subprocess.run([CLUSTER_SCRIPT, "start"], capture_output=True, text=True, timeout=900, check=False)
    if started.returncode != 0:
        raise RuntimeError(f"{CLUSTER_SCRIPT} start failed ({started.returncode}):\n{started.stdout}{started.stderr}")


def node_cpus() -> int:
    """CPUs a node advertises to Slurm (the first one; the local cluster's nodes are alike)."""
    out = subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def submit_sft(run_dir: Path, cpus: int, max_steps: int) -> str:
    """Submit the tiny SFT job to the ``debug`` partition with all ``cpus``; its Slurm job id.

    Raises:
        RuntimeError: ``jobs.sft`` failed (its output is in the message).
    """
    overrides = [
        *TINY_JOB,
        "cluster=slurm",
        "cluster.time=20",
        f"cluster.cpus_per_task={cpus}",
        f"trainer.max_steps={max_steps}",
        "trainer.keep_last=5",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo_root()), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "jobs.sft", *overrides],
        cwd=repo_root(),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"jobs.sft failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return read_job_record(run_dir / "logs")["job_id"]


def interrupt(kind: str, job_id: str, cpus: int, run_dir: Path) -> None:
    """Preempt the job by a whole-node ``high`` job on the job's node, or send it USR2 with ``scancel``."""
    if kind == "preempt":
        node = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True, check=True
        ).stdout.strip()
        subprocess.run(
            [
                "sbatch",
                "--parsable",
                "-p",
                "high",
                "-c",
                str(cpus),
                "-w",
                node,
                "-J",
                "preemptor",
                "-o",
                str(run_dir / "logs" / "preemptor-%j.out"),
                "--wrap",
                "sleep 1",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    else:
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)


def slurm_starts(job_id: str) -> list[float]:
    """Start times (unix s, whole seconds) of the job's attempts in Slurm accounting, first attempt first."""
    out = subprocess.run(
        ["sacct", "-D", "-X", "-n", "-P", "-o", "Start", "-j", job_id], capture_output=True, text=True, check=False
    ).stdout
    return [datetime.fromisoformat(line).timestamp() for line in out.split() if line[:1].isdigit()]


def events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir / "logs") if e["event"] == kind]


def train_lines(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["split"] == "train"]


def data_open_times(run_dir: Path) -> list[tuple[str, float]]:
    """``(how, seconds)`` of each attempt's ``[sft] data: <how> in <s> s`` line in rank 0's log, in order."""
    record = read_job_record(run_dir / "logs") or {}
    log = Path(record.get("stdout") or "")
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    found = [re.match(r"\[sft\] data: (.+) in ([\d.]+) s", line) for line in lines]
    return [(m.group(1), float(m.group(2))) for m in found if m]


def wait_for(condition, what: str, timeout_s: float, poll_s: float = 0.2) -> Any:
    """Poll ``condition()`` until it returns something truthy; that value.

    Raises:
        TimeoutError: not within ``timeout_s`` seconds (names ``what``).
    """
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(poll_s)
    return value


def measure(kind: str, number: int, job_id: str, cpus: int, run_dir: Path, timeout_s: float) -> dict[str, Any]:
    """Interrupt the running job (its ``number``-th interrupt, 1-based) and time the checkpoint and the resume."""
    attempt_start = events(run_dir, "start")[number - 1]["time"]
    triggered_at = time.time()
    interrupt(kind, job_id, cpus, run_dir)
    requeued = wait_for(lambda: events(run_dir, "requeued")[number - 1 : number], f"requeue {number}", timeout_s)[0]
    ckpt_step = requeued["step"]
    # afm_core.engine.checkpoint's layout, read without importing torch (as afm_core.launch.status does)
    marker = run_dir / "checkpoints" / f"step_{ckpt_step:08d}" / "COMPLETE"
    complete_at = marker.stat().st_mtime  # now: a later save may rotate it out
    signal_at = requeued["signal_time"]
    stopped = [r for r in train_lines(run_dir) if r["time"] >= attempt_start]  # before the restart cuts it back
    before_signal = [r["step"] for r in stopped if r["time"] < signal_at]
    boundary_at = next(r["time"] for r in stopped if r["step"] == ckpt_step)

    restart = wait_for(lambda: events(run_dir, "start")[number : number + 1], f"restart {number}", timeout_s)[0]
    first = wait_for(
        lambda: [r for r in train_lines(run_dir) if r["step"] == ckpt_step + 1 and r["time"] >= restart["time"]],
        f"first step after restart {number}",
        timeout_s,
    )[0]
    slurm_start = wait_for(
        lambda: slurm_starts(job_id)[number : number + 1], f"sacct's start of attempt {number + 1}", timeout_s
    )[0]
    data = wait_for(
        lambda: data_open_times(run_dir)[number : number + 1] and data_open_times(run_dir),
        f"rank 0's data line of attempt {number + 1}",
        timeout_s,
    )
    return {
        "interrupt": kind,
        "reason": requeued["reason"],
        "trigger_to_signal_s": signal_at - triggered_at,
        "signal_to_checkpoint_s": complete_at - signal_at,
        "signal_to_step_boundary_s": boundary_at - signal_at,
        "step_boundary_to_checkpoint_s": complete_at - boundary_at,
        "requeue_to_first_step_s": first["time"] - requeued["time"],
        "requeue_to_slurm_start_s": slurm_start - requeued["time"],
        "slurm_start_to_job_start_s": restart["time"] - slurm_start,
        "job_start_to_first_step_s": first["time"] - restart["time"],
        "data_open_s": data[number][1],
        "data_open_how": data[number][0],
        "first_attempt_data_open_s": data[0][1],
        "first_attempt_data_open_how": data[0][0],
        "step_at_signal": max(before_signal, default=0),
        "checkpoint_step": ckpt_step,
        "last_step_before_requeue": max((r["step"] for r in stopped), default=0),
        "steps_lost": max(0, max((r["step"] for r in stopped), default=0) - ckpt_step),
        "first_step_s": first["step_s"],
        "signal_time": signal_at,
        "checkpoint_complete_time": complete_at,
        "requeue_time": requeued["time"],
        "slurm_start_time": slurm_start,
        "restart_time": restart["time"],
        "first_resumed_step_time": first["time"],
    }


ROWS = [  # (label, key, format): one table row per figure, one column per interrupt
    ("trigger -> signal handler ran", "trigger_to_signal_s", "{:.2f} s"),
    ("signal -> checkpoint COMPLETE", "signal_to_checkpoint_s", "{:.2f} s"),
    ("  finishing the step in flight", "signal_to_step_boundary_s", "{:.2f} s"),
    ("  saving the checkpoint", "step_boundary_to_checkpoint_s", "{:.2f} s"),
    ("requeue -> first resumed step", "requeue_to_first_step_s", "{:.2f} s"),
    ("  Slurm restart delay (sacct, ±1 s)", "requeue_to_slurm_start_s", "{:.1f} s"),
    ("  srun, python, imports", "slurm_start_to_job_start_s", "{:.1f} s"),
    ("  model build, load, 1 step", "job_start_to_first_step_s", "{:.2f} s"),
    ("    of which opening the data (cache mapped)", "data_open_s", "{:.2f} s"),
    ("first start: tokenize + pack (not repeated)", "first_attempt_data_open_s", "{:.2f} s"),
    ("last step logged before the signal", "step_at_signal", "{}"),
    ("checkpoint step", "checkpoint_step", "{}"),
    ("steps lost", "steps_lost", "{}"),
]


def print_table(rows: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="Preemption cost of a tiny SFT job on the local Slurm cluster")
    table.add_column("figure")
    for row in rows:
        table.add_column(f"{row['interrupt']} ({row['reason']})", justify="right")
    for label, key, fmt in ROWS:
        table.add_row(label, *(fmt.format(row[key]) for row in rows))
    console.print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--interrupts",
        default=",".join(INTERRUPTS),
        help=f"comma-separated, in order, from {INTERRUPTS} (default: both)",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=40,
        help="the job's trainer.max_steps (enough to outlast "
        "the interrupts; the job is cancelled once the figures are in)",
    )
    parser.add_argument("--warmup-steps", type=int, default=2, help="train steps before the first interrupt")
    parser.add_argument("--run-dir", type=Path, default=None, help="the job's RUN_DIR (default: a new temp dir)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for each event")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    kinds = [k.strip() for k in args.interrupts.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(INTERRUPTS))
    if unknown or not kinds:
        parser.error(f"--interrupts: unknown {unknown or 'empty list'}; choose from {INTERRUPTS}")
    if not shared_data_dir().is_dir():
        parser.error(f"no shared data at {shared_data_dir()} (set AFM_SHARED_DATA)")

    console = Console(stderr=True)
    ensure_cluster()
    run_dir = (args.run_dir or Path(tempfile.mkdtemp(prefix="afm-resume-overhead-")) / "sft").absolute()
    cpus = node_cpus()
    started = time.monotonic()
    job_id = submit_sft(run_dir, cpus, args.max_steps)
    console.print(f"SFT job {job_id} on debug ({cpus} CPUs), run dir {run_dir}")
    rows, error = [], None
    try:
        wait_for(lambda: len(train_lines(run_dir)) >= args.warmup_steps, "the SFT job to train", args.timeout)
        for number, kind in enumerate(kinds, start=1):
            console.print(f"interrupt {number}: {kind} ...")
            rows.append(measure(kind, number, job_id, cpus, run_dir, args.timeout))
    except TimeoutError as err:
        error = f"{err} (job {job_id}; logs in {run_dir / 'logs'})"
    finally:
        subprocess.run(["scancel", job_id], check=False)
    figures = {
        "job_id": job_id,
        "run_dir": str(run_dir),
        "node_cpus": cpus,
        "interrupts": rows,
        "wall_s": time.monotonic() - started,
        "error": error,
    }
    if rows:
        print_table(rows, console)
    if error:
        console.print(f"[red]error:[/red] {error}")
    print(json.dumps(figures, indent=2))
    write_out(args.out, figures)
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
