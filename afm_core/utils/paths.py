"""Where things live: the repository, the shared real data, and the cache of converted models and data."""

from __future__ import annotations

import os
from pathlib import Path


def repo_root() -> Path:
    """The repository root (the folder holding ``afm_core/``)."""
    return Path(__file__).resolve().parents[2]


def shared_data_dir() -> Path:
    """The real data folder: ``$AFM_SHARED_DATA``, else ``<repo>/../shared/data``."""
    env = os.environ.get("AFM_SHARED_DATA")
    return Path(env).expanduser() if env else repo_root().parent / "shared" / "data"


def cache_dir() -> Path:
    """Cache of converted models and prepared data: ``$AFM_CACHE``, else ``~/.cache/afm``."""
    env = os.environ.get("AFM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "afm"
