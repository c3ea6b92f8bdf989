"""Preemption and timeout handling: checkpoint at the next step boundary, then requeue, then resume.

submitit's own handler (``submitit.core.job_environment.SignalHandler.checkpoint_and_try_requeue``) runs the
job's ``checkpoint()`` *inside* the signal handler and exits at once, i.e. in the middle of an optimizer step.
:class:`RequeueableJob` instead relays the signal (``SIGUSR2``, or ``$SUBMITIT_PREEMPT_SIGNAL``) to the trainer
(``on_preempt``: "checkpoint at the next step boundary, then return"), and once the trainer has returned with a
complete checkpoint it hands over to submitit's handler, which decides and does the rest exactly as upstream:

- *preempted* vs *timed-out*: a signal counts as a timeout when the job ran at least
  ``min(0.8 * time, time - 10 min)``; only timeouts use up ``max_num_timeout`` (so a job with ``time < 13`` minutes
  counts every signal, a preemption included, as a timeout); with none left the job fails with
  ``UncompletedJobError("Job not requeued because: timed-out too many times.")``;
- requeue: Slurm ``scontrol requeue <id>`` (the job restarts with ``SLURM_RESTART_COUNT`` + 1 after the
  ``cred_expire`` delay), or exit code 144 for submitit's local controller, which restarts the ranks.

The same callable is resubmitted (``Checkpointable.checkpoint``); on restart the trainer resumes from the latest
complete checkpoint in ``cfg.run_dir``. Signals reach every rank (``scancel --signal=USR2``, preemption with
``preempt_send_user_signal``, the local controller); the trainer OR-reduces the flag so all ranks stop at the same
step, and only rank 0 requeues (as in submitit, other ranks never requeue).
"""

from __future__ import annotations

import importlib.util
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit
from hydra.utils import get_method
from omegaconf import OmegaConf
from submitit.core.utils import UncompletedJobError

from afm_core.launch.distributed import export_distributed_env
from afm_core.launch.placement import check_own_rank, describe, job_placement
from afm_core.launch.records import append_event, record_start
from afm_core.utils.process_exit import skip_final_gc

log = logging.getLogger(__name__)


def check_importable(dotted: str) -> None:
    """Fail early (without importing it) when the module part of ``"pkg.module.name"`` cannot be found.

    Raises:
        ValueError: no such module.
    """
    module = dotted.rpartition(".")[0]
    if not module or importlib.util.find_spec(module) is None:
        raise ValueError(f"{dotted!r}: no importable module {module!r}")


class PreemptionRelay:
    """Take over submitit's preemption-signal handler (remembering it) and relay the signal to a hook.

    Installed before the trainer is imported (seconds); a signal that arrives before :meth:`connect` is passed
    on when the hook connects. The hook runs inside the signal handler, so it must only set flags.

    Raises:
        RuntimeError: not inside a submitit job (no submitit handler installed).
    """

    def __init__(self):
        self.signum = signal.Signals["SIG" + submitit.JobEnvironment.USR_SIG]
        self.submitit_handler = signal.getsignal(self.signum)
        if not callable(self.submitit_handler):
            raise RuntimeError(f"no submitit handler for {self.signum.name}: not running inside a submitit job")
        self.received = False
        self.received_at: float | None = None  # unix seconds of the first signal (the relay's own clock)
        self.on_preempt: Callable[[], None] | None = None
        signal.signal(self.signum, self._relay)

    def _relay(self, signum: int, frame: Any) -> None:
        self.received = True
        if self.received_at is None:
            self.received_at = time.time()
        if self.on_preempt is not None:
            self.on_preempt()

    def connect(self, on_preempt: Callable[[], None]) -> None:
        """Relay to ``on_preempt`` from now on (at once if a signal already came)."""
        self.on_preempt = on_preempt
        if self.received:
            on_preempt()

    def timed_out(self) -> bool:
        """submitit's rule: the job ran at least ``min(0.8 * time, time - 10 min)``."""
        return self.submitit_handler.__self__.has_timed_out()

    def requeue(self) -> None:
        """Run submitit's handler: ``checkpoint()``, requeue, exit (or raise ``UncompletedJobError``).

        Slurm answers ``scontrol requeue`` by cancelling the job's running step, which sends SIGTERM to every
        process of the step, the ``scontrol`` that rank 0 runs included. When that signal reaches ``scontrol``
        before it exits, submitit's ``check_call`` raises although the job was requeued; this exits as submitit
        does after a requeue instead (seen under load: the job restarted, but no ``requeued`` event was recorded
        and the attempt left an error result).
        """
        try:
            self.submitit_handler(self.signum, None)
        except subprocess.CalledProcessError as err:
            if list(err.cmd[:2]) != ["scontrol", "requeue"] or err.returncode != -signal.SIGTERM:
                raise
            log.warning("scontrol requeue was terminated by the cancellation of the job's step: the job is requeued")
            sys.exit(-1)  # as submitit's handler after a requeue (JobEnvironment._exit)


