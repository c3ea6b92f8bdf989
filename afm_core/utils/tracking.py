"""Experiment tracking behind one small interface: ``logger=[console,tensorboard,wandb,mlflow]``.

The backends are the field's libraries, as verl's ``trainer.logger`` list picks them (volcengine/verl
``verl/utils/tracking.py``):

- ``console``: ``RUN_DIR/metrics.jsonl`` (:class:`MetricsLog`) and the job's PNG curves.
  Always on: it is the job's own record, read by ``jobs.status``, the summaries and a resumed run.
- ``tensorboard``: event files in ``RUN_DIR/tensorboard`` (``torch.utils.tensorboard.SummaryWriter``).
- ``wandb``: a Weights & Biases run (``wandb.init``) in ``RUN_DIR/wandb``; ``WANDB_MODE=offline`` keeps it on
  disk (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later), ``WANDB_ENTITY`` picks the team.
- ``mlflow``: an MLflow run (``mlflow.tracking.MlflowClient``) at ``tracking.mlflow_uri``, else
  ``$MLFLOW_TRACKING_URI``, else the file store ``RUN_DIR/mlruns``.

A record ``{"step": 10, "split": "train", "loss": 2.1, ...}`` becomes the scalars ``train/loss``... at step 10
in every backend; strings, booleans and nulls stay in the JSONL only. Each run logs its resolved config, the git
commit of the code and the Slurm job id (:func:`run_info`; also in ``RUN_DIR/tracking.json``).

Requeue and resume: the backends' run ids (:attr:`Tracker.run_ids`) are saved with each checkpoint; a run
resumed from that checkpoint reopens the same W&B / MLflow run, and steps the earlier attempt logged already
(``metrics.jsonl`` before it is cut back to the checkpoint's step) are not sent to it again. TensorBoard appends to
the same directory with ``purge_step`` past the checkpoint. No backend shows a step twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from afm_core.utils.atomic import atomic_write_json, atomic_write_text
from afm_core.utils.jsonlog import read_jsonl_log
from afm_core.utils.paths import repo_root
from afm_core.utils.rng import python_random_kept

log = logging.getLogger(__name__)

BACKENDS = ("console", "tensorboard", "wandb", "mlflow")
TRACKING_FILE = "tracking.json"


def git_commit() -> str | None:
    """The commit of the code being run (``git rev-parse HEAD`` in the repository), with ``-dirty`` when tracked
    files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_root(), capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo_root(),
                               capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if dirty else head


