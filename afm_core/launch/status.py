"""The state of runs submitted by :func:`afm_core.launch.submit`: scheduler state, progress, checkpoints, restarts.

A run is a directory with ``logs/job.json`` (:mod:`afm_core.launch.records`). Its row combines

- the scheduler state: Slurm's from ``sacct`` (``squeue`` for jobs sacct does not know yet), a local job's from its
  controller process (RUNNING while alive) and its last event;
- progress from ``metrics.jsonl`` (last train step and loss, last held-out loss; see ``afm_core.engine.metrics``)
  and ``trainer.max_steps`` from ``.hydra/config.yaml``;
- the latest complete checkpoint ``checkpoints/step_N`` (holding the ``COMPLETE`` marker; found by
  ``afm_core.engine.checkpoint_dirs``, which imports no torch);
- restarts: ``start`` events after the first (requeues after preemption or timeout, and external requeues);
- the nodes of the job's latest start (``start.nodelist`` in ``job.json``, written by rank 0).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from afm_core.engine.checkpoint_dirs import latest_complete_checkpoint
from afm_core.engine.metrics import read_metrics
from afm_core.launch.records import current_start, read_events, read_job_record

TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "BOOT_FAIL",
    "DEADLINE",
    "STOPPED",
}


@dataclass
class RunStatus:
    """One row of ``jobs.status``."""

    run_dir: Path
    cluster: str
    job_id: str
    state: str
    step: int | None
    max_steps: int | None
    train_loss: float | None
    eval_loss: float | None
    eval_step: int | None
    checkpoint: str | None
    restarts: int
    nodes: str | None  # Slurm's compressed node list of the latest start ("afm-n[1-2]"); None before it
    stdout: Path
    stderr: Path

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES


def find_runs(path: str | Path) -> list[Path]:
    """Run dirs at or under ``path`` (a run, a sweep, or a tree of runs), oldest submission first.

    A ``job.json`` without ``cluster`` holds only a job's ``start`` (the submitter has not written yet): skipped.
    """
    path = Path(path)
    candidates = (
        [path] if (path / "logs" / "job.json").is_file() else [p.parent.parent for p in path.glob("**/logs/job.json")]
    )
    submitted = {}
    for run in candidates:
        record = read_job_record(run / "logs") or {}
        if record.get("cluster"):
            submitted[run] = record.get("submitted_at", 0.0)
    return sorted(submitted, key=lambda run: (submitted[run], str(run)))


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _parse_states(text: str | None) -> dict[str, str]:
    states = {}
    for line in (text or "").splitlines():
        job_id, _, state = line.strip().partition("|")
        if job_id and state:
            states[job_id] = state.split()[0]  # "CANCELLED by 0" -> CANCELLED
    return states


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """Current Slurm state of each job id (``N`` or ``N_i``); ids Slurm does not know are left out.

    The controller's view first (``squeue -t all``: every job it still holds, finished ones for ``MinJobAge``
    seconds; ``-r``: one line per array task), then accounting (``sacct``) for the jobs it no longer holds:
    slurmctld sends each state change to slurmdbd asynchronously, so right after an ``scancel`` ``sacct`` could
    still say PENDING for a job the controller has cancelled."""
    if not job_ids:
        return {}
    states = _parse_states(_run(["squeue", "-h", "-r", "-t", "all", "-o", "%i|%T", "-j", ",".join(job_ids)]))
    missing = [j for j in job_ids if j not in states]
    if missing:
        states.update(_parse_states(_run(["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(missing)])))
    return {j: states[j] for j in job_ids if j in states}


def _local_state(record: dict, events: list[dict]) -> str:
    """RUNNING while the submitit controller (pid = job id) of this run is alive, else from the last event."""
    try:
        cmdline = Path(f"/proc/{record['job_id']}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        cmdline = []
    alive = "submitit.local._local" in cmdline and record["submitit_folder"] in cmdline
    if alive:
        return "RUNNING"
    last = events[-1]["event"] if events else None
    return {"completed": "COMPLETED", "failed": "FAILED"}.get(last or "", "STOPPED")


def _max_steps(run_dir: Path) -> int | None:
    config = run_dir / ".hydra" / "config.yaml"
    if not config.is_file():
        return None
    from omegaconf import OmegaConf

    value = OmegaConf.select(OmegaConf.load(config), "trainer.max_steps")
    return value if isinstance(value, int) else None


def run_status(run_dir: Path, slurm: dict[str, str]) -> RunStatus:
    """The row of one run; ``slurm`` maps Slurm job ids to states (:func:`slurm_states`).

    Raises:
        FileNotFoundError: ``run_dir/logs/job.json`` is missing.
    """
    record = read_job_record(run_dir / "logs")
    if record is None:
        raise FileNotFoundError(f"{run_dir}/logs/job.json: not a run submitted by afm_core.launch")
    events = read_events(run_dir / "logs")
    if record["cluster"] == "local":
        state = _local_state(record, events)
    else:
        state = slurm.get(record["job_id"], "UNKNOWN")
        if state not in TERMINAL_STATES and events and events[-1]["event"] in ("completed", "failed"):
            state = "COMPLETED" if events[-1]["event"] == "completed" else "FAILED"  # accounting lags behind
    metrics = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in metrics if r.get("split") == "train"]
    evals = [r for r in metrics if r.get("split") == "eval"]
    checkpoint = latest_complete_checkpoint(run_dir / "checkpoints")
    return RunStatus(
        run_dir=run_dir,
        cluster=record["cluster"],
        job_id=record["job_id"],
        state=state,
        step=train[-1]["step"] if train else None,
        max_steps=_max_steps(run_dir),
        train_loss=train[-1].get("loss") if train else None,
        eval_loss=evals[-1].get("loss") if evals else None,
        eval_step=evals[-1]["step"] if evals else None,
        checkpoint=checkpoint.name if checkpoint else None,
        restarts=max(0, sum(e["event"] == "start" for e in events) - 1),
        nodes=(current_start(record) or {}).get("nodelist"),
        stdout=Path(record["stdout"]),
        stderr=Path(record["stderr"]),
    )


def collect(path: str | Path) -> list[RunStatus]:
    """Rows for every run at or under ``path`` (one ``sacct`` call for all Slurm jobs)."""
    runs = find_runs(path)
    records = [read_job_record(run / "logs") for run in runs]
    slurm = slurm_states([r["job_id"] for r in records if r and r["cluster"] == "slurm"])
    return [run_status(run, slurm) for run in runs]
