"""An RL run's resumable state beside the models: the step counters (:class:`RLProgress`), the prompt stream's
position and the dynamic sampler's kept groups, saved as the ``common`` of ``checkpoints/step_N`` (N = rollout
steps done, taken at rollout-step boundaries) by :meth:`afm_core.rl.policy_trainer.PolicyTrainer.save`.

A resumed run continues at the saved prompt position (not step x batch: dynamic sampling consumes a variable
number of prompts) and stage, and ``metrics.jsonl`` is cut back to the checkpoint's step, so every rollout step
appears once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
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
        self.progress = RLProgress(**common["progress"])
        self.stream.load_state_dict(common["prompts"])
        self.sampler.load_state_dict(common["sampler"])
