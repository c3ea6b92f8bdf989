"""The schema of the ``tools`` group (``conf/tools/default.yaml``): the client side of the tools, as
:func:`afm_core.tools.registry.build_tool_pool` and :mod:`afm_core.tools.job_servers` read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from afm_core.config.checks import require


@dataclass
class ToolCacheConfig:
    """``tools.cache``: the tool-call cache (:class:`afm_core.tools.cache.ToolCache`); ``path`` None: memory only."""

    path: str | None = None
    max_entries: int = 100_000


@dataclass
class ToolsConfig:
    """``tools``: the addresses file of the tool servers, the cache (None: none), the pool's connection limits (aiohttp's: 0 is none) and
    ``fail_fast`` (fixed keys), and ``tools``, one entry per tool tag: open-ended, since each tool takes its own
    settings (``server`` or ``url``, ``limits``, the tool's arguments such as ``topk`` or ``timeout_s``; a plug-in's
    ``_target_``; null: the tool is off), checked where the pool builds it (:func:`afm_core.tools.registry.
    build_tools`) and, for plug-ins, at submit (:func:`afm_core.utils.plugins.check_plugins`).

    Raises:
        ConfigError: a tool entry that is not a mapping or null.
    """

    addresses_file: str = "runs/tool_servers/addresses.json"
    cache: ToolCacheConfig | None = None
    connection_limit: int = 512
    connection_limit_per_host: int = 256
    fail_fast: bool = False
    tools: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for tag, entry in self.tools.items():
            require(entry is None or isinstance(entry, dict), f"tools.tools.{tag}", entry, "a mapping, or null (off)")