def run_info() -> dict[str, Any]:
    """``git_commit``, ``slurm_job_id`` (``SLURM_JOB_ID``; for an array member ``<array job>_<task>``), the host."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")
    return {"git_commit": git_commit(), "slurm_job_id": job, "host": os.uname().nodename}


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists kept as values)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric values of a metrics record under ``<split>/<key>`` (``step``, ``split``, ``time`` dropped)."""
    split = record.get("split")
    out = {}
    for key, value in record.items():
        if key in ("step", "split", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[f"{split}/{key}" if split else key] = float(value)
    return out


class Backend(Protocol):
    """One tracking library: ``run_id`` (None where the backend has no run), ``log`` and ``close``."""

    run_id: str | None

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardBackend:
    """Scalars and the run's config (as text) in ``RUN_DIR/tensorboard``, flushed at every log.

    ``purge_step``: TensorBoard's own resume marker (``SummaryWriter(purge_step=...)``): readers drop the events
    an earlier attempt wrote at that step or later, as ``metrics.jsonl`` drops its lines past the checkpoint.
    """

    run_id: str | None = None

    def __init__(self, run_dir: Path, config: Mapping[str, Any], info: Mapping[str, Any], purge_step: int):
        from torch.utils.tensorboard import SummaryWriter  # torch and tensorboard: the tensorboard logger only

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge_step)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")
        self.writer.add_text("run", json.dumps(info, default=str))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """A W&B run (``resume="allow"`` with the saved id), its config the resolved job config plus :func:`run_info`."""

    def __init__(self, run_dir: Path, project: str, name: str, config: Mapping[str, Any], info: Mapping[str, Any],
                 run_id: str | None, job_type: str):  # fmt: skip
        import wandb  # optional and slow to import: the wandb logger only

        self.run = wandb.init(
            project=project,
            name=name,
            id=run_id,  # None: a new run, its id generated by wandb
            resume="allow",
            dir=str(run_dir),
            job_type=job_type,
            config={**config, "afm": dict(info)},
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self.run_id: str | None = self.run.id

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        import wandb  # loaded by __init__ already (the wandb logger only)

        self.run.finish()
        # finish() can return before wandb's service has written the run's last records (seen offline, on a
        # loaded machine: a run file read at once lacked its run record); teardown waits for the service to
        # flush and exit, so the run dir is complete when close returns (the next init starts a new service)
        wandb.teardown()


def mlflow_key(key: str) -> str:
    """A metric name MLflow accepts (letters, digits, ``_-. /:``): ``tasks/avg@k`` -> ``tasks/avg_at_k``."""
    return re.sub(r"[^\w\-. /:]", "_", key.replace("@", "_at_"))


class MlflowBackend:
    """An MLflow run in experiment ``project``: params (the flattened config, when the run is created), tags
    (:func:`run_info`), the config as the artifact ``config.json``, metrics with their step."""

    def __init__(self, run_dir: Path, project: str, name: str, config: Mapping[str, Any], info: Mapping[str, Any],
                 run_id: str | None, uri: str | None):  # fmt: skip
        # mlflow: optional and slow to import, the mlflow logger only
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run_dir / "mlruns").absolute().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3: the file store is opt-in
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in flatten(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(run_id, params=params[start : start + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self.client.set_tag(run_id, "afm.git_commit", str(info.get("git_commit")))
        self.client.set_tag(run_id, "afm.slurm_job_id", str(info.get("slurm_job_id")))
        self.client.log_dict(run_id, dict(config), "config.json")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric  # loaded by __init__ already (the mlflow logger only)

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), v, now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def read_run_ids(run_dir: str | Path) -> dict[str, str]:
    """The backends' run ids recorded in ``RUN_DIR/tracking.json`` ({} when absent): how a job without
    checkpoints (eval, distill) continues its runs when restarted."""
    path = Path(run_dir) / TRACKING_FILE
    return dict(json.loads(path.read_text()).get("run_ids") or {}) if path.is_file() else {}


class MetricsLog:
    """Append-only ``metrics.jsonl`` writer that resumes cleanly.

    Args:
        path: ``RUN_DIR/metrics.jsonl``.
        resume_step: optimizer steps already done (the loaded checkpoint's step; 0 for a fresh run):
            existing lines with ``step > resume_step`` are removed, and for a fresh run the file is emptied.
    """

    def __init__(self, path: str | Path, resume_step: int):
        self.path = Path(path)
        kept = [r for r in read_jsonl_log(self.path) if resume_step > 0 and r["step"] <= resume_step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - appended to until close()

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (needs ``step`` and ``split``) with ``time`` (unix seconds); non-finite floats are
        written as null."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        clean["time"] = time.time()
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class Tracker:
    """The job's metrics sink: ``metrics.jsonl`` plus the tracking backends in ``loggers``.

    Args:
        run_dir: ``RUN_DIR``.
        loggers: names from :data:`BACKENDS` (``console`` is always on).
        config: the resolved job config (plain containers), logged once per start.
        job_type: ``sft``, ``rl``, ``eval``, ``distill``: the W&B job type and the default run name's prefix.
        tracking: the ``tracking`` config group: ``project`` (W&B project, MLflow experiment), ``name`` (run
            name; null: ``<job_type>/<run dir name>``), ``mlflow_uri``.
        run_ids: the backends' run ids saved with the checkpoint being resumed ({} for a new run).
        resume_step: the checkpoint's step (0 for a new run): ``metrics.jsonl`` is cut back to it.
        metrics_file: the JSONL file under ``run_dir`` (None: no JSONL, for jobs that keep their own record).
    Raises:
        ValueError: an unknown logger name.
    """

    def __init__(self, run_dir: str | Path, loggers: list[str] | tuple[str, ...], *, config: Mapping[str, Any],
                 job_type: str, tracking: Mapping[str, Any] | None = None, run_ids: Mapping[str, str] | None = None,
                 resume_step: int = 0, metrics_file: str | None = "metrics.jsonl"):  # fmt: skip
        unknown = sorted(set(loggers) - set(BACKENDS))
        if unknown:
            raise ValueError(f"logger={list(loggers)}: unknown {unknown[0]!r}; valid: {', '.join(BACKENDS)}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tracking = dict(tracking or {})
        run_ids = dict(run_ids or {})
        self.info = run_info()
        # what an earlier attempt of this run logged past the checkpoint: not sent again to a reopened run
        self.logged: dict[str, int] = {}
        if metrics_file is not None and run_ids:
            for record in read_jsonl_log(self.run_dir / metrics_file):
                split = str(record.get("split"))
                self.logged[split] = max(self.logged.get(split, -1), int(record["step"]))
        self.jsonl = MetricsLog(self.run_dir / metrics_file, resume_step) if metrics_file else None
        project = tracking.get("project") or "afm"
        name = tracking.get("name") or f"{job_type}/{self.run_dir.name}"
        self.backends: dict[str, Backend] = {}
        # MLflow (and on retries its REST client) draws from python's random: the trainer's seeded, checkpointed
        # state is kept (afm_core.utils.rng)
        with python_random_kept():
            for backend in dict.fromkeys(loggers):
                if backend == "tensorboard":
                    self.backends[backend] = TensorBoardBackend(
                        self.run_dir, config, self.info, purge_step=resume_step + 1 if resume_step else 0
                    )
                elif backend == "wandb":
                    self.backends[backend] = WandbBackend(
                        self.run_dir, project, name, config, self.info, run_ids.get("wandb"), job_type
                    )
                elif backend == "mlflow":
                    self.backends[backend] = MlflowBackend(self.run_dir, project, name, config, self.info,
                                                           run_ids.get("mlflow"), tracking.get("mlflow_uri"))  # fmt: skip
        self.run_ids = {k: b.run_id for k, b in self.backends.items() if b.run_id is not None}
        atomic_write_json(self.run_dir / TRACKING_FILE,
                          {"loggers": list(loggers), "run_ids": self.run_ids, **self.info, "config": config})  # fmt: skip
        if self.backends:
            log.info("tracking %s: %s", ", ".join(self.backends), self.run_ids)

    def write(self, record: Mapping[str, Any]) -> None:
        """Log one record (``step``, ``split`` and values): a ``metrics.jsonl`` line, and its numbers to every
        backend unless an earlier attempt of this run logged that ``(split, step)`` already."""
        if self.jsonl is not None:
            self.jsonl.write(dict(record))
        step, values = int(record["step"]), scalars(record)
        logged = step <= self.logged.get(str(record.get("split")), -1)
        with python_random_kept():
            for backend in self.backends.values():
                if values and not (logged and backend.run_id is not None):
                    backend.log(values, step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        with python_random_kept():
            for backend in self.backends.values():
                backend.close()


def log_results(
    run_dir: str | Path,
    loggers: Sequence[str],
    job_type: str,
    results: Mapping[str, Mapping[str, Any]],
    *,
    config: Mapping[str, Any],
    tracking: Mapping[str, Any] | None,
) -> dict[str, str]:
    """A job without training steps (eval, distill) logs its results once, at its end, at step 0: each
    ``results[split]`` (nested values flattened to ``a.b``) to the backends of ``loggers`` (the job's ``logger``)
    and ``RUN_DIR/metrics.jsonl``, continuing the runs of an earlier start of the same run dir
    (``tracking.json``). ``config`` (the job's resolved config, plain containers) and ``tracking`` (its
    ``tracking`` group) are as :class:`Tracker` takes them.

    Returns:
        The backends' run ids.
    """
    run_dir = Path(run_dir)
    tracker = Tracker(run_dir, list(loggers), config=config, job_type=job_type, tracking=tracking,
                      run_ids=read_run_ids(run_dir))  # fmt: skip
    try:
        for split, values in results.items():
            tracker.write({**flatten(values), "step": 0, "split": split})
    finally:
        tracker.close()
    return tracker.run_ids
