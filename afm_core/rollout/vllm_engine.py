"""vLLM V1's ``AsyncLLM`` as the generation engine: token-id prompts, stop strings and sampled logprobs.

Two ways to hold the engine (``VLLMConfig.in_process``), both behind
:class:`~afm_core.rollout.engine.GenerationEngine` and started by :meth:`VLLMEngine.start`:

- :class:`VLLMEngine` (default, this module): ``AsyncLLM``, which runs the engine core in a child process;
  requests from many concurrent trajectories are batched continuously there. At TP 1 the model worker runs in
  that process too, on CPU as vLLM does it on GPU (:data:`~afm_core.rollout.vllm_platform.ENGINE_CORE_WORKER`:
  vLLM-CPU would start a third process for it, importing vLLM once more). Weight updates go through
  :meth:`VLLMEngine.collective_rpc` to a worker extension (``worker_extension_cls``), with bytes or file paths
  as arguments (tensors do not survive the msgpack hop to the engine-core process).
- :class:`~afm_core.rollout.vllm_inproc.InprocVLLMEngine`: the engine core in THIS process, stepped from the event
  loop, so that a weight update hands tensors to the worker by reference (RL colocation, lockstep TP groups).

Importing this module (or :mod:`~afm_core.rollout.vllm_inproc`) imports vLLM. The settings are
:mod:`afm_core.rollout.vllm_settings`'s, the engine arguments and vLLM-CPU's process settings
:mod:`afm_core.rollout.vllm_platform`'s, a request's ``SamplingParams`` and outputs
:mod:`afm_core.rollout.vllm_requests`'s.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
from pathlib import Path
from typing import Any

from vllm import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.usage.usage_lib import UsageContext
from vllm.utils.ompmultiprocessing import OMPProcessManager
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from afm_core.rollout.engine import EngineDead, EngineError, Generation, InFlight, SamplingConfig
from afm_core.rollout.vllm_inproc import InprocVLLMEngine
from afm_core.rollout.vllm_platform import ENGINE_CORE_WORKER, engine_args, modules_hidden_from_vllms_kernel_scan
from afm_core.rollout.vllm_requests import ServedAdapter, ServesAdapter, sampling_params, to_generation
from afm_core.rollout.vllm_settings import VLLMConfig
from afm_core.utils.hardware import cuda_available


class VLLMEngine(ServesAdapter):
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
        self.adapter = ServedAdapter()  # the LoRA adapter every request carries (cfg.max_lora_rank > 0)

    @classmethod
    async def start(cls, cfg: VLLMConfig) -> VLLMEngine | InprocVLLMEngine:
        """Start the engine (loads the weights; 14-20 s on a 2-core CPU at load 3 for tiny-llama as ``AsyncLLM``,
        most of it the engine-core process importing vLLM, ~3 s in process). ``cfg.in_process`` gives an
        :class:`~afm_core.rollout.vllm_inproc.InprocVLLMEngine`.

        Raises:
            FileNotFoundError: ``cfg.model`` is not a directory with a ``config.json``.
        """
        if not (Path(cfg.model) / "config.json").is_file():
            raise FileNotFoundError(
                f"engine model {cfg.model}: no config.json there (an HF checkpoint directory is needed)"
            )
        if cfg.in_process:
            return InprocVLLMEngine.create(cfg)
        # an in-process engine earlier in this process set it to 0, which would put this engine core in-process too
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
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
                    lora_request=self.adapter.request,
                ):
                    final = output
            except Exception as e:  # vLLM's input validation (VLLMValidationError) and engine errors
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

    async def load_adapter(self, path: str) -> int:
        """Serve the PEFT adapter directory ``path`` from now on (``AsyncLLM.remove_lora`` of the previous one,
        ``add_lora`` of this one: the engine core's worker reads it from disk); returns its int id. As
        :meth:`~afm_core.rollout.vllm_inproc.InprocVLLMEngine.load_adapter`.

        Raises:
            RuntimeError: the engine was started without LoRA.
        """
        if not self.serves_adapters:
            raise RuntimeError("load_adapter: the engine was started without LoRA (VLLMConfig.max_lora_rank=0)")
        request, old = self.adapter.swap(path)
        if old is not None:
            await self.llm.remove_lora(old)
        await self.llm.add_lora(request)
        return request.lora_int_id

    async def reset_prefix_cache(self) -> None:
        """Drop cached KV (after a weight update it was computed with the old weights)."""
        await self.llm.reset_prefix_cache()

    async def sleep(self, level: int = 1) -> None:
        """No-op: ``AsyncLLM`` engines are not put to sleep here (see
        :class:`~afm_core.rollout.vllm_inproc.InprocVLLMEngine`)."""

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
