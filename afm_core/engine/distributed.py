"""torch.distributed + megatron parallel_state setup and teardown for one training process (one rank).

The caller (the job layer through submitit's ``TorchDistributedEnvironment``, or a test through
``torch.multiprocessing``) sets the ``env://`` variables RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT (LOCAL_WORLD_SIZE optional). The world is split Megatron's way into tensor (TP), pipeline (PP)
and data (DP) parallel groups: ``dp = world_size / (tp * pp * cp)``.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, is_dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from afm_core.config.timeouts import DEFAULT_COLLECTIVE_TIMEOUT_MIN
from afm_core.utils import hardware

if TYPE_CHECKING:
    from afm_core.config.sft import ParallelConfig

log = logging.getLogger(__name__)

_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits: global rank, the TP/PP/DP sizes and ranks, and its compute device."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    tp: int
    pp: int
    dp: int
    vpp: int | None
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def nodes(self) -> int:
        """Nodes of the job (ranks fill one node after another, ``local_world_size`` per node)."""
        return max(1, -(-self.world_size // max(1, self.local_world_size)))


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(
            f"environment variable {name} is not set; the launcher must export {', '.join(_REQUIRED_ENV)} "
            "(submitit.helpers.TorchDistributedEnvironment().export() does)"
        )
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None


class LauncherRanks(NamedTuple):
    """Where the ``env://`` launcher placed this process: RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def launcher_ranks() -> LauncherRanks:
    """This process's ranks from the ``env://`` variables (module docstring), MASTER_ADDR and MASTER_PORT checked
    too; LOCAL_WORLD_SIZE unset: WORLD_SIZE (one node). What both engines' process-group set-ups read
    (:func:`init_distributed`, ``afm_core.train.deepspeed_engine.init_deepspeed_distributed``).

    Raises:
        RuntimeError: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR or MASTER_PORT is not set, or a number is not an
            integer.
    """
    rank, world_size, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    _env_int("MASTER_PORT")
    if not os.environ.get("MASTER_ADDR"):
        raise RuntimeError("environment variable MASTER_ADDR is not set")
    return LauncherRanks(rank, world_size, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))


def training_dtype(precision: str, *, warn: bool = True) -> torch.dtype:
    """``trainer.precision`` as a dtype: ``auto`` is bf16 (with fp32 main weights) on a GPU and on a CPU that
    multiplies bf16 natively, else fp32 (:func:`afm_core.utils.hardware.bf16_is_fast`; ``AFM_CPU_BF16=1`` or ``0``
    forces the CPU's side; the rollout engine's ``dtype: auto`` follows the same rule, so trainer and engine
    agree). An explicit ``bf16`` on a CPU without native bf16 (and not forced by ``AFM_CPU_BF16=1``) is kept and,
    with ``warn``, logged as a warning: its matmuls run one to two orders of magnitude slower than fp32 (callers
    that only read the trainer's dtype, as the RL rollout actor, pass ``warn=False``).

    Raises:
        ValueError: not one of auto, fp32, bf16; ``AFM_CPU_BF16`` not 0, 1 or unset.
    """
    if precision == "auto":
        return torch.bfloat16 if hardware.bf16_is_fast() else torch.float32
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if precision not in dtypes:
        raise ValueError(f"trainer.precision={precision!r}: expected auto, fp32 or bf16")
    if precision == "bf16" and warn and not hardware.bf16_is_fast() and not hardware.cpu_has_native_bf16():
        log.warning(
            "trainer.precision=bf16 on a CPU without native bf16 (AVX512-BF16 or AMX): torch converts bf16 in "
            "software here and its matmuls run one to two orders of magnitude slower than fp32 "
            "(python -m benchmarks.roofline measures both); trainer.precision=auto picks fp32 on this CPU"
        )
    return dtypes[precision]


