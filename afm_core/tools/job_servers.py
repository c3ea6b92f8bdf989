"""The tool servers of a job (evaluation, RL): reached through the addresses file, or started for the job.

A job config carries ``tools`` (``conf/tools/default.yaml``: the client side, ``addresses_file``),
``tool_servers`` (``start: auto | never | always``, ``wait_s``, per-server overrides of
``conf/tool_servers.yaml``) and optionally ``data_dir``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from afm_core.coa.prompts import TASK_TOOLS
from afm_core.utils.paths import repo_root, shared_data_dir
from afm_core.utils.plugins import is_plugin

#: The tool server each tool talks to (``conf/tool_servers.yaml``); web search needs the pages server too.
TOOL_SERVERS = {"code": ("sandbox",), "wiki_search": ("wiki",), "web_search": ("web_search", "pages"),
                "crawl_page": ("crawl", "pages")}  # fmt: skip


def needed_servers(task_families: Iterable[str], graders: Iterable[str], tools_cfg: Mapping[str, Any]) -> list[str]:
    """The servers that the tools of ``task_families`` (and the code grader's sandbox) need, among the tools
    configured in ``tools_cfg["tools"]`` (a tool set to null is off; a plug-in needs only the ``server`` it
    names)."""
    tools = {tool for family in task_families for tool in TASK_TOOLS.get(family, ())}
    configured = {name: entry for name, entry in (tools_cfg.get("tools") or {}).items() if entry is not None}
    servers = {"sandbox"} if "code" in set(graders) and "code" in configured else set()
    for tool in tools & set(configured):
        if is_plugin(configured[tool]):  # user code: needs only the server it names, if any
            servers |= {configured[tool]["server"]} if configured[tool].get("server") else set()
        else:
            servers |= set(TOOL_SERVERS[tool])
    return sorted(servers)


@contextlib.contextmanager
def tool_servers(cfg: Mapping[str, Any], names: list[str], log_dir: Path) -> Iterator[Callable[[], dict[str, str]]]:
    """Yield a function returning ``{server: url}``: from ``tools.addresses_file`` when it exists
    (``tool_servers.start: auto``), else of servers started here for the job's lifetime
    (``conf/tool_servers.yaml`` settings). Servers started here are launched on entry and waited for at the
    first call, so a job can start its engine meanwhile.

    Raises:
        ValueError: (on entry) a bad server entry, e.g. a data path that does not exist.
        afm_core.tools.launcher.ServerStartError: (at the call) a server exited or did not become healthy.
    """
    from afm_core.tools.addresses import read_addresses
    from afm_core.tools.launcher import ServerGroup, launch_servers

    start = cfg["tool_servers"]["start"]
    addresses_file = Path(cfg["tools"]["addresses_file"])
    if start == "never" or (start == "auto" and addresses_file.is_file()):
        urls = read_addresses(addresses_file, wait_s=float(cfg["tool_servers"].get("wait_s", 0)))
        yield lambda: dict(urls)
        return
    if not names:
        yield dict
        return
    servers_cfg = OmegaConf.to_container(
        OmegaConf.load(repo_root() / "conf" / "tool_servers.yaml").servers, resolve=True
    )
    for name, override in (cfg["tool_servers"].get("servers") or {}).items():
        servers_cfg[name] = None if override is None else {**(servers_cfg.get(name) or {}), **override}
    data_dir = Path(cfg["data_dir"]) if cfg.get("data_dir") else shared_data_dir()
    with ServerGroup(log_dir=log_dir) as group:
        launch_servers(group, {n: servers_cfg[n] for n in names if servers_cfg.get(n) is not None}, data_dir)
        yield group.wait


def reachable_tools_cfg(tools_cfg: Mapping[str, Any], urls: Mapping[str, str]) -> dict[str, Any]:
    """``tools_cfg`` with only the tools whose server is in ``urls``, that have a fixed ``url``, or that are
    plug-ins naming no server."""
    return {
        **tools_cfg,
        "tools": {
            n: e
            for n, e in tools_cfg["tools"].items()
            if (e is not None and e.get("server", "") in urls)
            or (e or {}).get("url")
            or (is_plugin(e) and e.get("server") is None)
        },
    }
