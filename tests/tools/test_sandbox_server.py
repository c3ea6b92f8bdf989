"""The sandbox server's API: results, stdin, validation, bounded concurrency and queue, output caps, self-test."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from sandbox.jail import (
    UIDS_PER_SERVER,
    JailConfig,
    Limits,
    bwrap_argv,
    bwrap_supports_disable_userns,
    bwrap_zygote_argv,
    claim_uid_block,
    nsjail_argv,
    nsjail_zygote_argv,
)
from sandbox.runner import RunnerConfig, SnippetRunner
from tests.tools.conftest import jail_unavailable, sandbox_server

PR_SET_CHILD_SUBREAPER = 36


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(url + "/run", json=body) as resp:
        return resp.status, await resp.json()


def run_all(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(post(session, url, b) for b in bodies))

    return asyncio.run(main())


def test_result_fields_stdin_and_exit_codes(sandbox_url):
    (s1, ok), (s2, err), (s3, stdin) = run_all(
        sandbox_url,
        [
            {"code": "print('hi')", "timeout_s": 5, "memory_mb": 256},
            {"code": "import sys\nprint('out')\nsys.exit(3)"},
            {"code": "import sys\nprint(sum(map(int, sys.stdin.read().split())))", "stdin": "1 2 3\n4"},
        ],
    )
    assert s1 == s2 == s3 == 200
    assert ok["status"] == "ok" and ok["stdout"] == "hi\n" and ok["exit_code"] == 0 and ok["truncated"] is False
    assert set(ok) == {"status", "stdout", "stderr", "exit_code", "duration_s", "truncated"}
    assert 0 < ok["duration_s"] < 5
    assert err["status"] == "error" and err["exit_code"] == 3 and err["stdout"] == "out\n"
    assert stdin["stdout"] == "10\n"


def test_bad_requests_name_the_field(sandbox_url):
    replies = run_all(
        sandbox_url,
        [
            {"stdin": "x"},
            {"code": "print(1)", "timeout_s": 0},
            {"code": "print(1)", "timeout_s": 10_000},
            {"code": "print(1)", "memory_mb": 1},
            {"code": "print(1)", "stdin": 5},
        ],
    )
    fields = ["'code'", "'timeout_s'", "'timeout_s'", "'memory_mb'", "'stdin'"]
    for (status, body), field in zip(replies, fields):
        assert status == 400 and field in body["error"], body


def test_concurrent_snippets_overlap(sandbox_url):
    start = time.monotonic()
    replies = run_all(sandbox_url, [{"code": "import time\ntime.sleep(1)\nprint('done')"}] * 4)
    assert all(s == 200 and r["status"] == "ok" for s, r in replies)
    assert time.monotonic() - start < 3.8  # 4 slots: not one after another (that takes >= 4 s)


def test_full_queue_answers_503(tmp_path_factory):
    with sandbox_server(tmp_path_factory, extra_args=("--max-concurrency", "1", "--max-queue", "1")) as (url, _):
        replies = run_all(url, [{"code": "import time\ntime.sleep(1.5)"}] * 4)
    statuses = sorted(s for s, _ in replies)
    assert statuses.count(200) == 2 and statuses.count(503) == 2, replies
    assert all("queue full" in r["error"] for s, r in replies if s == 503)


def test_output_is_capped_with_a_marker(tmp_path_factory):
    with sandbox_server(tmp_path_factory, extra_args=("--max-output-bytes", "1000")) as (url, _):
        [(_, result)] = run_all(url, [{"code": "print('a' * 5000)\nimport sys\nprint('e' * 3000, file=sys.stderr)"}])
    assert result["status"] == "ok" and result["truncated"] is True
    assert result["stdout"].startswith("a" * 1000) and "[... output truncated: 4001 more bytes ...]" in result["stdout"]
    assert "[... output truncated: 2001 more bytes ...]" in result["stderr"]


def test_server_refuses_to_start_without_a_working_jail(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sandbox.server", "--port", "0", "--nsjail-path", str(tmp_path / "no-nsjail")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "not found" in proc.stderr


def test_jail_command_lines():
    limits = Limits(timeout_s=3, memory_mb=128, cpu_s=3)
    argv = bwrap_argv(JailConfig(), limits, Path("/x/code.py"), seccomp_fd=7)
    # the rlimits are the interpreter's, set inside the jail: there RLIMIT_NPROC counts bubblewrap's pid 1 and the snippet
    inner = argv[argv.index("prlimit") :]
    assert argv[0] == "bwrap" and inner[-1] == "/code/main.py" and "--nproc=33" in inner
    assert "--cpu=3:4" in inner and f"--as={128 << 20}" in inner
    for flag in ("--unshare-all", "--die-with-parent", "--new-session", "--clearenv", "--remount-ro"):
        assert flag in argv
    assert argv[argv.index("--seccomp") + 1] == "7"
    assert "--share-net" not in argv and "/home" not in argv
    ns = nsjail_argv(JailConfig(nsjail_path="/opt/nsjail"), limits, Path("/x/code.py"))
    assert ns[0] == "/opt/nsjail" and ns[ns.index("--rlimit_as") + 1] == "128" and "--time_limit" in ns
    assert "clone_flags & 0x10000000" in ns[ns.index("--seccomp_string") + 1]
    warm = bwrap_zygote_argv(JailConfig(), limits, Path("/x/slot-0"), 5, seccomp_fd=7)
    assert (
        "--as-pid-1" in warm
        and not any(a.startswith("--cpu") for a in warm)
        and warm[-2:] == ["/sandbox/zygote.py", "5"]
    )
    assert ("--disable-userns" in warm) == bwrap_supports_disable_userns(JailConfig())
    warm_ns = nsjail_zygote_argv(JailConfig(nsjail_path="/opt/nsjail"), limits, Path("/x/slot-0"), 5)
    assert warm_ns[warm_ns.index("--pass_fd") + 1] == "5" and warm_ns[warm_ns.index("--time_limit") + 1] == "0"


def test_cold_jails_still_work(tmp_path_factory):
    """``--cold`` (a jail per snippet, the benchmark's baseline) runs snippets with the same results."""
    with sandbox_server(tmp_path_factory, extra_args=("--cold",)) as (url, _):
        (_, ok), (_, err), (_, slow) = run_all(
            url,
            [
                {"code": "import sys\nprint(sys.stdin.read()[::-1])", "stdin": "abc"},
                {"code": "import ctypes\nprint(ctypes.CDLL(None).unshare(0x10000000))\n1/0"},
                {"code": "while True: pass", "timeout_s": 1},
            ],
        )
    assert ok["status"] == "ok" and ok["stdout"] == "cba\n"
    assert err["status"] == "error" and err["stdout"] == "-1\n" and "ZeroDivisionError" in err["stderr"]
    assert slow["status"] == "timeout"


def test_a_uid_block_is_held_until_released(tmp_path):
    """Two holders get two blocks (the lock is per open file, so even in one process); a released block is free
    again; a lock folder that cannot be made names itself and the flag (two servers in two processes:
    test_sandbox_security.py)."""
    cfg = JailConfig(uid_lock_dir=str(tmp_path / "locks"))
    first, second = claim_uid_block(cfg), claim_uid_block(cfg)
    assert first.index != second.index and second.uid(0) not in range(first.uid(0), first.uid(0) + UIDS_PER_SERVER)
    first.close()
    again = claim_uid_block(cfg)
    assert again.index == first.index
    again.close()
    second.close()
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match=f"cannot use {tmp_path / 'file' / 'locks'} .*set --uid-lock-dir"):
        claim_uid_block(JailConfig(uid_lock_dir=str(tmp_path / "file" / "locks")))


