"""Validation during RL: which benchmarks (``trainer.val_benchmarks`` presets + ``val.benchmark_files``), when
(``trainer.val_before_train``; every ``trainer.test_freq`` rollout steps and at the last) and the run itself on
engine 0 with the live weights, logged as a ``split: val`` record (verl's ``test_freq`` / ``val_before_train``,
``verl/trainer/ppo/ray_trainer.py`` ``fit``; slime's ``eval_interval``, ``train.py``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from afm_core.config.rl import ValidationConfig
from afm_core.rl.metrics import RLMetricsLog
from afm_core.rl.rounds import RolloutAborted

if TYPE_CHECKING:  # torch, vLLM: jobs.rl loads this module (the driver) where it only submits
    from afm_core.eval.benchmarks import Benchmark
    from afm_core.rl.parts import Turns
    from afm_core.rl.rollout_actor import RolloutActor


def validation_benchmarks(validation: ValidationConfig) -> list[Benchmark]:
    """The benchmarks validated during training (``trainer.val_benchmarks`` presets + ``val.benchmark_files``, each
    cut to its ``limit``); [] when neither ``trainer.val_before_train`` nor ``trainer.test_freq`` asks for one.

    Raises:
        ValueError: validation asked for with no benchmark named, an unknown preset (the message names the keys).
        FileNotFoundError: a benchmark file or a preset's data file is absent (the message names the keys).
    """
    from afm_core.eval.runner import load_benchmarks  # the eval runner: only a run that validates loads it

    v = validation
    if not v.asked:
        return []
    if not v.presets and not v.benchmark_files:
        raise ValueError("trainer.val_before_train / trainer.test_freq: set trainer.val_benchmarks=[gsm8k_test,...] "
                         "and/or val.benchmark_files=[my.jsonl]")  # fmt: skip
    try:
        return load_benchmarks(v.presets, v.benchmark_files, v.data_dir, v.eval)
    except (ValueError, FileNotFoundError) as err:
        raise naming(f"trainer.val_benchmarks={v.presets} / val.benchmark_files={v.benchmark_files}", err) from None


def naming(keys: str, err: Exception) -> Exception:
    """``err`` (a ValueError or FileNotFoundError of the task loader) as the same kind of error, led by ``keys``."""
    return (FileNotFoundError if isinstance(err, FileNotFoundError) else ValueError)(f"{keys}: {err}")


class Validation:
    """When and how the run validates: before training (``validation.before_train``, at rollout step 0 only: not
    again on a resume) and after every ``validation.test_freq``-th rollout step and the last (``max_steps``);
    nothing when ``benchmarks`` is empty.

    Args:
        benchmarks: :func:`validation_benchmarks`.
        validation: the settings (``val`` holds ``afm_core.eval.runner.validate``'s eval settings).
        actor: this rank's :class:`~afm_core.rl.rollout_actor.RolloutActor`.
        handover: the :class:`~afm_core.rl.colocation.Handover` (:class:`~afm_core.rl.parts.Turns`; the engine's
            turn syncs the trained weights).
        metrics: the :class:`~afm_core.rl.metrics.RLMetricsLog` the record goes to.
    """

    def __init__(self, benchmarks: list[Benchmark], validation: ValidationConfig, *, max_steps: int,
                 actor: RolloutActor, handover: Turns, metrics: RLMetricsLog):  # fmt: skip
        self.benchmarks, self.eval_cfg = benchmarks, validation.eval
        self.before_train, self.test_freq, self.max_steps = validation.before_train, validation.test_freq, max_steps
        self.actor, self.handover, self.metrics = actor, handover, metrics

    def before_training(self, step: int) -> dict[str, float]:
        """Validate the starting weights when asked (``trainer.val_before_train``) and ``step`` (the rollout
        steps done) is 0. Returns what :meth:`run` returns ({} when it did not validate)."""
        if self.benchmarks and self.before_train and step == 0:
            return self.run(0)
        return {}

    def after_step(self, step: int) -> dict[str, float]:
        """Validate after rollout step ``step`` when it is a ``test_freq``-th one or the last. Returns what
        :meth:`run` returns ({} when it did not validate)."""
        if self.benchmarks and self.test_freq > 0 and (step % self.test_freq == 0 or step == self.max_steps):
            return self.run(step)
        return {}

    def run(self, step: int) -> dict[str, float]:
        """Validate the live weights on engine 0 (its TP followers mirror it; the other ranks go on to the next
        collective) and log the ``split: val`` record at ``step`` (rank 0). Every rank calls it: the engine's turn
        (the weight sync) is collective. A stop requested meanwhile (USR2, preemption) aborts it: no record for
        this step, and the job goes on to its checkpoint.

        Returns:
            the engine's turn's times and sizes (:meth:`~afm_core.rl.colocation.Handover.to_engine`: weight sync,
            trainer offload), for the next rollout step's record: that step generates in the same turn and would
            otherwise log none of them.
        """
        handover_times = self.handover.to_engine()
        if self.actor.engines[1] != 0:
            return handover_times
        start = time.perf_counter()
        try:
            results = self.actor.validate(self.benchmarks, self.eval_cfg)
        except RolloutAborted:
            if self.metrics.log is not None:
                print(f"[rl] stop requested during rollout step {step}'s validation: aborted, not logged", flush=True)
            return handover_times
        self.metrics.write_validation(step, results, time.perf_counter() - start)
        return handover_times
