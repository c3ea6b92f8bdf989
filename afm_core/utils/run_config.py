"""The composed config a per-rank job function receives, as plain containers, and its run dir."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


def plain_config(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` as plain dicts and lists with its interpolations resolved (a mapping is copied shallowly)."""
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)  # type: ignore[return-value]


def open_run(cfg: DictConfig | Mapping[str, Any]) -> tuple[dict[str, Any], Path]:
    """:func:`plain_config` and ``cfg.run_dir``, created; INFO logging to stderr (eval, distillation)."""
    plain = plain_config(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_dir = Path(plain["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    return plain, run_dir
