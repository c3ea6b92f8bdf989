"""The parts an RL run swaps, named by what the driver and its pieces call on them (``typing.Protocol`` s, as
torchtitan names its model and optimizer parts). Each has one implementation; a test's stand-in needs only what
is named here.

- :class:`TrainerCore`: :class:`afm_core.engine.core.MegatronTrainer`, under the policy and the critic
  (``policy_trainer``, ``batch``, ``colocation``);
- :class:`ValueModel`: :class:`afm_core.rl.critic.Critic` (``policy_trainer``);
- :class:`Policy`: :class:`afm_core.rl.policy_trainer.PolicyTrainer` (``driver``, ``checkpoint``);
- :class:`Turns`: :class:`afm_core.rl.colocation.Handover` (``train_batch``, ``validation``, ``checkpoint``,
  ``driver``);
- :class:`EngineHost`: :class:`afm_core.rl.rollout_actor.RolloutActor` as the handover drives it;
- :class:`ColocatedEngine`: :class:`afm_core.rollout.vllm_inproc.InprocVLLMEngine`, the generation engine the
  rollout actor drives;
- :class:`ToolBackend`: :class:`afm_core.tools.pool.ToolPool` or
  :class:`afm_core.rollout.simulated_tools.SimulatedTools`, what answers the tool calls.

Nothing here imports a module that imports this one (``tests/test_import_graph.py`` counts the imports under
``TYPE_CHECKING`` too), so every module of ``rl/`` may name these types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from afm_core.rl.weight_sync import WeightReceiver
from afm_core.rollout.agent_loop import ToolRunner
from afm_core.rollout.engine import GenerationEngine

if TYPE_CHECKING:
    from afm_core.engine.distributed import ParallelLayout
    from afm_core.rl.advantages import Advantages
    from afm_core.rl.grading import Sample
    from afm_core.rl.weight_sync import WeightSyncStats
    from afm_core.rollout.vllm_inproc import Lockstep

#: A megatron ``forward_step_func``: ``(data_iterator, model) -> (output, loss function)``.
ForwardStep = Callable[[Iterator[dict[str, torch.Tensor]], torch.nn.Module], tuple[torch.Tensor, object]]

#: A metrics record (``metrics.jsonl``, a loss report, a checkpoint's ``common``): JSON-like values by name.
Record = dict[str, object]


class TrainerCore(Protocol):
    """The one trainer core under the policy and the critic (:class:`afm_core.engine.core.MegatronTrainer`)."""

    @property
    def layout(self) -> ParallelLayout: ...

    @property
    def model(self) -> list[torch.nn.Module]:
        """This rank's model chunks (one per virtual pipeline stage)."""
        ...

    def step(
        self,
        micro_batches: list[dict[str, torch.Tensor]],
        forward_step: ForwardStep,
        *,
        seq_length: int,
        micro_batch_size: int,
        what: str,
    ) -> tuple[list[dict[str, dict[str, torch.Tensor]]], float, float]:
        """One optimizer step: ``(the micro batches' loss reports, grad norm, lr)``; FloatingPointError on
        non-finite gradients."""
        ...

    def save(self, step: int, common: Record) -> Path:
        """``checkpoint_dir/step_N`` with ``common`` (collective)."""
        ...

    def load(self, path: Path) -> tuple[Record, Record]:
        """``(common, this rank's state)`` of the checkpoint ``path``, loaded into the model and optimizer."""
        ...

    def sync_params(self) -> None:
        """Finish a deferred parameter all-gather (the distributed optimizer's)."""
        ...


