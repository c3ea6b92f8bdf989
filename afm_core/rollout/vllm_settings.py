"""The vLLM engine's settings: its own (:class:`VLLMSettings`, the fields of ``conf/engine/vllm.yaml``) and how this
process holds it (:class:`VLLMConfig`). Plain dataclasses, importable without vLLM: the RL job's ``engine`` schema
(:class:`afm_core.config.engine.VLLMEngineConfig`) extends :class:`VLLMSettings`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The adapter ranks vLLM's LoRA kernels are built for (``vllm/config/lora.py`` ``MaxLoRARanks``).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


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
        in_process: run the engine core in this process
            (:class:`~afm_core.rollout.vllm_inproc.InprocVLLMEngine`) instead of ``AsyncLLM``'s child process.
        distributed_executor_backend: vLLM's executor; ``external_launcher`` (in-process only) makes the engine
            one SPMD member of the caller's ``torch.distributed`` world (its TP shards live in the caller's
            ranks); None: vLLM's default.
        enable_sleep_mode: allow :meth:`~afm_core.rollout.vllm_inproc.InprocVLLMEngine.sleep` / ``wake_up``
            (CUDA only: vLLM refuses it on CPU).
        max_lora_rank: serve LoRA adapters up to this rank (vLLM's ``enable_lora``, one adapter at a time: the RL
            policy's, :meth:`~afm_core.rollout.vllm_inproc.InprocVLLMEngine.load_adapter`); 0: no LoRA.
        lora_dir: where the trainer writes the adapters this engine loads (a directory every rank of the job
            sees: the run dir's); set with ``max_lora_rank``.

    Raises:
        ValueError: ``external_launcher`` without ``in_process``; ``max_lora_rank`` < 0 or above vLLM's largest
            (:data:`LORA_RANKS`); ``max_lora_rank`` without ``lora_dir``.
    """

    model: str
    in_process: bool = False
    distributed_executor_backend: str | None = None
    enable_sleep_mode: bool = False
    max_lora_rank: int = 0
    lora_dir: str | None = None

    def __post_init__(self) -> None:
        if self.distributed_executor_backend == "external_launcher" and not self.in_process:
            raise ValueError(
                "engine.distributed_executor_backend=external_launcher needs engine.in_process=true (the engine "
                "core must run in the ranks of the torch.distributed world)"
            )
        if not 0 <= self.max_lora_rank <= LORA_RANKS[-1]:
            raise ValueError(f"max_lora_rank={self.max_lora_rank}: 0 (no LoRA) up to vLLM's {LORA_RANKS[-1]}")
        if self.max_lora_rank and not self.lora_dir:
            raise ValueError("max_lora_rank > 0 needs lora_dir (where the trainer writes the adapters to serve)")

    @property
    def lora_engine_rank(self) -> int:
        """vLLM's ``max_lora_rank`` for :attr:`max_lora_rank`: the smallest of :data:`LORA_RANKS` that holds it."""
        return next(rank for rank in LORA_RANKS if rank >= self.max_lora_rank)

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