RECOMPUTE_CONFIG: dict[str | None, dict[str, Any]] = {
    None: {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def _parallel_fields(parallel: ParallelConfig | Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``parallel`` group's fields by name, whether the checked dataclass (``config.sft.ParallelConfig``, RL's
    too) or a mapping (a ``DictConfig`` or dict: the tests' and benchmarks' small groups)."""
    return asdict(parallel) if is_dataclass(parallel) else parallel  # type: ignore[arg-type, return-value]


def activation_memory_overrides(parallel: ParallelConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of ``parallel.recompute`` and ``parallel.sequence_parallel``: what every
    Megatron model of a job (the SFT model; the RL policy, its critic and its reference) is built with.

    ``recompute``: ``selective`` recomputes the core attention in backward; ``full`` keeps only each layer's
    input and recomputes the layer (Megatron-LM ``--recompute-granularity full --recompute-method uniform
    --recompute-num-layers 1``; Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models"). ``sequence_parallel`` shards the norms' and dropouts' activations over the TP ranks (same paper).

    Raises:
        ValueError: an unknown ``parallel.recompute``, or ``parallel.sequence_parallel`` without
            transformer-engine (GPU); the message names the field.
    """
    from afm_core.models.gpt import transformer_engine_available

    fields = _parallel_fields(parallel)
    recompute, sp = fields.get("recompute"), bool(fields.get("sequence_parallel"))
    if recompute not in RECOMPUTE_CONFIG:
        raise ValueError(f"parallel.recompute={recompute!r}: expected null, selective or full")
    if sp and not transformer_engine_available():
        raise ValueError("parallel.sequence_parallel needs transformer-engine (GPU)")
    return {"sequence_parallel": sp, **RECOMPUTE_CONFIG[recompute]}


def set_num_threads(num_threads: int | None, local_world_size: int) -> int:
    """``torch.set_num_threads`` to ``num_threads``, or ``max(1, cores // local_world_size)`` when None, after
    resolving oneMKL VML's kernels single-threaded (:func:`afm_core.utils.cpu_math.warm_vml`: otherwise a fresh
    process's first multi-threaded ``cos`` can come out inexact, the RoPE table of its first step included).

    Returns the thread count set. Cores are the CPUs this process may run on (``sched_getaffinity``).
    """
    from afm_core.utils.cpu_math import warm_vml

    warm_vml()
    if num_threads is None:
        num_threads = max(1, len(os.sched_getaffinity(0)) // max(1, local_world_size))
    torch.set_num_threads(int(num_threads))
    return int(num_threads)


def seed_everything(seed: int, pp_rank: int) -> None:
    """Seed python, numpy, torch and megatron's model-parallel RNG tracker like Megatron-LM.

    As in Megatron-LM ``training/initialize.py::_set_random_seed``: every pipeline stage gets
    ``seed + 100 * pp_rank``, and ``model_parallel_cuda_manual_seed`` derives the TP-rank-specific tracker
    state (``seed + 2718 + tp_rank``). DP ranks share the seed, so replicas initialise identically.
    """
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)


def model_parallel_groups(tp: int, pp: int, *, cp: int = 1, vpp: int | None = None, **options: Any) -> Any:
    """Megatron's TP / PP / CP / DP groups over the initialised default process group
    (``megatron.core.parallel_state.initialize_model_parallel``; ``options``: its other keywords, e.g.
    ``distributed_timeout_minutes``, ``create_gloo_process_groups``). Returns megatron's ``parallel_state``.

    Raises:
        RuntimeError: the world size is not divisible by ``tp * pp * cp`` (megatron's check).
    """
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        **options,
    )
    return ps


def init_distributed(
    parallel: ParallelConfig | Mapping[str, Any],
    *,
    seed: int,
    num_threads: int | None = None,
    timeout_min: int | None = None,
) -> ParallelLayout:
    """Join the process group (NCCL on GPU, gloo on CPU) and build megatron's TP/PP/DP groups.

    Args:
        parallel: the ``conf/parallel`` group (``tp``, ``pp``, ``cp``, ``vpp``): the checked dataclass, or a mapping.
        seed: base random seed (see :func:`seed_everything`).
        num_threads: torch CPU threads for this rank; None: cores // LOCAL_WORLD_SIZE.
        timeout_min: collective timeout in minutes; None: ``parallel.collective_timeout_min`` when set (``jobs.rl``
            sizes it from the rollout timeout: :func:`collective_timeout_min`), else 30.
    Returns:
        The :class:`ParallelLayout` of this rank.
    Raises:
        RuntimeError: a required env variable is missing, or WORLD_SIZE is not divisible by tp * pp * cp.
    """
    from megatron.core import parallel_state as ps

    from afm_core.engine.cpu_shims import apply_cpu_shims
    from afm_core.engine.multi_tensor import use_foreach_kernels

    rank, world_size, local_rank, local_world_size = ranks = launcher_ranks()
    fields = _parallel_fields(parallel)
    tp, pp, cp = int(fields["tp"]), int(fields["pp"]), int(fields.get("cp", 1))
    if world_size % (tp * pp * cp):
        raise RuntimeError(f"WORLD_SIZE={world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    vpp = fields.get("vpp")
    if timeout_min is None:
        timeout_min = int(fields.get("collective_timeout_min") or DEFAULT_COLLECTIVE_TIMEOUT_MIN)

    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        apply_cpu_shims()
        device, backend = torch.device("cpu"), "gloo"
    use_foreach_kernels()
    set_num_threads(num_threads, local_world_size)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=timeout_min),
        )
    model_parallel_groups(tp, pp, cp=cp, vpp=vpp, distributed_timeout_minutes=timeout_min)
    layout = ParallelLayout(
        **ranks._asdict(),
        tp=tp,
        pp=pp,
        dp=ps.get_data_parallel_world_size(),
        vpp=vpp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        device=device,
    )
    seed_everything(seed, layout.pp_rank)
    return layout


def destroy_distributed() -> None:
    """Tear down megatron's parallel groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's picklable ``obj`` of the process ``group`` (default: all ranks), in rank order (collective)."""
    parts: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(parts, obj, group=group)
    return parts


def broadcast_object(obj: Any) -> Any:
    """Rank 0's picklable ``obj`` on every rank (collective)."""
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
