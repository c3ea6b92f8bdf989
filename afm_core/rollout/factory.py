"""Build the generation engine and the tokenizer from the ``engine`` and ``model`` config sections."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from afm_core.rollout.engine import GenerationEngine
from afm_core.rollout.vllm_settings import VLLMConfig

ENGINE_BACKENDS = ("vllm", "remote")


def load_tokenizer(hf_dir: str | Path) -> Any:
    """The HF tokenizer of a checkpoint directory (the one SFT tokenizes with)."""
    from transformers import AutoTokenizer  # heavy (seconds): only a job that tokenizes pays for it

    return AutoTokenizer.from_pretrained(str(hf_dir))


async def build_engine(engine_cfg: Mapping[str, Any], hf_dir: str | Path, tokenizer: Any = None) -> GenerationEngine:
    """``engine.backend: vllm`` starts vLLM on ``hf_dir``; ``remote`` connects to ``engine.url``.

    Args:
        engine_cfg: the ``engine`` group alone (a mapping: ``dataclasses.asdict`` of the job's engine settings, or
            its YAML), never the job's whole config.
    Raises:
        ValueError: an unknown backend, or ``remote`` without ``engine.url`` (names the key).
    """
    engine = dict(engine_cfg)
    backend = engine.get("backend", "vllm")
    if backend == "vllm":
        from afm_core.rollout.vllm_engine import VLLMEngine  # imports vLLM (seconds): only this backend needs it

        return await VLLMEngine.start(VLLMConfig.from_mapping(engine, model=str(hf_dir)))
    if backend == "remote":
        from afm_core.rollout.remote_engine import RemoteEngine  # imports aiohttp: only a remote engine needs it

        url = engine.get("url")
        if not url:
            raise ValueError("engine.url: set the base URL of an OpenAI-compatible server for engine.backend=remote")
        return RemoteEngine(
            url=url,
            model=engine.get("model_name") or str(hf_dir),
            tokenizer=tokenizer or load_tokenizer(hf_dir),
            max_model_len=int(engine.get("max_model_len", 4096)),
            api_key_env=engine.get("api_key_env"),
        )
    raise ValueError(f"engine.backend must be one of {', '.join(ENGINE_BACKENDS)}, got {backend!r}")
