"""Where an RL job's rollout engine lives, chosen by platform: the trainer and vLLM share the ranks of one job.

``colocation.mode`` (``conf/rl.yaml``):

- ``inprocess`` (``auto`` on CPU and GPU): the engine core runs inside every training rank
  (:class:`afm_core.rollout.vllm_inproc.InprocVLLMEngine`) on vLLM's ``external_launcher`` executor, which
  joins the job's ``torch.distributed`` world instead of spawning workers (vLLM
  ``examples/offline_inference/rlhf_colocate.py`` and ``torchrun_example.py``; verl
  ``verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py`` colocates the same way). vLLM's tensor-parallel
  groups are runs of ``engine.tensor_parallel_size`` consecutive ranks (``vllm/distributed/parallel_state.py::
  initialize_model_parallel``), so each group of ranks holds one engine whose TP shards live in those ranks
  (SPMD); its first rank runs the agent loop and the others follow it step by step
  (:class:`~afm_core.rollout.vllm_inproc.Lockstep`). The rollout prompts are split over the groups. A weight
  sync hands the gathered HF tensors to the rank's own worker by reference, bucket by bucket (on GPU no second
  full copy of the model is made); a LoRA policy's sync sends its adapters alone, which the engine serves on the
  base it started with (:mod:`afm_core.rl.lora_sync`). On GPU the engine is created with sleep mode: after generating it sleeps
  (``sleep(level)``: level 1 offloads its weights to CPU memory and drops the KV cache) so the trainer has the
  memory; before the sync it wakes its weights, after the sync its KV cache (verl
  ``verl/workers/sharding_manager/megatron_vllm.py``: ``wake_up(tags=["weights"])``, load,
  ``wake_up(tags=["kv_cache"])``; ``sleep(level=1)`` on exit). vLLM-CPU has no sleep mode ("Sleep mode is not
  supported on current platform"): there the engine stays awake (its KV cache is small and fixed,
  ``engine.cpu_kv_cache_gib``).
- ``async``: one ``AsyncLLM`` per rank at vLLM TP=1 with its engine core in a child process (the first CPU
  layout); the weights cross the process hop as safetensors bytes.

The GPU of a colocated rank is handed back and forth (:class:`Handover`, verl's order in
``verl/workers/sharding_manager/megatron_vllm.py`` and ``verl/workers/megatron_workers.py``): the engine's turn
(generation, validation) begins with its weights woken and, when the trainer stepped since, synced; then the
trainer's parameters, gradient buffers and optimizer state leave the GPU (``colocation.offload_trainer``:
:func:`afm_core.engine.offload.offload_training_state`) before the KV cache wakes; the trainer's turn (old
logprobs, updates, checkpoints, the HF export) begins with the engine asleep and the trainer's state back. The
engine starts beside the resident trainer (its ``gpu_memory_utilization`` share is claimed at start), which is
the peak ``jobs.plan`` counts as "generation".

Tested here on CPU: ``inprocess`` at vLLM TP=1 and TP=2 over gloo (the lockstep, the TP-sharded load), and the
handover with the offload forced on (``colocation.offload_trainer=true``: the state goes to host copies and its
storage is freed, the same calls as on GPU, though on CPU host and device memory are one).
Written but untested here: the GPU half (NCCL, CUDA tensors by reference, sleep/wake-up).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from afm_core.config.rl import ColocationConfig

if TYPE_CHECKING:  # torch, vLLM: jobs.plan imports this module (select_colocation) and builds nothing
    from afm_core.engine.offload import Offloaded
    from afm_core.rl.parts import EngineHost, TrainerCore
    from afm_core.rollout.vllm_inproc import Lockstep


@dataclass(frozen=True)
class Colocation:
    """The rollout-engine layout of one rank.

    Attributes:
        mode: ``inprocess`` or ``async``.
        on_gpu: whether the job runs on CUDA.
        engine_tp: vLLM tensor-parallel size (ranks per engine).
        sleep_level: vLLM sleep level around the training phase (0: the engine never sleeps).
        rank, world_size: this rank and the job's world size.
        offload_trainer: the trainer's state leaves the device during the engine's turn (:class:`Handover`).
    """

    mode: str
    on_gpu: bool
    engine_tp: int
    sleep_level: int
    rank: int
    world_size: int
    offload_trainer: bool = False

    @property
    def groups(self) -> int:
        """Engines in the job (the rollout prompts are split over them)."""
        return self.world_size // self.engine_tp

    @property
    def group(self) -> int:
        """This rank's engine."""
        return self.rank // self.engine_tp

    @property
    def leader(self) -> int:
        """The global rank that runs its engine's agent loop (the engine's first rank)."""
        return self.group * self.engine_tp

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def sleeps(self) -> bool:
        """Whether the engine sleeps while the trainer runs (GPU, in-process, ``sleep_level`` > 0)."""
        return self.on_gpu and self.mode == "inprocess" and self.sleep_level > 0

    def engine_overrides(self) -> dict[str, object]:
        """The ``engine`` settings this layout imposes (:class:`afm_core.rollout.vllm_settings.VLLMConfig`)."""
        if self.mode == "async":
            return {"in_process": False, "distributed_executor_backend": None, "enable_sleep_mode": False}
        return {
            "in_process": True,
            "distributed_executor_backend": "external_launcher",
            "tensor_parallel_size": self.engine_tp,
            "enable_sleep_mode": self.sleeps,
        }


