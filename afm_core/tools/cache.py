"""A TTL cache of tool observations: an in-memory LRU in front of an optional SQLite file on disk.

Keys are ``(tool name, call key)``; values are observation strings; each entry expires ``ttl_s`` seconds
after it was stored (wall-clock time, so entries on disk expire across restarts too). The upstream
Serper cache server keeps a ``TTLCache(maxsize=1_000_000, ttl=3600)`` and appends pickles to a file
(OPPO-PersonalAI/Agent_Foundation_Models, ``verl/server/v2/cache_serper_server_v2_train.py`` at commit 8536230); SQLite gives the same persistence with atomic writes, and
several processes (e.g. rollout workers) can share one file (WAL mode, 5 s busy timeout).
"""

from __future__ import annotations

import sqlite3
import time
from collections import OrderedDict
from pathlib import Path


class ToolCache:
    """TTL cache, in memory (``max_entries``, least recently used evicted) and optionally on disk."""

    def __init__(self, path: str | Path | None = None, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._memory: OrderedDict[tuple[str, str], tuple[float, str]] = OrderedDict()
        self._db: sqlite3.Connection | None = None
        if path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, timeout=5.0, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS observations "
                "(tool TEXT NOT NULL, key TEXT NOT NULL, expires REAL NOT NULL, value TEXT NOT NULL, PRIMARY KEY (tool, key))"
            )
            self._db.execute("DELETE FROM observations WHERE expires <= ?", (time.time(),))

    def get(self, tool: str, key: str) -> str | None:
        """The cached observation, or None when absent or expired."""
        now = time.time()
        hit = self._memory.get((tool, key))
        if hit is not None:
            if hit[0] > now:
                self._memory.move_to_end((tool, key))
                return hit[1]
            del self._memory[(tool, key)]
        if self._db is None:
            return None
        row = self._db.execute(
            "SELECT expires, value FROM observations WHERE tool = ? AND key = ? AND expires > ?", (tool, key, now)
        ).fetchone()
        if row is None:
            return None
        self._remember((tool, key), row[0], row[1])
        return row[1]

    def put(self, tool: str, key: str, value: str, ttl_s: float) -> None:
        """Store ``value`` for ``ttl_s`` seconds (in memory, and on disk when a path was given)."""
        expires = time.time() + ttl_s
        self._remember((tool, key), expires, value)
        if self._db is not None:
            self._db.execute(
                "INSERT OR REPLACE INTO observations (tool, key, expires, value) VALUES (?, ?, ?, ?)",
                (tool, key, expires, value),
            )

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _remember(self, k: tuple[str, str], expires: float, value: str) -> None:
        self._memory[k] = (expires, value)
        self._memory.move_to_end(k)
        while len(self._memory) > self.max_entries:
            self._memory.popitem(last=False)