@pytest.mark.skipif(jail_unavailable() is not None, reason="bubblewrap cannot create namespaces here")
def test_jail_config_check_names_what_is_missing():
    with pytest.raises(FileNotFoundError, match="sandbox python"):
        JailConfig(python="/nonexistent/python3").check()
    with pytest.raises(FileNotFoundError, match="ro_paths"):
        JailConfig(ro_paths=["/nonexistent"]).check()


@pytest.mark.skipif(jail_unavailable() is not None or os.geteuid() != 0, reason="needs root and a working bubblewrap")
def test_a_jail_that_cannot_start_is_a_sandbox_error(tmp_path):
    """A path the slot uid may not read cannot be bound: bubblewrap fails before the snippet runs."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    cfg = RunnerConfig(jail=JailConfig(ro_paths=[str(private)]))

    async def main():
        runner = SnippetRunner(cfg)
        try:
            return await runner.run("print('never')", None, 5.0, 256)
        finally:
            runner.close()

    result = asyncio.run(main())
    assert result.status == "sandbox_error" and result.stdout == "" and "bwrap" in result.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "sandbox.server", "--port", "0", "--ro-path", str(private)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "sandbox self-test failed" in proc.stderr


FORK_UNTIL_REFUSED = """
import os, signal
children = 0
try:
    while True:
        if os.fork() == 0:
            signal.pause()
        children += 1
except OSError as e:
    print(children, e.errno)
"""


@pytest.mark.skipif(jail_unavailable() is not None or os.geteuid() != 0, reason="needs root and a working bubblewrap")
def test_zombies_of_earlier_jails_do_not_count_against_the_next_snippet():
    """bubblewrap's launcher exits before the jail's pid 1, which becomes a zombie until the host's init reaps it
    (seconds later on a busy host: 1 of 64 cold snippets once failed with "Can't fork for pid 1"). Here this
    process adopts those zombies (a subreaper) and keeps them: each cold snippet, and each snippet of a warm
    jail replaced after the last, still starts and may have exactly ``max_processes`` tasks."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0

    uids: set[int] = set()  # slot 0's uid of each runner's block

    async def main(warm: bool, runs: int) -> list:
        runner = SnippetRunner(RunnerConfig(warm=warm, max_concurrency=1, max_processes=4))
        assert runner.uids is not None
        uids.add(runner.uids.uid(0))
        results = []
        try:
            for _ in range(runs):
                results.append(await runner.run(FORK_UNTIL_REFUSED, None, 5.0, 256))
                for jail in runner._jails:  # as after a timeout past the backstop: the slot starts a new jail
                    jail.kill()
                    await jail.wait_exit(5.0)
        finally:
            await runner.aclose()
        return results

    try:
        cold, warm = asyncio.run(main(False, 4)), asyncio.run(main(True, 9))
        zombies = adopted_zombies(uids)
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for pid in adopted_zombies(uids):
            os.waitpid(pid, 0)
    assert [(result.status, result.stderr) for result in cold + warm] == [("ok", "")] * (4 + 9)
    assert {result.stdout for result in cold + warm} == {f"3 {errno.EAGAIN}\n"}  # 4 tasks: the snippet, 3 children
    assert len(zombies) >= 4 + 9 - 1  # each jail's pid 1 (the last warm one may still be dying)


def adopted_zombies(uids: set[int]) -> list[int]:
    """This process's zombie children that ran as one of ``uids``."""
    zombies = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            owner = entry.stat().st_uid
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state == "Z" and int(ppid) == os.getpid() and owner in uids:
            zombies.append(int(entry.name))
    return zombies
