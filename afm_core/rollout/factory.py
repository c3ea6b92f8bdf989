"""Build the generation engine and the tokenizer from the ``engine`` and ``model`` config sections."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from afm_core.rollout.engine import GenerationEngine

ENGINE_BACKENDS = ("vllm", "remote")


def load_tokenizer(hf_dir: str | Path) -> Any:
    """The HF tokenizer of a checkpoint directory (the one SFT tokenizes with)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir))


async def build_engine(engine_cfg: Mapping[str, Any], hf_dir: str | Path, tokenizer: Any = None) -> GenerationEngine:
    """``engine.backend: vllm`` starts vLLM on ``hf_dir``; ``remote`` connects to ``engine.url``.

    Raises:
        ValueError: an unknown backend, or ``remote`` without ``engine.url`` (names the key).
    """
    cfg = dict(engine_cfg)
    backend = cfg.get("backend", "vllm")
    if backend == "vllm":
        from afm_core.rollout.vllm_engine import VLLMEngine
        from afm_core.rollout.vllm_settings import VLLMConfig

        return await VLLMEngine.start(VLLMConfig.from_mapping(cfg, model=str(hf_dir)))
    if backend == "remote":
        from afm_core.rollout.remote_engine import RemoteEngine

        if not cfg.get("url"):
            raise ValueError("engine.url: set the base URL of an OpenAI-compatible server for engine.backend=remote")
        return RemoteEngine(
            url=cfg["url"],
            model=cfg.get("model_name") or str(hf_dir),
            tokenizer=tokenizer or load_tokenizer(hf_dir),
            max_model_len=int(cfg.get("max_model_len", 4096)),
            api_key_env=cfg.get("api_key_env"),
        )
    raise ValueError(f"engine.backend must be one of {', '.join(ENGINE_BACKENDS)}, got {backend!r}")
