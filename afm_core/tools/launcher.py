"""Start tool servers as child processes, wait until each answers ``GET /health``, stop them on exit.

Used by ``python -m jobs.tool_servers`` (and by the tests and the load benchmark). Each server is
``python -m <module> --host H --port P --ready-file F ...``; its URL is read from the ready file, its
output goes to ``<log_dir>/<name>.log``.

Config of the servers (``conf/tool_servers.yaml`` → ``servers``); relative data paths are resolved against
``data_dir`` (default: :func:`afm_core.utils.paths.shared_data_dir`)::

    sandbox:    {port: 0, max_concurrency: 4, max_queue: 256, nsjail_path: null, python: /usr/bin/python3, ro_paths: []}
    wiki:       {port: 0, corpus: mhqa/hotpotqa500/corpus.jsonl, topk: 3}
    pages:      {port: 0, pages: webpages/readability, corpus: mhqa/hotpotqa500/corpus.jsonl}
    web_search: {port: 0, corpus: ..., pages: ..., link_base: null}   # null: the pages server's URL
    crawl:      {port: 0, extract_workers: 2, llm_url: null, llm_model: null, allow: []}

A server entry set to null (or with ``enabled: false``) is not started.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

SERVER_MODULES = {
    "sandbox": "sandbox.server",
    "wiki": "afm_core.tools.servers.wiki",
    "pages": "afm_core.tools.servers.pages",
    "web_search": "afm_core.tools.servers.web_search",
    "crawl": "afm_core.tools.servers.crawl",
}
_PR_SET_PDEATHSIG = 1
# Keys whose values are data paths (resolved against data_dir).
_PATH_FLAGS = {"corpus", "pages"}
# List-valued keys and the repeatable flag each item becomes.
_REPEATED_FLAGS = {"ro_paths": "--ro-path", "allow": "--allow"}


def _die_with_parent(parent_pid: int) -> None:
    """In the child before exec: get SIGTERM when the launching process dies (Linux ``PR_SET_PDEATHSIG``)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class ServerStartError(RuntimeError):
    """A server exited or did not become healthy in time (the message holds the end of its log)."""


def server_args(name: str, entry: Mapping, data_dir: Path) -> list[str]:
    """Command-line flags for server ``name`` from its config entry (``port`` and ``enabled`` excluded).

    Raises:
        ValueError: unknown server name, or a data path that does not exist (names the field).
    """
    if name not in SERVER_MODULES:
        raise ValueError(f"servers.{name}: unknown server; known: {sorted(SERVER_MODULES)}")
    args: list[str] = []
    for key, value in entry.items():
        if key in ("port", "enabled") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if key in _PATH_FLAGS:
            path = Path(value) if Path(value).is_absolute() else data_dir / value
            if not path.exists():
                raise ValueError(f"servers.{name}.{key}: {path} does not exist")
            value = str(path)
        if key in _REPEATED_FLAGS:
            for item in value:
                args += [_REPEATED_FLAGS[key], str(item)]
        elif value is True:
            args.append(flag)
        else:
            args += [flag, str(value)]
    return args


