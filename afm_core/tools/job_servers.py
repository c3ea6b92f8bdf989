"""The tool servers of a job (evaluation, distillation, RL): reached through the addresses file, or started for
the job.

This layer sits below ``config`` and takes the groups it reads, never a whole job config: the ``tools`` group
(``conf/tools/default.yaml``, the client side; :class:`afm_core.config.tools.ToolsConfig` as a mapping,
``dataclasses.asdict``) for :func:`needed_servers` and :func:`reachable_tools_cfg`, and for :func:`tool_servers` its
``addresses_file``, the ``tool_servers`` group's fields (``start: auto | never | always``, ``wait_s``, ``servers``:
per-server overrides of ``conf/tool_servers.yaml``; ``**asdict(ToolServersConfig)``) and the job's ``data_dir``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from afm_core.coa.prompts import TASK_TOOLS
from afm_core.tools.addresses import read_addresses
from afm_core.tools.launcher import ServerGroup, launch_servers
from afm_core.utils.paths import repo_root, shared_data_dir
from afm_core.utils.plugins import is_plugin

#: The tool server each tool talks to (``conf/tool_servers.yaml``); web search needs the pages server too.
TOOL_SERVERS = {"code": ("sandbox",), "wiki_search": ("wiki",), "web_search": ("web_search", "pages"),
                "crawl_page": ("crawl", "pages")}  # fmt: skip


def needed_servers(task_families: Iterable[str], graders: Iterable[str], tools_group: Mapping[str, Any]) -> list[str]:
    """The servers that the tools of ``task_families`` (and the code grader's sandbox) need, among the tools
    configured in the ``tools`` group's ``tools`` entries (a tool set to null is off; a plug-in needs only the
    ``server`` it names)."""
    tools = {tool for family in task_families for tool in TASK_TOOLS.get(family, ())}
    configured = {name: entry for name, entry in (tools_group.get("tools") or {}).items() if entry is not None}
    servers = {"sandbox"} if "code" in set(graders) and "code" in configured else set()
    for tool in tools & set(configured):
        if is_plugin(configured[tool]):  # user code: needs only the server it names, if any
            servers |= {configured[tool]["server"]} if configured[tool].get("server") else set()
        else:
            servers |= set(TOOL_SERVERS[tool])
    return sorted(servers)


@contextlib.contextmanager
def tool_servers(
    names: list[str],
    log_dir: Path,
    *,
    addresses_file: str | Path,
    start: str,
    wait_s: float,
    servers: Mapping[str, Any] | None,
    data_dir: str | Path | None,
) -> Iterator[Callable[[], dict[str, str]]]:
    """Yield a function returning ``{server: url}``: from ``addresses_file`` (``tools.addresses_file``) when it
    exists and ``start`` is ``auto`` (``never``: always from it, waiting up to ``wait_s`` seconds), else of the
    servers ``names`` started here for the job's lifetime (``conf/tool_servers.yaml`` settings, each entry of
    ``servers`` merged onto its server's, null: that server off; their data under ``data_dir``, None: the shared
    data folder). Servers started here are launched on entry and waited for at the first call, so a job can start
    its engine meanwhile. The keywords after ``addresses_file`` are the ``tool_servers`` group's fields
    (``**dataclasses.asdict(ToolServersConfig)``) and the job's ``data_dir``.

    Raises:
        ValueError: (on entry) a bad server entry, e.g. a data path that does not exist.
        afm_core.tools.launcher.ServerStartError: (at the call) a server exited or did not become healthy.
    """
    addresses_file = Path(addresses_file)
    if start == "never" or (start == "auto" and addresses_file.is_file()):
        urls = read_addresses(addresses_file, wait_s=float(wait_s))
        yield lambda: dict(urls)
        return
    if not names:
        yield dict
        return
    server_settings = OmegaConf.to_container(
        OmegaConf.load(repo_root() / "conf" / "tool_servers.yaml").servers, resolve=True
    )
    for name, override in (servers or {}).items():
        server_settings[name] = None if override is None else {**(server_settings.get(name) or {}), **override}
    with ServerGroup(log_dir=log_dir) as group:
        launch_servers(group, {n: server_settings[n] for n in names if server_settings.get(n) is not None},
                       Path(data_dir) if data_dir else shared_data_dir())  # fmt: skip
        yield group.wait


def reachable_tools_cfg(tools_group: Mapping[str, Any], urls: Mapping[str, str]) -> dict[str, Any]:
    """The ``tools`` group with only the tools whose server is in ``urls``, that have a fixed ``url``, or that are
    plug-ins naming no server."""
    return {
        **tools_group,
        "tools": {
            n: e
            for n, e in tools_group["tools"].items()
            if (e is not None and e.get("server", "") in urls)
            or (e or {}).get("url")
            or (is_plugin(e) and e.get("server") is None)
        },
    }
