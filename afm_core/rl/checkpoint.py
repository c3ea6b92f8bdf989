"""An RL run's resumable state beside the models: the step counters (:class:`RLProgress`), the prompt stream's
position and the dynamic sampler's kept groups, saved as the ``common`` of ``checkpoints/step_N`` (N = rollout
steps done, taken at rollout-step boundaries) by :meth:`afm_core.rl.policy_trainer.PolicyTrainer.save`.

A resumed run continues at the saved prompt position (not step x batch: dynamic sampling consumes a variable
number of prompts) and stage, and ``metrics.jsonl`` is cut back to the checkpoint's step, so every rollout step
appears once. A stop requested while a generation round runs aborts the round and saves the state from before it
(the groups kept by the step's earlier rounds included): the step restarts there on resume.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


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


@dataclass
class RLState:
    """What an RL checkpoint holds besides the models: ``progress``, the ``stream``
    (:class:`~afm_core.rl.prompts.PromptStream`) and the ``sampler``
    (:class:`~afm_core.rl.dynamic_sampling.DynamicSampler`)."""

    progress: RLProgress
    stream: Any
    sampler: Any

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``common``: ``progress``, ``prompts``, ``sampler``."""
        return {
            "progress": asdict(self.progress),
            "prompts": self.stream.state_dict(),
            "sampler": self.sampler.state_dict(),
        }

    def load_state_dict(self, common: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s ``common`` in place (whoever holds ``progress`` sees the restored counters)."""
        loaded = RLProgress(**common["progress"])
        for f in fields(RLProgress):
            setattr(self.progress, f.name, getattr(loaded, f.name))
        self.stream.load_state_dict(common["prompts"])
        self.sampler.load_state_dict(common["sampler"])


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
