"""Submit a per-rank function as a submitit job on the configured cluster (the body of every ``jobs/*.py`` app)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, TypeVar

from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf

from afm_core.config import ConfigError, check_config
from afm_core.launch import sweep
from afm_core.launch.distributed import without_rendezvous_env
from afm_core.launch.executor import make_executor, world_size
from afm_core.launch.follow import wait_streaming
from afm_core.launch.plan_gate import PlanRefused, check_before_submit
from afm_core.launch.records import job_record, write_job_record
from afm_core.launch.requeue import RequeueableJob
from afm_core.launch.teardown import stop_children_on_interrupt
from afm_core.utils.ports import free_port

T = TypeVar("T")


def submit(
    fn: str, cfg: DictConfig, *, on_preempt: str, job_name: str, load_cfg: str | None = None
) -> dict[str, Any] | None:
    """Run ``fn(cfg)`` (or ``fn(load_cfg(cfg))``) on every rank of a job on ``cfg.cluster``; return rank 0's result when waiting.

    The config is resolved here (``run_dir`` is Hydra's output dir) and travels with the job as plain
    containers. The job's submitit files and the ranks' logs go to ``RUN_DIR/logs/`` with ``job.json`` (see
    :mod:`afm_core.launch.records`). Rendezvous variables this process inherited (``MASTER_ADDR``, ``RANK``, ...:
    :func:`afm_core.launch.distributed.without_rendezvous_env`) do not reach the job.

    - ``cluster=local``: ``tp * pp * cp * cluster.dp`` processes on this machine.
    - ``cluster=slurm``: ``sbatch``; prints the job id, the follow command and the log path. Inside a Slurm
      multirun the job joins the sweep's job array instead (:mod:`afm_core.launch.sweep`) and None is returned.

    With ``cluster.wait`` it streams rank 0's output until the job ends and returns its result; otherwise it
    returns None at once. SIGTERM or Ctrl-C while waiting cancels a Slurm job (``scancel``); a local job's
    processes get SIGINT and are waited for, those left after the grace time are killed
    (:func:`afm_core.launch.teardown.stop_children_on_interrupt`), before ``KeyboardInterrupt`` is raised.

    Args:
        fn: dotted path of the per-rank function (see :class:`RequeueableJob` for its contract).
        cfg: the app config with ``run_dir``, ``cluster`` and ``parallel``.
        on_preempt: dotted path of ``fn``'s checkpoint-at-the-next-step-and-return hook.
        job_name: Slurm job name.
        load_cfg: dotted path of what makes ``fn``'s config from the ``DictConfig`` on each rank (e.g.
            ``"afm_core.config.rl.rl_config"``); None: ``fn`` gets the ``DictConfig``. The job keeps the plain
            containers either way.
    Raises:
        afm_core.launch.executor.ClusterConfigError: bad ``cluster`` / ``parallel`` values.
        ValueError: ``fn``, ``on_preempt`` or ``load_cfg`` names no importable module.
        submitit.core.utils.FailedJobError: (waiting) a rank raised; the message holds its traceback.
        submitit.core.utils.UncompletedJobError: (waiting) the job ended without a result.
    """
    job_cfg = OmegaConf.to_container(cfg, resolve=True)
    run_dir = Path(job_cfg["run_dir"]).absolute()
    job_cfg["run_dir"] = str(run_dir)
    cluster = job_cfg["cluster"]
    ranks = world_size(cluster, job_cfg["parallel"])
    local = cluster["name"] == "local"
    job = RequeueableJob(fn, job_cfg, on_preempt, master_port=free_port() if local else None, load_cfg=load_cfg)
    if not local and sweep.collecting():
        sweep.add_member(sweep.ArrayMember(job=job, job_name=job_name, world_size=ranks))
        return None

    log_dir = run_dir / "logs"
    executor = make_executor(cluster, job_cfg["parallel"], log_dir, job_name)
    # a local job waited for is this process's children: stopping this process stops them (afm_core.launch.teardown)
    with stop_children_on_interrupt() if local and cluster.get("wait") else nullcontext():
        with without_rendezvous_env() as stale:  # the ranks rendezvous on the job's own values, not inherited ones
            submitted = executor.submit(job)
        write_job_record(log_dir, job_record(submitted, job_name, cluster["name"], ranks))
        _announce(submitted, job_name, cluster, ranks, run_dir, stale)
        if not cluster.get("wait"):
            return None
        return wait_streaming(submitted, cancel_on_interrupt=not local)


def _announce(
    submitted: Any, job_name: str, cluster: dict[str, Any], ranks: int, run_dir: Path, stale: dict[str, str]
) -> None:
    """Where the job runs (Slurm: its id, the follow command and the log), and the rendezvous variables kept out."""
    if stale:
        print(f"[afm] {job_name}: not passed to the job (inherited rendezvous variables): {', '.join(stale)}")
    if cluster["name"] == "local":
        print(f"[afm] {job_name}: {ranks} rank(s) on this machine (job {submitted.job_id}); run dir {run_dir}")
        return
    where = f" on partition {cluster['partition']}" if cluster.get("partition") else ""
    print(
        f"Submitted Slurm job {submitted.job_id} ({job_name}, {ranks} rank(s){where})\n"
        f"  follow: python -m jobs.status {run_dir} --follow\n"
        f"  log:    {submitted.paths.stdout}"
    )


def check_job_config(
    cfg: DictConfig,
    job_name: str,
    schema: type[T],
    *,
    check_inputs: Callable[[Any], object] | None = None,
    load_cfg: str | None = None,
) -> T:
    """The config gate of every job (``jobs.sft``, ``jobs.rl``, ``jobs.eval``, ``jobs.distill``,
    ``jobs.filter_rl``), run before anything is built or submitted.

    ``cfg`` is checked against its typed ``schema`` (:func:`afm_core.config.check_config`): an unknown key, a value
    of the wrong type or a failed range or cross-field check exits with status 2 and one line,
    ``jobs.<job_name>: bad config: <key>=<value>: <valid values>``. With ``check_inputs``, the config is then made
    as the ranks will get it (``load_cfg``'s result, e.g. ``afm_core.config.rl.rl_config``; None: the resolved
    plain dicts and lists) and handed to it (data files, plug-ins, a resumed run dir's settings): a ValueError or
    FileNotFoundError it raises exits with status 2 and its message.

    Returns:
        The checked ``schema`` instance (what the plan of a ``cluster=slurm`` job reads).
    Raises:
        SystemExit: status 2, after the message on stderr.
    """
    try:
        checked = check_config(cfg, schema)
    except ConfigError as err:
        print(f"jobs.{job_name}: bad config: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if check_inputs is not None:
        try:
            check_inputs(
                get_method(load_cfg)(cfg) if load_cfg is not None else OmegaConf.to_container(cfg, resolve=True)
            )
        except (ValueError, FileNotFoundError) as err:
            print(f"jobs.{job_name}: {err}", file=sys.stderr)
            raise SystemExit(2) from None
    return checked


def run_job(
    fn: str,
    cfg: DictConfig,
    *,
    job_name: str,
    schema: type,
    on_preempt: str,
    load_cfg: str | None = None,
    check_inputs: Callable[[Any], object] | None = None,
    plan: bool = False,
) -> dict[str, Any] | None:
    """The body of every app (``jobs.sft``, ``jobs.rl`` through :func:`run_training_job`; ``jobs.eval``,
    ``jobs.distill``, ``jobs.filter_rl``): the config gate (:func:`check_job_config`: ``cfg`` against its typed
    ``schema``, then ``check_inputs`` on the config as the ranks will get it; exit status 2 and one line naming the
    key or the input), with ``plan`` the plan of a ``cluster=slurm`` job on the checked config (``schema``: an
    ``SFTConfig`` or ``RLConfig``; :mod:`afm_core.launch.plan_gate`: one that does not fit its GPUs exits with
    status 3 before ``sbatch``, naming the numbers and the overrides that would fit; ``+plan.force=true`` submits
    anyway), then :func:`submit` ``fn`` with its ``on_preempt`` hook and
    ``load_cfg`` (the dotted path of what makes ``fn``'s config on each rank, e.g.
    ``"afm_core.config.eval.eval_config"``). Returns rank 0's result when waiting (see :func:`submit`)."""
    checked: Any = check_job_config(cfg, job_name, schema, check_inputs=check_inputs, load_cfg=load_cfg)
    if plan:
        try:
            check_before_submit(checked)  # cluster=slurm: the plan first; exit 3 when it does not fit
        except PlanRefused as err:
            print(f"jobs.{job_name}: not submitted: {err}", file=sys.stderr)
            raise SystemExit(3) from None
    return submit(fn, cfg, on_preempt=on_preempt, job_name=job_name, load_cfg=load_cfg)


def run_training_job(
    fn: str,
    cfg: DictConfig,
    *,
    job_name: str,
    schema: type,
    check_inputs: Callable[[Any], object] | None = None,
    load_cfg: str | None = None,
) -> dict[str, Any] | None:
    """The body of a training app (``jobs.sft``, ``jobs.rl``): :func:`run_job` with the plan of a ``cluster=slurm``
    job and the trainer's checkpoint-and-requeue hook (:func:`afm_core.engine.preemption.request_checkpoint`);
    prints rank 0's summary as JSON when waiting."""
    summary = run_job(fn, cfg, job_name=job_name, schema=schema, on_preempt="afm_core.engine.preemption.request_checkpoint",
                      load_cfg=load_cfg, check_inputs=check_inputs, plan=True)  # fmt: skip
    if summary is not None:
        print(json.dumps(summary, indent=2, default=str))
    return summary
