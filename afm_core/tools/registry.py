"""Build the tools and their :class:`~afm_core.tools.pool.ToolPool` from a config and an addresses file.

Config (``conf/tools/default.yaml``; plain dicts or OmegaConf nodes)::

    addresses_file: runs/tool_servers/addresses.json   # written by python -m jobs.tool_servers
    cache: {path: ~/.cache/afm/tool_cache.sqlite, max_entries: 100000}   # or null: no cache
    connection_limit: 512
    connection_limit_per_host: 256
    fail_fast: false                                   # true: ToolPool.call raises while a circuit is open
    tools:
      wiki_search: {server: wiki, topk: 3, limits: {timeout_s: 10, retries: 3, ...}}
      web_search: {url: https://google.serper.dev, num_results: 10}     # url instead of server: fixed endpoint
      ...

Each tool entry names the server it talks to (a key of the addresses file) or a fixed ``url``; the other
keys are the tool's constructor arguments, and ``limits`` are :class:`~afm_core.tools.http.ToolLimits`.

A plug-in tool replaces the implementation of a CoA tool tag with user code (:mod:`afm_core.utils.plugins`)::

    tools:
      wiki_search: {_target_: my_pkg.MySearch, topk: 5}          # or _target_: /path/tools.py:MySearch
      code: {_target_: my_pkg.MyRunner, server: sandbox}         # server/url optional: passed as url=

It is a :class:`~afm_core.tools.base.Tool` whose ``name`` is the tag, built with the other keys, and called
through the same pool (limits, retries, cache, metrics) as the built-in tools.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from afm_core.coa.tags import TOOL_TAGS
from afm_core.tools.addresses import read_addresses
from afm_core.tools.base import Tool
from afm_core.tools.cache import ToolCache
from afm_core.tools.code import CodeTool
from afm_core.tools.crawl_page import CrawlPageTool
from afm_core.tools.http import ToolLimits
from afm_core.tools.pool import ToolPool
from afm_core.tools.web_search import WebSearchTool
from afm_core.tools.wiki_search import WikiSearchTool
from afm_core.utils.plugins import build_plugin, is_plugin

#: The ``tools`` group's keys that are :class:`ToolPool` settings (passed through when given).
POOL_KEYS = ("connection_limit", "connection_limit_per_host", "fail_fast")

TOOL_CLASSES: dict[str, Callable[..., Tool]] = {
    CodeTool.name: CodeTool,
    WikiSearchTool.name: WikiSearchTool,
    WebSearchTool.name: WebSearchTool,
    CrawlPageTool.name: CrawlPageTool,
}


def _plain(node: Mapping[str, Any]) -> dict[str, Any]:
    """A plain dict from a dict or an OmegaConf node (interpolations resolved)."""
    if isinstance(node, DictConfig):
        return cast(dict[str, Any], OmegaConf.to_container(node, resolve=True))
    return dict(node)


def build_tools(entries: Mapping[str, Any], addresses: Mapping[str, str]) -> tuple[list[Tool], dict[str, ToolLimits]]:
    """Tools and their limits from the ``tools`` section of the config.

    Raises:
        ValueError: unknown tool name, unknown argument, or a server missing from ``addresses``
            (the message names the tool and the field).
    """
    tools, limits = [], {}
    for name, entry in _plain(entries).items():
        if entry is None:  # a tool switched off with `tools.code: null`
            continue
        plugin = is_plugin(entry)
        if plugin and name not in TOOL_TAGS:
            raise ValueError(f"tools.{name}: a plug-in tool serves one of the CoA tool tags {', '.join(TOOL_TAGS)}")
        if not plugin and name not in TOOL_CLASSES:
            raise ValueError(f"tools.{name}: unknown tool; known: {sorted(TOOL_CLASSES)}")
        entry = dict(entry)
        server, url = entry.pop("server", None), entry.pop("url", None)
        if plugin:  # user code: a server or url is optional (a tool may compute locally)
            if server is not None and server not in addresses:
                raise ValueError(
                    f"tools.{name}.server: {server!r} is not in the addresses file (has {sorted(addresses)})"
                )
            url = addresses[server] if server is not None else url
            limits[name] = ToolLimits(**(entry.pop("limits", None) or {}))
            tool = build_plugin(entry, f"tools.{name}", **({"url": url} if url is not None else {}))
            if not isinstance(tool, Tool) or tool.name != name:
                raise ValueError(f"tools.{name}._target_: built {tool!r}, expected an afm_core.tools.Tool whose "
                                 f"name is {name!r}")  # fmt: skip
            tools.append(tool)
            continue
        if (server is None) == (url is None):
            raise ValueError(f"tools.{name}: give exactly one of 'server' (a name in the addresses file) or 'url'")
        if server is not None:
            if server not in addresses:
                raise ValueError(
                    f"tools.{name}.server: {server!r} is not in the addresses file (has {sorted(addresses)})"
                )
            url = addresses[server]
        tool_limits = entry.pop("limits", None) or {}
        try:
            limits[name] = ToolLimits(**tool_limits)
            tools.append(TOOL_CLASSES[name](url, **entry))
        except TypeError as e:
            raise ValueError(f"tools.{name}: {e}") from e
    return tools, limits


def build_tool_pool(
    tools_group: Mapping[str, Any], addresses: Mapping[str, str] | None = None, wait_s: float = 0.0
) -> ToolPool:
    """A :class:`ToolPool` from the ``tools`` group (see the module docstring; the job's
    :class:`afm_core.config.tools.ToolsConfig` as a mapping, ``dataclasses.asdict``). The keys it leaves out take
    the defaults of :class:`ToolPool` and :class:`~afm_core.tools.cache.ToolCache`.

    Args:
        tools_group: the ``tools`` group: ``tools`` (the entries :func:`build_tools` reads), and optionally
            ``addresses_file``, ``cache`` (``{path, max_entries}``; null: no cache), ``connection_limit``,
            ``connection_limit_per_host``, ``fail_fast``.
        addresses: ``{server: base URL}``; None reads the group's ``addresses_file`` (waiting up to ``wait_s``).
    """
    group = _plain(tools_group)
    if addresses is None:
        addresses = read_addresses(group["addresses_file"], wait_s=wait_s)
    tools, limits = build_tools(group["tools"], addresses)
    cache = None
    if group.get("cache"):
        cache_group = dict(group["cache"])
        path = cache_group.pop("path", None)
        cache = ToolCache(Path(path).expanduser() if path else None, **cache_group)
    pool_settings = {key: group[key] for key in POOL_KEYS if key in group}
    return ToolPool(tools, limits, cache=cache, **pool_settings)