def select_colocation(
    colocation: ColocationConfig, engine_tp: int, *, on_gpu: bool, rank: int, world_size: int
) -> Colocation:
    """This rank's :class:`Colocation` from ``colocation`` and ``engine.tensor_parallel_size`` (``engine_tp``; see
    the module docstring).

    ``colocation.offload_trainer``: null (default) offloads the trainer's state whenever the engine sleeps (GPU);
    true / false force it (true on CPU runs the same calls, for the tests).

    Raises:
        ValueError: ``engine.tensor_parallel_size`` not dividing the world, ``async`` with vLLM TP > 1 or on GPU
            (names the field). The mode and the sleep level are checked by the schema
            (:class:`~afm_core.config.rl.ColocationConfig`).
    """
    mode = "inprocess" if colocation.mode == "auto" else colocation.mode
    tp = engine_tp
    if tp < 1 or world_size % tp:
        raise ValueError(
            f"engine.tensor_parallel_size={tp}: must divide the job's {world_size} ranks (each run of {tp} "
            "consecutive ranks holds one vLLM engine)"
        )
    if mode == "async" and (tp > 1 or on_gpu):
        raise ValueError(
            "colocation.mode=async runs one AsyncLLM per rank at vLLM TP=1 on CPU; use colocation.mode=inprocess "
            f"(engine.tensor_parallel_size={tp}, {'GPU' if on_gpu else 'CPU'})"
        )
    placed = Colocation(mode, on_gpu, tp, colocation.sleep_level, rank, world_size)
    offload = colocation.offload_trainer
    return replace(placed, offload_trainer=placed.sleeps if offload is None else bool(offload))


def lockstep_group(colocation: Colocation) -> Lockstep | None:
    """The :class:`~afm_core.rollout.vllm_inproc.Lockstep` of this rank's engine (None at vLLM TP=1).

    Collective over the whole world (every rank creates every group's gloo group, in the same order).
    """
    import torch.distributed as dist  # torch, vLLM: only a layout with vLLM TP groups needs them (not jobs.plan)

    from afm_core.rollout.vllm_inproc import Lockstep

    if colocation.mode != "inprocess" or colocation.engine_tp == 1:
        return None
    mine = None
    for group in range(colocation.groups):
        ranks = list(range(group * colocation.engine_tp, (group + 1) * colocation.engine_tp))
        handle = dist.new_group(ranks, backend="gloo")
        if group == colocation.group:
            mine = Lockstep(handle, leader=ranks[0])
    return mine


class Handover:
    """Hands this rank's device between the rollout engine and the trainers (module docstring): each phase asks
    for its turn, and a turn already held is a no-op.

    Args:
        actor: this rank's :class:`~afm_core.rl.rollout_actor.RolloutActor`.
        trainers: the :class:`~afm_core.engine.core.MegatronTrainer` s whose state is offloaded (the policy's;
            PPO's critic's). The frozen KL reference stays (no gradients or optimizer state; its parameters are
            a bf16 copy of the policy's).
        offload: move the trainers' state off the device during the engine's turn (``Colocation.offload_trainer``).
        bucket_bytes: the weight sync's bucket size (``weight_sync.bucket_mb``).
    """

    def __init__(self, actor: EngineHost, trainers: Sequence[TrainerCore], *, offload: bool, bucket_bytes: int):
        self.actor, self.trainers, self.offload, self.bucket_bytes = actor, list(trainers), offload, bucket_bytes
        self.turn = "trainer"
        self.stale = True  # the engine's weights are not the trainer's (the engine started from the HF files)
        self.handles: list[Offloaded] = []
        self.offloaded_bytes = 0  # of the last offload

    def trained(self) -> None:
        """The policy's weights changed: the engine's next turn syncs them."""
        self.stale = True

    def to_engine(self) -> dict[str, float]:
        """The engine's turn: weights woken and synced if stale, trainer state offloaded, KV cache woken.

        Returns:
            Seconds and sizes of what it did: ``weight_sync_s``, ``weight_sync_gb_per_s`` and
            ``weight_sync_bytes/<path>`` (bytes sent per engine, under the path that ran: ``full``,
            ``lora_adapter`` or ``merged_full``, :class:`~afm_core.rl.weight_sync.WeightSyncStats`) when it synced;
            ``offload_s`` and ``offload_gb`` (device GB freed) when offloading.
        """
        if self.turn == "engine":
            return {}
        times: dict[str, float] = {}

        def offload() -> None:
            from afm_core.engine import offload as trainer_offload  # torch: not where jobs.plan imports this module

            if not self.offload:
                return
            start = time.perf_counter()
            for trainer in self.trainers:  # no deferred parameter all-gather may be pending (offload's contract)
                trainer.sync_params()
            self.handles = [trainer_offload.offload_training_state(trainer, enabled=True) for trainer in self.trainers]
            self.offloaded_bytes = sum(handle.bytes for handle in self.handles)
            times.update(offload_s=time.perf_counter() - start, offload_gb=self.offloaded_bytes / 1e9)

        if self.stale or not self.actor.keeps_weights_asleep:
            start = time.perf_counter()
            stats = self.actor.sync_weights(self.trainers[0].model, self.bucket_bytes, before_kv_cache=offload)
            times.update(weight_sync_s=time.perf_counter() - start - times.get("offload_s", 0.0))
            times["weight_sync_gb_per_s"] = stats.gb_per_s
            times[f"weight_sync_bytes/{stats.path}"] = float(stats.bytes)  # the key says which path ran
            self.stale = False
        else:
            self.actor.wake(before_kv_cache=offload)
        self.turn = "engine"
        return times

    def to_trainer(self) -> dict[str, float]:
        """The trainer's turn: the engine asleep (GPU), the trainers' state back. Returns ``reload_s`` when it
        reloaded."""
        if self.turn == "trainer":
            return {}
        self.actor.sleep()
        times: dict[str, float] = {}
        if self.handles:
            start = time.perf_counter()
            for handle in self.handles:
                handle.reload()
            self.handles = []
            times["reload_s"] = time.perf_counter() - start
        self.turn = "trainer"
        return times