class ValueModel(Protocol):
    """PPO's critic (:class:`afm_core.rl.critic.Critic`): values, updates and checkpoints of the value model."""

    @property
    def trainer(self) -> TrainerCore: ...

    def values(self, samples: Sequence[Sample], seq_length: int, pad_id: int) -> list[list[float]]:
        """Old values of every sample's response tokens (collective; every rank gets all of them)."""
        ...

    def update(self, samples: Sequence[Sample], old_values: Sequence[Sequence[float]],
               returns: Sequence[Sequence[float]], seq_length: int, pad_id: int) -> dict[str, float]:  # fmt: skip
        """The critic's mini-batch updates on ``returns`` (clipped around ``old_values``); its ``critic/*``
        metrics."""
        ...

    def save(self, step: int) -> Path: ...

    def load(self, actor_checkpoint: Path) -> Path: ...


class Policy(Protocol):
    """The trainer side of a run (:class:`afm_core.rl.policy_trainer.PolicyTrainer`): advantages, updates,
    checkpoints and the HF export of the policy (and its critic)."""

    @property
    def trainers(self) -> list[TrainerCore]:
        """The cores whose state leaves the device during the engine's turn: the policy's, then the critic's."""
        ...

    def advantages(self, samples: Sequence[Sample], seq_length: int) -> Advantages: ...

    def train(
        self, samples: Sequence[Sample], advantages: Advantages, seq_length: int, version: int | None = None
    ) -> Record:
        """The step's updates; their metrics (``optimizer_steps``, losses, times, throughput)."""
        ...

    def save(self, step: int, common: Record) -> Path: ...

    def load(self, path: Path) -> Record:
        """Load ``path`` into the models and optimizers; its ``common``."""
        ...

    def export_hf(self, hf_dir: Path, out_dir: Path) -> Path: ...


class Turns(Protocol):
    """Whose turn the device is (:class:`afm_core.rl.colocation.Handover`): the engine's (generation, validation)
    or the trainer's (updates, checkpoints). Each call returns the seconds and sizes of what it did."""

    def to_engine(self) -> dict[str, float]: ...

    def to_trainer(self) -> dict[str, float]: ...

    def trained(self) -> None:
        """The policy's weights changed: the engine's next turn syncs them."""
        ...


class EngineHost(Protocol):
    """The rollout side as the handover drives it (:class:`afm_core.rl.rollout_actor.RolloutActor`)."""

    @property
    def keeps_weights_asleep(self) -> bool: ...

    def sync_weights(
        self,
        model_chunks: Sequence[torch.nn.Module],
        bucket_bytes: int,
        before_kv_cache: Callable[[], None] | None = None,
    ) -> WeightSyncStats: ...

    def wake(self, before_kv_cache: Callable[[], None] | None = None) -> None: ...

    def sleep(self) -> None: ...


class ColocatedEngine(GenerationEngine, WeightReceiver, Protocol):
    """A generation engine in the training ranks (:class:`afm_core.rollout.vllm_inproc.InprocVLLMEngine`): what the
    rollout actor calls beyond :class:`~afm_core.rollout.engine.GenerationEngine` (and the weight sync's
    :class:`~afm_core.rl.weight_sync.WeightReceiver`), each only where the layout
    asks for it (sleep mode on GPU; the follower ranks of a vLLM TP group). ``idle`` and ``sampled_tokens`` are
    looked up with ``getattr``: engines that abort as a cancellation arrives, or count no tokens, lack them."""

    lockstep: Lockstep | None

    async def sleep(self, level: int = 1) -> None: ...

    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    def follow(self) -> int:
        """Mirror the leader's engine steps until its round ends (a follower rank)."""
        ...

    def end_round(self) -> None:
        """Release the followers (the leader, after a round)."""
        ...


class ToolBackend(ToolRunner, Protocol):
    """What answers the agent loop's tool calls and reports on them: the real tools' pool
    (:class:`afm_core.tools.pool.ToolPool`) or a model writing the observations
    (:class:`afm_core.rollout.simulated_tools.SimulatedTools`, ``rollout.environment: simulated``)."""

    def metrics_snapshot(self) -> dict[str, dict]:
        """``{tool: its counters}`` (calls, errors, latency...)."""
        ...