def _get_json(url: str, timeout_s: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # our own http:// servers
        return json.loads(resp.read())


class ServerGroup:
    """Child-process tool servers.

    Args:
        host: address the servers bind.
        log_dir: folder for ``<name>.log`` (default: a temp folder of its own, removed by :meth:`stop`).
        startup_timeout_s: seconds each server may take to become healthy.
    """

    def __init__(self, host: str = "127.0.0.1", log_dir: Path | None = None, startup_timeout_s: float = 120.0) -> None:
        self.host = host
        self._own_log_dir = not log_dir
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="afm-tool-servers-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.startup_timeout_s = startup_timeout_s
        self.urls: dict[str, str] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self._ready: dict[str, Path] = {}

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def launch(
        self, name: str, args: list[str], port: int = 0, env: Mapping[str, str] | None = None, module: str | None = None
    ) -> None:
        """Start server ``name`` (not waiting for it; see :meth:`wait`); ``env`` adds environment variables.

        ``module`` runs another server module under this name (default: :data:`SERVER_MODULES` ``[name]``),
        e.g. two sandbox servers side by side.
        """
        ready = self.log_dir / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            module or SERVER_MODULES[name],
            "--host",
            self.host,
            "--port",
            str(port),
            "--ready-file",
            str(ready),
            *args,
        ]
        logfile = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child process
        log.info("starting %s: %s", name, " ".join(argv))
        self._procs[name] = subprocess.Popen(
            argv,
            stdout=logfile,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
            preexec_fn=functools.partial(_die_with_parent, os.getpid()),  # no orphans if we are SIGKILLed
        )
        logfile.close()
        self._ready[name] = ready

    def wait(self, names: list[str] | None = None) -> dict[str, str]:
        """Wait until the named servers (default: all launched) are healthy; returns their URLs.

        Raises:
            ServerStartError: a server exited or was not healthy within ``startup_timeout_s``.
        """
        names = names or list(self._procs)
        deadline = time.monotonic() + self.startup_timeout_s
        for name in (n for n in names if n not in self.urls):
            while True:
                proc = self._procs[name]
                if proc.poll() is not None:
                    raise ServerStartError(f"{name} server exited with {proc.returncode}:\n{self.log_tail(name)}")
                if self._ready[name].exists():
                    url = json.loads(self._ready[name].read_text())["url"]
                    try:
                        if _get_json(url + "/health", 5.0).get("status") == "ok":
                            self.urls[name] = url
                            break
                    except OSError:
                        pass
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"{name} server not healthy after {self.startup_timeout_s:g} s:\n{self.log_tail(name)}"
                    )
                time.sleep(0.1)
        return {n: self.urls[n] for n in names}

    def processes(self) -> list[subprocess.Popen]:
        """The server processes, in launch order."""
        return list(self._procs.values())

    def dead(self) -> list[str]:
        """Names of servers that have exited."""
        return [name for name, proc in self._procs.items() if proc.poll() is not None]

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every server, SIGKILL those still running after ``grace_s``; then remove the log folder if it
        is the group's own temp folder."""
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, proc in self._procs.items():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s server ignored SIGTERM; killing it", name)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs.clear()
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def allow_entry(url: str) -> str:
    """The crawl allow-list entry (``IPv4:PORT`` or ``[IPv6]:PORT``) of a server's base URL."""
    parsed = urllib.parse.urlsplit(url)
    host = parsed.hostname or ""
    return f"[{host}]:{parsed.port}" if ":" in host else f"{host}:{parsed.port}"


def start_servers(group: ServerGroup, servers_cfg: Mapping, data_dir: Path) -> dict[str, str]:
    """Start every enabled server of ``servers_cfg`` in ``group``; returns ``{name: url}`` once all are healthy
    (:func:`launch_servers`, then :meth:`ServerGroup.wait`)."""
    launch_servers(group, servers_cfg, data_dir)
    group.wait()
    return dict(group.urls)


def launch_servers(group: ServerGroup, servers_cfg: Mapping, data_dir: Path) -> None:
    """Launch every enabled server of ``servers_cfg`` in ``group`` without waiting for them to be healthy
    (:meth:`ServerGroup.wait` does), except where one needs another's URL: the pages server starts first, and is
    waited for, when web search needs its URL as ``link_base`` or the crawler must be allowed to fetch it (its
    address joins the crawler's allow-list).

    Raises:
        ValueError: an unknown server, a missing data path, or web search without a pages server to link to.
    """
    entries = {n: dict(e) for n, e in servers_cfg.items() if e is not None and e.get("enabled", True)}
    args = {name: server_args(name, entry, data_dir) for name, entry in entries.items()}
    search = entries.get("web_search")
    needs_pages = search is not None and search.get("link_base") is None
    if needs_pages and "pages" not in entries:
        raise ValueError("servers.web_search.link_base is null but no pages server is configured")
    first = ["pages"] if needs_pages or ("pages" in entries and "crawl" in entries) else []
    for name in first:
        group.launch(name, args[name], entries[name].get("port", 0))
    if "pages" in first and "crawl" in entries:  # the crawler may fetch the local pages server
        args["crawl"] += ["--allow", allow_entry(group.wait(["pages"])["pages"])]
    for name in entries:
        if name not in first and name != "web_search":
            group.launch(name, args[name], entries[name].get("port", 0))
    if search is not None:
        if needs_pages:
            args["web_search"] += ["--link-base", group.wait(["pages"])["pages"]]
        group.launch("web_search", args["web_search"], search.get("port", 0))
