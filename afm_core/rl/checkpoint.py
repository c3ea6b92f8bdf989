"""An RL run's resumable state beside the models: the step counters (:class:`RLProgress`), the prompt stream's
position and the dynamic sampler's kept groups, saved as the ``common`` of ``checkpoints/step_N`` (N = rollout
steps done, taken at rollout-step boundaries) by :meth:`afm_core.rl.policy_trainer.PolicyTrainer.save`.

A resumed run continues at the saved prompt position (not step x batch: dynamic sampling consumes a variable
number of prompts) and stage, and ``metrics.jsonl`` is cut back to the checkpoint's step, so every rollout step
appears once. A stop requested while a generation round runs saves the rollout buffer with the rest
(:mod:`afm_core.rl.train_batch`, ``rollout.partial.on_stop``): the resumed run continues the paused trajectories
(``keep``), or redraws the round from the state before it (``restart``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from afm_core.config.rl import CheckpointConfig
from afm_core.engine.preemption import Preemption
from afm_core.rl.dynamic_sampling import DynamicSampler
from afm_core.rl.prompts import PromptStream
from afm_core.rl.rollout_buffer import RolloutBuffer
from afm_core.rl.schedule import Stage

if TYPE_CHECKING:  # torch: jobs.rl loads this module (the driver) where it only submits
    from afm_core.rl.parts import Policy, Record, Turns


@dataclass
class RLProgress:
    """Counters saved in every checkpoint (identical on all ranks)."""

    rollout_step: int = 0  # rollout steps done
    optimizer_steps: int = 0
    stage: int = 0
    prompts_consumed: int = 0
    samples_trained: int = 0
    train_time_s: float = 0.0
    run_ids: dict[str, str] = field(default_factory=dict)  # tracking backends' runs (W&B, MLflow), continued on resume

    def enter_stage(self, stage: Stage, *, verbose: bool) -> None:
        """The next rollout step runs in ``stage`` (:class:`~afm_core.rl.schedule.Stage`); a new stage is printed
        when ``verbose``."""
        if stage.index != self.stage:
            if verbose:
                print(f"[rl] rollout step {self.rollout_step + 1}: stage {stage.index}, max_response_len "
                      f"{stage.max_response_len}", flush=True)  # fmt: skip
            self.stage = stage.index

    def step_done(self, samples_trained: int, optimizer_steps: int, seconds: float) -> None:
        """Count one rollout step: ``samples_trained`` samples in ``optimizer_steps`` optimizer steps, ``seconds``
        of wall time."""
        self.rollout_step += 1
        self.optimizer_steps += optimizer_steps
        self.samples_trained += samples_trained
        self.train_time_s += seconds


@dataclass
class RLState:
    """What an RL checkpoint holds besides the models: ``progress``, the ``stream``
    (:class:`~afm_core.rl.prompts.PromptStream`), the ``sampler``
    (:class:`~afm_core.rl.dynamic_sampling.DynamicSampler`) and the rollout ``buffer``
    (:class:`~afm_core.rl.rollout_buffer.RolloutBuffer`: groups with paused trajectories)."""

    progress: RLProgress
    stream: PromptStream
    sampler: DynamicSampler
    buffer: RolloutBuffer = field(default_factory=RolloutBuffer)

    def state_dict(self) -> Record:
        """The checkpoint's ``common``: ``progress``, ``prompts``, ``sampler``, ``buffer``."""
        sampler = self.sampler.state_dict()  # its kept samples as plain dicts (a weights_only load reads them)
        sampler["kept"] = [(g, [asdict(s) for s in members]) for g, members in self.sampler.kept]
        return {
            "progress": asdict(self.progress),
            "prompts": self.stream.state_dict(),
            "sampler": sampler,
            "buffer": self.buffer.state_dict(),
        }

    def load_state_dict(self, common: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s ``common`` in place (whoever holds ``progress`` sees the restored counters)."""
        loaded = RLProgress(**common["progress"])
        for f in fields(RLProgress):
            setattr(self.progress, f.name, getattr(loaded, f.name))
        self.stream.load_state_dict(common["prompts"])
        from afm_core.rl.grading import Sample  # imports torch: not where jobs.rl submits

        sampler = dict(common["sampler"])
        sampler["kept"] = [(g, [Sample.from_dict(s) if isinstance(s, dict) else s for s in members])
                           for g, members in sampler["kept"]]  # fmt: skip
        self.sampler.load_state_dict(sampler)
        self.buffer.load_state_dict(common.get("buffer"))  # absent in checkpoints from before the buffer


class StopLead:
    """Checks, with this run's own timings, that ``cluster.signal_delay_s`` (``--signal=USR2@N``) covers a stop: a
    stop asked for during generation costs only the abort and the checkpoint, one asked for during the trainer's
    turn waits for the step boundary first, so the lead must cover the longest trainer's turn plus the checkpoint
    write. Prints a warning (rank 0) each time a step needs more than the lead and more than any step before."""

    def __init__(self, lead_s: int, *, enabled: bool):
        self.lead_s, self.enabled, self.worst_s = lead_s, enabled, 0.0

    def observe(self, step: int, trainer_s: float, checkpoint_s: float) -> None:
        """Rollout step ``step``: ``trainer_s`` seconds from the trainer's turn to the save, ``checkpoint_s`` for it."""
        needed = trainer_s + checkpoint_s
        if self.enabled and self.lead_s and needed > max(self.lead_s, self.worst_s):
            print(f"[rl] warning: a stop during rollout step {step}'s training would need {needed:.0f} s "
                  f"(training {trainer_s:.0f} s, checkpoint {checkpoint_s:.0f} s) > cluster.signal_delay_s="
                  f"{self.lead_s}: set it to at least {int(needed * 1.5) + 60} (the job may be killed before its "
                  "checkpoint is complete)", flush=True)  # fmt: skip
        self.worst_s = max(self.worst_s, needed)


class Checkpointer:
    """When the run saves, and the save: at every ``save_interval``-th rollout step, at the last (``max_steps``)
    and when ``preemption`` asks (USR2 / preemption, read at the step boundary; a stop also ends the run), each
    with its :class:`StopLead` check; and the state from before a generation round a stop aborted.

    Args:
        policy: the :class:`~afm_core.rl.policy_trainer.PolicyTrainer` (:class:`~afm_core.rl.parts.Policy`:
            ``save(step, common)``).
        handover: the :class:`~afm_core.rl.colocation.Handover` (:class:`~afm_core.rl.parts.Turns`; a save is the
            trainer's turn).
        state: the run's :class:`RLState`, saved as the checkpoint's ``common``.
        preemption: the job's :class:`~afm_core.engine.preemption.Preemption`.
        checkpoint: the settings (``save_interval``; ``signal_delay_s``, the lead :class:`StopLead` checks).
        max_steps: ``trainer.max_steps`` (rollout steps).
        on_gpu: the ranks' device (the flags' reduction runs there).
        verbose: this rank prints (rank 0).
    """

    def __init__(self, policy: Policy, handover: Turns, state: RLState, preemption: Preemption,
                 checkpoint: CheckpointConfig, *, max_steps: int, on_gpu: bool, verbose: bool):  # fmt: skip
        self.policy, self.handover, self.state, self.preemption = policy, handover, state, preemption
        self.save_interval, self.max_steps, self.on_gpu = checkpoint.save_interval, max_steps, on_gpu
        self.verbose = verbose
        self.lead = StopLead(checkpoint.signal_delay_s, enabled=verbose)
        self.last: Path | None = None  # the last checkpoint written
        self.trainer_turn = time.perf_counter()

    def trainer_turn_starts(self) -> None:
        """The trainer's turn began: from here a stop waits for the step boundary and its checkpoint."""
        self.trainer_turn = time.perf_counter()

    def at_step_end(self, step: int) -> bool:
        """After rollout step ``step`` (collective): save when due or asked; True when a stop was asked and steps
        are left (the run ends here)."""
        want, stop = self.preemption.boundary_flags(self.on_gpu)  # USR2 / preemption, OR-ed over ranks
        if want or step % self.save_interval == 0 or step == self.max_steps:
            self.handover.to_trainer()
            start = time.perf_counter()
            self.last = self.policy.save(step, self.state.state_dict())
            self.lead.observe(step, start - self.trainer_turn, time.perf_counter() - start)
        return stop and step < self.max_steps

    def save_stopped_round(self) -> None:
        """A stop came during a generation round: serve the request and save ``state``, which holds the round's
        complete groups and paused trajectories (``rollout.partial.on_stop=keep``: the resumed run continues them)
        or the state from before the round (``restart``: the resumed run redraws it)."""
        self.preemption.boundary_flags(self.on_gpu)  # the request is served: cleared on every rank
        self.handover.to_trainer()
        step = self.state.progress.rollout_step
        self.last = self.policy.save(step, self.state.state_dict())
        if self.verbose:
            kept = len(self.state.buffer)
            print(f"[rl] stop requested during rollout step {step + 1}'s generation: checkpoint {self.last} "
                  f"({kept} groups in the rollout buffer)", flush=True)  # fmt: skip