class RequeueableJob(submitit.helpers.Checkpointable):
    """``fn(cfg)`` on one rank of a submitit job, resumable after preemption or timeout.

    Contract with ``fn`` (``afm_core.train.sft.run_sft``, ``afm_core.rl.driver.run_rl`` and later jobs):

    - ``fn(cfg) -> dict`` runs on every rank with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
      MASTER_PORT exported; ``cfg`` is the config as a ``DictConfig``, or what ``load_cfg`` makes of that
      ``DictConfig`` (e.g. ``afm_core.config.rl.rl_config``: a checked ``RLConfig``); it resumes from the latest
      complete checkpoint in the config's ``run_dir``;
    - ``on_preempt()`` asks it to checkpoint at the next step boundary and return (signal-safe);
    - its result has ``"stopped_early": True`` when it returned for that reason before finishing.

    Rank 0 records ``start`` / ``requeued`` / ``completed`` / ``failed`` in ``RUN_DIR/logs/events.jsonl``. At each
    start every rank prints where it runs; rank 0 prints the rank → node map, ``MASTER_ADDR`` and the world size
    and records them in ``RUN_DIR/logs/job.json`` (:mod:`afm_core.launch.placement`).

    ``fn``, ``on_preempt`` and ``load_cfg`` are dotted paths (``"afm_core.train.sft.run_sft"``) imported in the job
    only, so submitting does not import the trainer (torch, megatron).

    Args:
        fn: dotted path of the per-rank function.
        cfg: the fully resolved config as plain containers (``run_dir`` required); kept so in the pickled job (a
            requeued job starts from it again, :mod:`afm_core.launch.sweep` reads its ``cluster``).
        on_preempt: dotted path of the trainer's checkpoint-and-stop hook.
        master_port: rendezvous port for local jobs (see :func:`export_distributed_env`).
        load_cfg: dotted path of ``load_cfg(cfg: DictConfig) -> Any``, called on every rank (inside the job, so
            an error it raises is recorded as ``failed``) to make the config ``fn`` receives; None: ``fn`` gets
            the ``DictConfig``.
    Raises:
        ValueError: no ``cfg.run_dir``; ``fn``, ``on_preempt`` or ``load_cfg`` names no importable module.
    """

    load_cfg: str | None = None  # the class default: a job pickled before load_cfg existed resumes unchanged

    def __init__(
        self,
        fn: str,
        cfg: dict[str, Any],
        on_preempt: str,
        master_port: int | None = None,
        load_cfg: str | None = None,
    ):
        if not cfg.get("run_dir"):
            raise ValueError("cfg.run_dir is not set: the job needs a run directory")
        for path in (fn, on_preempt, *([load_cfg] if load_cfg else [])):
            check_importable(path)
        self.fn = fn
        self.cfg = cfg
        self.on_preempt = on_preempt
        self.master_port = master_port
        self.load_cfg = load_cfg

    @property
    def log_dir(self) -> Path:
        return Path(self.cfg["run_dir"]) / "logs"

    def __call__(self) -> dict[str, Any]:
        skip_final_gc()  # a rank that imported torch / vLLM exits in ~1 s instead of 3-9 s (under load)
        relay = PreemptionRelay()
        dist = export_distributed_env(self.master_port)
        relay.connect(get_method(self.on_preempt))
        rank0 = dist.rank == 0
        placement = job_placement(dist.world_size, dist.master_addr, dist.master_port)
        print(check_own_rank(placement, dist.rank, dist.local_rank), flush=True)
        if rank0:
            print("\n".join(describe(placement)), flush=True)
            record_start(self.log_dir, placement)
            append_event(
                self.log_dir,
                "start",
                job_id=placement["job_id"],
                host=socket.gethostname(),
                world_size=dist.world_size,
                nodelist=placement["nodelist"],
                master_addr=placement["master_addr"],
            )
        try:
            cfg = OmegaConf.create(self.cfg)
            summary = get_method(self.fn)(get_method(self.load_cfg)(cfg) if self.load_cfg else cfg)
        except Exception as err:
            if rank0:
                append_event(self.log_dir, "failed", error=f"{type(err).__name__}: {err}")
            raise
        if not summary.get("stopped_early"):
            if rank0:
                append_event(self.log_dir, "completed", step=summary.get("step"))
            return summary
        if not rank0:
            log.info("rank %d: stopped at step %s for a requeue; rank 0 requeues", dist.rank, summary.get("step"))
            sys.exit(0)  # no result file: the job is not over
        reason = "timed-out" if relay.timed_out() else "preempted"
        try:
            relay.requeue()
        except UncompletedJobError as err:
            append_event(self.log_dir, "failed", error=str(err), step=summary.get("step"))
            raise
        except SystemExit:
            append_event(
                self.log_dir, "requeued", reason=reason, step=summary.get("step"), signal_time=relay.received_at
            )
            raise
        raise RuntimeError("submitit's handler returned after a requeue; it should have exited")
