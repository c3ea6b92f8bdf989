"""vLLM on this platform: the engine arguments of a :class:`~afm_core.rollout.vllm_settings.VLLMConfig` and the
process settings vLLM-CPU needs, for both engine wrappers (:mod:`afm_core.rollout.vllm_engine`,
:mod:`afm_core.rollout.vllm_inproc`).

On GPU machines vLLM is ``vllm``; on machines without CUDA it is ``vllm-cpu`` (same package name and API, CPU
kernels), which needs a few settings that this module applies before the engine starts (from vLLM's CPU backend
docs and ``vllm/platforms/cpu.py``):

- a KV-cache size (engine argument ``kv_cache_memory_bytes``): without one vLLM takes ~90% of the NUMA node
  for KV cache. vLLM's legacy ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB only, parsed with ``int()`` in
  ``vllm/platforms/cpu.py``) still wins when the user sets it;
- an inductor cache under ``$AFM_CACHE`` (``TORCHINDUCTOR_CACHE_DIR``): vLLM compiles its sampler with
  inductor once (~15 s cold), then reuses it;
- the engine's OpenMP threads (``cpu_threads``): vLLM binds its worker to one core per physical core *minus one
  reserved for the scheduler* (``vllm/utils/ompmultiprocessing.py``, ``OMPProcessManager``), which on a 2-core
  machine halves decoding; ``VLLM_CPU_OMP_THREADS_BIND`` is set to the cores this process may use instead;
- bf16 weights and KV cache where the CPU multiplies bf16 natively (AVX512-BF16 or AMX: vLLM's oneDNN GEMMs and
  its CPU attention then move half the bytes), else fp32;
- eager execution unless ``enforce_eager=false`` asks for vLLM's CPU compile path (``vllm/platforms/cpu.py``: dynamo
  traced once, inductor's C++ backend, no Triton; RMSNorm, SiLU-and-mul and the residual adds fused), which costs
  a compile of a minute or more at engine start on a cold cache (``VLLM_CACHE_ROOT`` under ``$AFM_CACHE``);
- no per-request seeds: when chunked prefill splits a seeded request, vLLM rewinds its generator with
  ``torch.Generator.set_offset`` (``vllm/v1/worker/gpu_model_runner.py``, ``sample_tokens``), which CPU
  generators do not have ("CPU Generator does not use offset" kills the engine). Requests then draw from
  the engine's seeded generator instead (both wrappers' ``per_request_seeds``: on GPU only).

Two process-level workarounds of vLLM-CPU 0.32 live here too: :func:`modules_hidden_from_vllms_kernel_scan` (its
kernel-override scan of ``sys.modules``) and :func:`unlink_cpu_shm_files` (its shared-memory names left on the node).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from afm_core.rollout.vllm_settings import VLLMConfig
from afm_core.utils.hardware import bf16_is_fast, cuda_available
from afm_core.utils.paths import cache_dir


def prepare_cpu_environment(cpu_threads: int | None = None) -> list[int]:
    """Environment vLLM-CPU reads at engine start (set only where the user has not set them).

    Returns:
        The cores the engine's worker is bound to (``VLLM_CPU_OMP_THREADS_BIND``).

    Raises:
        ValueError: ``cpu_threads`` < 1 or more than the cores this process may use.
    """
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(cache_dir() / "vllm"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    allowed = sorted(os.sched_getaffinity(0))
    if cpu_threads is not None and not 1 <= cpu_threads <= len(allowed):
        raise ValueError(
            f"engine.cpu_threads must be in [1, {len(allowed)}] (the cores this process may use), got {cpu_threads}"
        )
    cores = allowed[: cpu_threads or len(allowed)]
    global _bind_set_here
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND") in (None, _bind_set_here):  # unset, or set by an earlier engine
        _bind_set_here = os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    return cores


_bind_set_here: str | None = None  # the VLLM_CPU_OMP_THREADS_BIND this module set (a user's value is left alone)


@contextlib.contextmanager
def modules_hidden_from_vllms_kernel_scan() -> Iterator[None]:
    """Take the modules that vLLM-CPU's kernel-override scan cannot read out of ``sys.modules`` while an engine
    starts, and put them back after.

    When a vLLM worker starts, vLLM-CPU 0.32 rebinds its kernel overrides by walking every module in
    ``sys.modules`` and calling ``vars(value).get`` on each attribute value that has a ``__dict__``
    (vllm ``vllm/triton_utils/dispatcher.py``, ``_rebind_kernels``). llvmlite's ``ffi.lib``
    (llvmlite ``llvmlite/binding/ffi.py``, a ctypes proxy whose ``__getattr__`` answers ``__dict__`` too) makes
    that raise ``AttributeError`` once numba has been imported in the process, e.g. by an earlier engine: a
    second in-process engine then fails to start. A forked engine core inherits ``sys.modules``, so this covers
    it as well.
    """
    hidden: dict[str, Any] = {}
    for name, module in list(sys.modules.items()):
        for value in list((getattr(module, "__dict__", None) or {}).values()):
            try:
                unreadable = hasattr(value, "__dict__") and not isinstance(vars(value), Mapping)
            except Exception:
                unreadable = True
            if unreadable:
                hidden[name] = module
                break
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)


#: The executor of an ``AsyncLLM`` on CPU at TP 1: its worker runs in the engine-core process (vllm_cpu_executor).
ENGINE_CORE_WORKER = "afm_core.rollout.vllm_cpu_executor.EngineCoreWorkerExecutor"


def engine_args(cfg: VLLMConfig) -> dict[str, Any]:
    """vLLM engine arguments of ``cfg`` on this platform (CPU: bf16 where native, a KV-cache size in bytes; an
    ``AsyncLLM`` at TP 1 runs its worker in the engine-core process, :data:`ENGINE_CORE_WORKER`).

    Raises:
        ValueError: ``cpu_kv_cache_gib <= 0`` or sleep mode on CPU.
    """
    on_gpu = cuda_available()
    if not on_gpu:
        prepare_cpu_environment(cfg.cpu_threads)
    dtype = cfg.dtype
    if dtype == "auto":
        dtype = "bfloat16" if bf16_is_fast(on_gpu) else "float32"
    args: dict[str, Any] = dict(
        model=cfg.model,
        tokenizer=cfg.model,
        dtype=dtype,
        max_model_len=cfg.max_model_len,
        tensor_parallel_size=cfg.tensor_parallel_size,
        max_num_seqs=cfg.max_num_seqs,
        enable_prefix_caching=cfg.enable_prefix_caching,
        enforce_eager=(not on_gpu) if cfg.enforce_eager is None else cfg.enforce_eager,
        seed=cfg.seed,
        logprobs_mode=cfg.logprobs_mode,
    )
    if on_gpu:
        args["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    else:
        if cfg.cpu_kv_cache_gib <= 0:
            raise ValueError(f"engine.cpu_kv_cache_gib must be > 0, got {cfg.cpu_kv_cache_gib}")
        if cfg.enable_sleep_mode:
            raise ValueError("engine.enable_sleep_mode: vLLM's sleep mode needs CUDA (vLLM refuses it on CPU)")
        args["kv_cache_memory_bytes"] = int(cfg.cpu_kv_cache_gib * 2**30)
    if cfg.worker_extension_cls:
        args["worker_extension_cls"] = cfg.worker_extension_cls
    if cfg.distributed_executor_backend:
        args["distributed_executor_backend"] = cfg.distributed_executor_backend
    elif not on_gpu and not cfg.in_process and cfg.tensor_parallel_size == 1:
        args["distributed_executor_backend"] = ENGINE_CORE_WORKER  # no third process (see vllm_engine.VLLMEngine.start)
    if cfg.enable_sleep_mode:
        args["enable_sleep_mode"] = True
    if cfg.max_lora_rank:  # one adapter at a time, the policy's (vLLM-CPU: PunicaWrapperCPU's torch kernels)
        args.update(enable_lora=True, max_lora_rank=cfg.lora_engine_rank, max_loras=1, max_cpu_loras=1)
    return args


def unlink_cpu_shm_files() -> list[str]:
    """Remove the names of this process's vLLM-CPU shared-memory segments (the TP and PP groups' all-reduce
    buffers) once the engine is built; returns the names removed.

    vLLM-CPU's ``_CPUSHMDistributed`` (``vllm/distributed/device_communicators/cpu_communicator.py``) has each rank
    of a TP/PP group create ``/dev/shm/<VLLM_DIST_IDENT>-<group>-[<ranks>]-cpushm_<rank>`` with ``O_EXCL`` and the
    others map it; the name is never removed when the process ends. Under ``external_launcher`` the identifier is
    the same for every job (``"//"``, from the ``env://`` init method), so the files one run leaves behind make
    the next TP > 1 engine on the node fail with ``create shm in SHMManager failed. errno: 17`` (seen: a second
    suite run on one machine). Every rank has mapped every segment once the engine exists (vLLM joins them
    between two barriers), so the names can go: the mappings stay valid, and nothing is left on the node.
    """
    try:  # vLLM-CPU's communicator: absent from a CUDA build of vLLM
        from _posixshmem import shm_unlink

        from vllm.distributed import parallel_state
        from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    except ImportError:  # not a CPU build of vLLM
        return []
    removed = []
    for group in (parallel_state._TP, parallel_state._PP):
        communicator = getattr(group, "device_communicator", None)
        shm = getattr(communicator, "dist_module", None)
        if isinstance(shm, _CPUSHMDistributed):
            name = "/" + f"{shm.group_name}_{shm.communicator.rank}".lstrip("/")
            with contextlib.suppress(FileNotFoundError):
                shm_unlink(name)
                removed.append(name)
    return removed
