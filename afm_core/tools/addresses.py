"""The addresses file: which tool server listens where.

``python -m jobs.tool_servers`` writes it once every server answers ``GET /health``; trainers and evaluators
read it (:func:`read_addresses`) and build their :class:`~afm_core.tools.pool.ToolPool` from it. The file is
JSON ``{"servers": {name: base_url}, "pid": int, "host": str, "started_at": float}`` and is written
atomically (:func:`afm_core.utils.atomic.atomic_write_json`): a reader sees the whole file or none.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def read_addresses(path: str | Path, wait_s: float = 0.0) -> dict[str, str]:
    """The ``{server name: base URL}`` map from an addresses file.

    Args:
        path: the file written by ``jobs.tool_servers``.
        wait_s: seconds to wait for the file to appear (a Slurm job may still be starting).

    Raises:
        FileNotFoundError: the file did not appear within ``wait_s``.
        ValueError: the file is not an addresses file (names the file and the field).
    """
    path = Path(path)
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() >= deadline:
            raise FileNotFoundError(f"tool server addresses file {path} not found (waited {wait_s:g} s)")
        time.sleep(0.2)
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from e
    servers = payload.get("servers") if isinstance(payload, dict) else None
    if not isinstance(servers, dict) or not all(isinstance(v, str) for v in servers.values()):
        raise ValueError(f"{path}: field 'servers' must map server names to base URLs")
    return servers
