"""Hostile snippets against a real sandbox server (warm jails), on bubblewrap and on nsjail, with the seccomp
filter on, and those that test the process limit and the reach of one snippet over another on a server without
root (every slot then runs as the server's own uid); uid blocks that two live servers never share; and the
clean-state guarantee of warm jails: nothing of one snippet reaches the next.

Every snippet must be contained (what it tries does not happen, which the snippet itself or the host
checks), come back with a clear status, and leave the server healthy. Snippets print ``ESCAPED`` when an
attack works; the tests also look at the host afterwards (files, processes).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import tempfile
import textwrap
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest

from afm_core.tools.launcher import ServerGroup
from afm_core.utils.paths import repo_root
from tests.tools.conftest import SECRET, jail_unavailable, sandbox_server

REPO = Path(__file__).resolve().parents[2]


def post_run(url: str, code: str, timeout_s: float = 15.0, memory_mb: int = 256, stdin: str | None = None) -> dict:
    body = json.dumps({"code": textwrap.dedent(code), "stdin": stdin, "timeout_s": timeout_s, "memory_mb": memory_mb})
    request = urllib.request.Request(url + "/run", data=body.encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s + 30) as resp:
        return json.loads(resp.read())


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=10) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module", params=["bwrap", "nsjail"])
def server(request, tmp_path_factory):
    with sandbox_server(tmp_path_factory, request.param) as (url, group):
        yield url, group


def sandbox_processes(url: str) -> list[psutil.Process]:
    """Processes running under the slot uids of the sandbox server at ``url`` (its uid block, from ``/health``;
    none for a server without root, whose slots run as itself)."""
    if health(url)["uids"] is None:
        return []
    first, last = health(url)["uids"]
    left = []
    for proc in psutil.process_iter(["uids"]):
        uids = proc.info["uids"]
        if uids is not None and first <= uids.real <= last:
            left.append(proc)
    return left


def assert_contained(result: dict, statuses: tuple[str, ...]) -> None:
    assert result["status"] in statuses, result
    assert "ESCAPED" not in result["stdout"], result
    assert SECRET not in result["stdout"] + result["stderr"], result


def test_socket_to_loopback_server(server):
    url, _ = server
    port = int(url.rsplit(":", 1)[1])
    result = post_run(
        url,
        f"""
        import socket
        for port in ({port}, 22, 80):
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect(("127.0.0.1", port))
                print("ESCAPED", port)
            except OSError as e:
                print("blocked", port, e.errno)
    """,
    )
    assert_contained(result, ("ok",))
    assert result["stdout"].count("blocked") == 3


def test_no_route_to_outside(server):
    """The jail's network namespace has loopback only: no other interface, no IPv4/IPv6 route, so nothing a snippet
    sends can leave it. Checked by looking, not by aiming packets at outside addresses (tests here send traffic
    to loopback only)."""
    url, _ = server
    result = post_run(
        url,
        """
        import socket
        names = sorted(name for _, name in socket.if_nameindex())
        print("interfaces", names)
        routes = open("/proc/net/route").read().splitlines()[1:]
        print("ipv4 routes", len(routes))
        try:
            routes6 = [r for r in open("/proc/net/ipv6_route").read().splitlines() if not r.rstrip().endswith(" lo")]
        except OSError:
            routes6 = []
        print("ipv6 routes", len(routes6))
    """,
        timeout_s=15,
    )
    assert_contained(result, ("ok",))
    assert "interfaces ['lo']" in result["stdout"], result["stdout"]
    assert "ipv4 routes 0" in result["stdout"] and "ipv6 routes 0" in result["stdout"], result["stdout"]


def test_abstract_unix_socket_of_host(server):
    url, _ = server
    name = f"afm-test-{uuid.uuid4().hex}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(1)
    try:
        result = post_run(
            url,
            f"""
            import socket
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect("\\0{name}")
                print("ESCAPED")
            except OSError as e:
                print("blocked", e.errno)
        """,
        )
    finally:
        listener.close()
    assert_contained(result, ("ok",))
    assert "blocked" in result["stdout"]


def test_read_etc_shadow_and_host_files(server):
    url, _ = server
    result = post_run(
        url,
        """
        import os
        for path in ("/etc/shadow", "/etc/passwd", "/root/.bashrc", "/root/.ssh/id_rsa", "/home", "/var/log"):
            try:
                if os.path.isdir(path):
                    print("ESCAPED", path, os.listdir(path)[:3])
                else:
                    open(path).read()
                    print("ESCAPED", path)
            except OSError as e:
                print("blocked", path, e.errno)
    """,
    )
    assert_contained(result, ("ok",))
    assert result["stdout"].count("blocked") == 6


def test_read_the_repository(server):
    """The repository's files cannot be read from the jail, and the path to it leads nowhere there: some directory
    on the way is absent or does not list the next one (``/work`` is not in the jail; ``/tmp`` is the jail's own,
    empty), wherever the repository is checked out."""
    url, _ = server
    ancestors = [str(p) for p in reversed(REPO.parents)] + [str(REPO)]  # "/", ..., REPO
    result = post_run(
        url,
        f"""
        import json, os
        listings = {{}}
        for path in {ancestors!r}:
            try:
                listings[path] = sorted(os.listdir(path))
            except OSError as e:
                listings[path] = "blocked"
        for path in ({str(REPO / "pyproject.toml")!r}, {str(REPO / "sandbox" / "server.py")!r}):
            try:
                print("ESCAPED", path, open(path).read()[:20])
            except OSError as e:
                print("blocked", path, e.errno)
        print(json.dumps(listings))
    """,
    )
    assert_contained(result, ("ok",))
    lines = result["stdout"].splitlines()
    assert [line.split()[0] for line in lines[:2]] == ["blocked", "blocked"], result
    listings = json.loads(lines[2])
    breaks = [
        parent
        for parent, child in itertools.pairwise(ancestors)
        if listings[parent] == "blocked" or Path(child).name not in listings[parent]
    ]
    assert breaks, f"the jail reaches the repository at {REPO}: {listings}"


def test_environment_secrets(server):
    url, _ = server
    result = post_run(
        url,
        """
        import os
        print(dict(os.environ))
        for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
            for part in ("environ", "cmdline"):
                try:
                    print(pid, part, open(f"/proc/{pid}/{part}", "rb").read().replace(b"\\0", b" ")[:4000])
                except OSError as e:
                    print(pid, part, "unreadable", e.errno)
    """,
    )
    assert_contained(result, ("ok",))
    assert "AFM_TEST_SECRET" not in result["stdout"]


def test_write_outside_tmp(server):
    url, _ = server
    marker = f"afm-escape-{uuid.uuid4().hex}"
    result = post_run(
        url,
        f"""
        for path in ("/{marker}", "/usr/{marker}", "/etc/{marker}", "/code/main.py", "/proc/{marker}", "/dev/{marker}"):
            try:
                with open(path, "w") as f:
                    f.write("x")
                print("ESCAPED", path)
            except OSError as e:
                print("blocked", path, e.errno)
        with open("/tmp/{marker}", "w") as f:
            f.write("private")
        print("tmp ok")
    """,
    )
    assert_contained(result, ("ok",))
    assert result["stdout"].count("blocked") == 6 and "tmp ok" in result["stdout"]
    for host_path in (Path("/") / marker, Path("/usr") / marker, Path("/etc") / marker, Path("/tmp") / marker):
        assert not host_path.exists()
    # /tmp is private to each run
    again = post_run(url, f"import os; print(os.path.exists('/tmp/{marker}'), os.listdir('/tmp'))")
    assert again["stdout"].startswith("False []"), again


def test_fill_the_disk(server):
    url, _ = server
    result = post_run(
        url,
        """
        import os
        written = 0
        try:
            with open("/tmp/big", "wb") as f:
                for _ in range(512):
                    f.write(b"x" * (1 << 20))
                    written += 1
            print("ESCAPED", written)
        except OSError as e:
            print("blocked after MiB", written, e.errno)
        n = 0
        try:
            for n in range(100):
                with open(f"/tmp/f{n}", "wb") as f:
                    f.write(b"x" * (15 << 20))
            print("ESCAPED many files")
        except OSError as e:
            print("blocked after files", n, e.errno)
    """,
        timeout_s=20,
    )
    assert_contained(result, ("ok",))
    assert result["stdout"].count("blocked") == 2


def test_fork_bomb(server):
    url, _ = server
    start = time.monotonic()
    result = post_run(
        url,
        """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """,
        timeout_s=3,
    )
    assert_contained(result, ("timeout", "error", "killed"))
    assert time.monotonic() - start < 15
    assert health(url)["status"] == "ok"


def test_thread_bomb(server):
    url, _ = server
    result = post_run(
        url,
        """
        import threading, time
        n = 0
        try:
            while True:
                threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
                n += 1
        except RuntimeError as e:
            print("blocked after threads", n)
    """,
        timeout_s=5,
    )
    assert_contained(result, ("ok",))
    assert int(result["stdout"].split()[-1]) < 64


def test_memory_bomb(server):
    url, _ = server
    result = post_run(url, "x = [bytearray(1 << 20) for _ in range(8192)]\nprint('ESCAPED')", memory_mb=256)
    assert_contained(result, ("memory_limit",))
    assert "MemoryError" in result["stderr"]


def test_infinite_loop(server):
    url, _ = server
    result = post_run(url, "while True:\n    pass", timeout_s=2)
    assert_contained(result, ("timeout",))
    assert result["duration_s"] < 4


def test_sleep_past_the_timeout(server):
    url, _ = server
    result = post_run(url, "import time\nprint('start')\ntime.sleep(60)\nprint('ESCAPED')", timeout_s=1)
    assert_contained(result, ("timeout",))
    assert result["duration_s"] < 3
    assert "start" in result["stdout"]  # output before the kill is kept


def test_huge_output(server):
    url, _ = server
    result = post_run(url, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", timeout_s=10)
    assert_contained(result, ("output_limit",))
    assert result["truncated"] is True
    assert len(result["stdout"]) < (64 << 10) + 200 and "output truncated" in result["stdout"]


def test_kill_the_parent(server):
    url, _ = server
    result = post_run(
        url,
        """
        import os, signal
        for pid in (os.getppid(), 1, -1):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError as e:
                print("blocked", pid, e.errno)
        print("alive")
    """,
    )
    assert_contained(result, ("ok", "killed"))
    assert health(url)["status"] == "ok"


def test_signal_a_neighbour(server):
    """A snippet cannot see or kill another snippet running at the same time."""
    url, _ = server
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as ex:
        sleeper = ex.submit(post_run, url, "import time\ntime.sleep(3)\nprint('neighbour alive')", 10)
        time.sleep(1.0)
        killer = ex.submit(
            post_run,
            url,
            """
            import os, signal
            pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
            print("pids", pids)
            os.kill(-1, signal.SIGKILL)
        """,
        )
        assert sleeper.result()["stdout"].strip() == "neighbour alive"
        assert_contained(killer.result(), ("ok", "error", "killed"))


def test_proc_snooping(server):
    url, group = server
    server_pids = [p.pid for p in group.processes()]
    result = post_run(
        url,
        f"""
        import os
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        print("pids", pids)
        for pid in {server_pids!r}:
            try:
                print("ESCAPED", open(f"/proc/{{pid}}/cmdline").read()[:50])
            except OSError as e:
                print("blocked", pid, e.errno)
        try:
            open("/proc/sys/kernel/hostname", "w").write("pwned")
            print("ESCAPED sysctl")
        except OSError as e:
            print("blocked sysctl", e.errno)
        import socket
        print("hostname", socket.gethostname())
    """,
    )
    assert_contained(result, ("ok",))
    pids = json.loads(result["stdout"].splitlines()[0].split(" ", 1)[1])
    assert len(pids) <= 2, pids  # only the jail's own processes: the snippet and the jail's init (the zygote)
    assert socket.gethostname() != "pwned"


def test_privilege_escalation(server):
    url, _ = server
    result = post_run(
        url,
        """
        import os, subprocess
        caps = [l for l in open("/proc/self/status") if l.startswith("CapEff")]
        print(caps[0].strip() if caps else "CapEff unreadable")
        for fn, arg in ((os.setuid, 0), (os.setgid, 0), (os.chroot, "/tmp")):
            try:
                fn(arg)
                print("ESCAPED", fn.__name__)
            except OSError as e:
                print("blocked", fn.__name__, e.errno)
        try:
            out = subprocess.run(["mount", "-t", "tmpfs", "none", "/usr"], capture_output=True, text=True)
            print("blocked mount" if out.returncode else "ESCAPED mount")
        except OSError as e:
            print("blocked mount", e.errno)
        print("uid", os.getuid(), os.geteuid())
    """,
    )
    assert_contained(result, ("ok",))
    assert "CapEff:\t0000000000000000" in result["stdout"]
    assert result["stdout"].count("blocked") == 4


def test_server_healthy_and_clean_after_the_suite(server):
    url, group = server
    assert health(url) == {**health(url), "status": "ok", "running": 0, "queued": 0}
    result = post_run(url, "print(6 * 7)")
    assert result["status"] == "ok" and result["stdout"] == "42\n"
    assert group.dead() == []

    def leftovers() -> list[psutil.Process]:
        """Processes under the slot uids other than the warm jails (bwrap/nsjail and their zygotes)."""
        return [p for p in sandbox_processes(url) if p.name() not in ("bwrap", "nsjail") and not is_zygote(p)]

    deadline = time.monotonic() + 5
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    if os.geteuid() == 0:
        assert leftovers() == []
        assert sum(map(is_zygote, sandbox_processes(url))) == health(url)["max_concurrency"]


def is_zygote(proc: psutil.Process) -> bool:
    try:
        return proc.name() not in ("bwrap", "nsjail") and "/sandbox/zygote.py" in proc.cmdline()
    except psutil.Error:
        return False


def test_nested_user_namespace_is_refused(server):
    """unshare(CLONE_NEWUSER), clone(CLONE_NEWUSER) and unshare(1) fail: seccomp (and bwrap --disable-userns)."""
    url, _ = server
    result = post_run(
        url,
        """
        import ctypes, os, subprocess
        libc = ctypes.CDLL(None, use_errno=True)
        CLONE_NEWUSER, CLONE_NEWNS, SIGCHLD = 0x10000000, 0x00020000, 17
        for flags in (CLONE_NEWUSER, CLONE_NEWUSER | CLONE_NEWNS):
            if libc.unshare(flags) == 0:
                print("ESCAPED unshare", hex(flags))
            else:
                print("blocked unshare", ctypes.get_errno())
        pid = libc.syscall(56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)  # raw clone(2) on x86_64
        if pid == 0:
            os._exit(0)
        print("ESCAPED clone" if pid > 0 else f"blocked clone {ctypes.get_errno()}")
        try:
            out = subprocess.run(["unshare", "--user", "--map-root-user", "id", "-u"], capture_output=True, text=True)
            print("ESCAPED unshare(1)" if out.returncode == 0 else "blocked unshare(1)")
        except OSError as e:
            print("blocked unshare(1)", e.errno)
    """,
    )
    assert_contained(result, ("ok",))
    assert result["stdout"].count("blocked") == 4, result
    assert "blocked unshare 1" in result["stdout"]  # EPERM: the seccomp filter answered


def test_the_zygote_is_out_of_reach(server):
    """A snippet cannot signal, trace or read the jail's process 1 (the zygote); the next snippet still runs."""
    url, _ = server
    result = post_run(
        url,
        """
        import ctypes, os, signal
        for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP, signal.SIGINT):
            os.kill(1, sig)
        for path in ("/proc/1/mem", "/proc/1/environ", "/proc/1/fd/3"):
            try:
                open(path, "rb").read(16)
                print("ESCAPED", path)
            except OSError as e:
                print("blocked", path, e.errno)
        libc = ctypes.CDLL(None, use_errno=True)
        print("ESCAPED ptrace" if libc.ptrace(16, 1, 0, 0) == 0 else f"blocked ptrace {ctypes.get_errno()}")  # PTRACE_ATTACH
        print("alive")
    """,
    )
    assert_contained(result, ("ok",))
    assert result["stdout"].count("blocked") == 4 and "alive" in result["stdout"], result
    assert post_run(url, "print(6 * 7)")["stdout"] == "42\n"


DIRTY = """
    import builtins, math, os, resource, subprocess, sys, time
    math.LEAK = builtins.LEAK = "leak"
    os.environ["LEAK"] = "leak"
    sys.modules["leak"] = math
    sys.path.insert(0, "/tmp")
    with open("/tmp/leak.py", "w") as f:
        f.write("x = 1")
    os.makedirs("/tmp/d/e")
    os.chmod("/tmp/d", 0o500)
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        open("/dev/shm/leak", "w").write("x")
    subprocess.Popen(["sleep", "60"], start_new_session=True)
    if os.fork() == 0:
        os.setsid()
        time.sleep(60)
        os._exit(0)
    resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))
    os.umask(0o077)
    os.chdir("/")
    start = time.process_time()
    while time.process_time() - start < 0.5:
        pass
    print("dirty")
"""

CHECK = """
    import builtins, math, os, resource, subprocess, sys, time
    print("cpu", time.process_time())
    print("state", hasattr(math, "LEAK"), hasattr(builtins, "LEAK"), "LEAK" in os.environ, "leak" in sys.modules, "/tmp" in sys.path)
    print("files", os.listdir("/tmp"), os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else [])
    print("procs", len([p for p in os.listdir("/proc") if p.isdigit()]))
    print("rlimits", resource.getrlimit(resource.RLIMIT_NOFILE), resource.getrlimit(resource.RLIMIT_CPU))
    print("cwd", oct(os.umask(0o022)), os.getcwd())
    children = [subprocess.Popen(["sleep", "5"]) for _ in range(24)]  # the process budget is whole again
    for child in children:
        child.kill()
        child.wait()
    print("forked", len(children))
"""


@pytest.fixture(scope="module", params=["bwrap", "nsjail"])
def one_slot_server(request, tmp_path_factory):
    """A server with a single slot: every snippet runs in the same warm jail."""
    with sandbox_server(tmp_path_factory, request.param, extra_args=("--max-concurrency", "1")) as (url, group):
        yield url, group


def test_each_snippet_starts_from_clean_state(one_slot_server):
    """Globals, modules, env, files, processes, rlimits, umask, cwd and CPU time of one snippet do not reach
    the next one in the same warm jail."""
    url, _ = one_slot_server
    for _ in range(2):
        dirty = post_run(url, DIRTY, timeout_s=30)  # 0.5 CPU seconds may take long on a loaded machine
        assert dirty["status"] == "ok" and dirty["stdout"] == "dirty\n", dirty
        check = post_run(url, CHECK, timeout_s=30)
        assert check["status"] == "ok", check
        lines = dict(line.split(" ", 1) for line in check["stdout"].splitlines())
        assert float(lines["cpu"]) < 0.3, lines  # CPU seconds count from this snippet's start
        assert lines["state"] == "False False False False False", lines
        assert lines["files"] == "[] []", lines
        assert int(lines["procs"]) <= 2, lines  # itself and the jail's init
        assert lines["rlimits"] == "(64, 64) (30, 31)", lines
        assert lines["cwd"] == "0o22 /tmp", lines
        assert lines["forked"] == "24", lines


@pytest.mark.skipif(os.geteuid() != 0, reason="finds the jail's processes by their slot uid (root only)")
def test_a_dead_jail_is_replaced_before_the_next_snippet(one_slot_server):
    """The zygote killed from the host mid-snippet: that snippet is a sandbox_error, the next one runs in a new jail;
    killed between snippets: the next snippet runs in a new jail."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    url, _ = one_slot_server
    with ThreadPoolExecutor(1) as ex:
        sleeper = ex.submit(post_run, url, "import time\nprint('started')\ntime.sleep(20)", 30)
        deadline = time.monotonic() + 10
        while health(url)["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        # a snippet is a fork of the zygote (same command line): the zygote is the one whose parent is not
        [zygote] = [p for p in sandbox_processes(url) if is_zygote(p) and not is_zygote(p.parent())]
        zygote.send_signal(signal.SIGKILL)
        result = sleeper.result()
    assert result["status"] == "sandbox_error" and "jail died" in result["stderr"], result
    assert post_run(url, "print(6 * 7)")["stdout"] == "42\n"
    # killed between snippets: the next snippet finds out when it hands over its request
    [zygote] = [p for p in sandbox_processes(url) if is_zygote(p) and not is_zygote(p.parent())]
    zygote.send_signal(signal.SIGKILL)
    zygote.wait(5)
    assert post_run(url, "print(7 * 6)")["stdout"] == "42\n"
    assert health(url)["running"] == 0


def _server_as(group: ServerGroup, name: str, args: list[str], **env: str) -> str:
    """Start ``sandbox.server`` as ``name`` in ``group`` under :mod:`tests.tools.sandbox_server_as` (``env``: its
    ``AFM_TEST_*`` conditions); its URL once healthy."""
    path = os.pathsep.join(filter(None, [str(repo_root()), os.environ.get("PYTHONPATH")]))
    group.launch(name, args, env={"PYTHONPATH": path, **env}, module="tests.tools.sandbox_server_as")
    return group.wait([name])[name]


@pytest.mark.skipif(os.geteuid() != 0, reason="slot uids are root's: a server without root runs every slot as itself")
def test_two_live_servers_whose_pids_collide_hold_disjoint_uid_blocks(tmp_path_factory):
    """A uid block was ``pid % 1000`` alone: two live servers whose pids collided modulo 1000 shared one, and the
    snippets of one ran under the uids of the other's. Here the second server is given the first one's pid (what
    ``os.getpid()`` answers in it); it finds that block held and takes another, and each server's jails run under
    its own block only."""
    if reason := jail_unavailable():
        pytest.skip(reason)
    with ServerGroup(log_dir=tmp_path_factory.mktemp("uid-blocks")) as group:
        args = ["--max-concurrency", "2"]
        first = _server_as(group, "first", args)
        second = _server_as(group, "second", args, AFM_TEST_PID=str(group.processes()[0].pid))
        blocks = [health(url)["uids"] for url in (first, second)]
        assert blocks[0][1] < blocks[1][0] or blocks[1][1] < blocks[0][0], blocks
        for server, (low, _) in zip(group.processes(), blocks):
            jails = {p.uids().real for p in psutil.Process(server.pid).children(recursive=True)}
            assert jails == {low, low + 1}, (blocks, jails)  # its two slots' uids, nothing of the other block


@pytest.fixture(scope="module")
def unprivileged_server():
    """A server started as root that drops to ``nobody`` before it starts: no slot uids, every slot and jail runs
    as that one uid (the path of a server started by a user)."""
    if os.geteuid() != 0:
        pytest.skip("this process is not root: the bwrap and nsjail servers above already run without root")
    if reason := jail_unavailable():
        pytest.skip(reason)
    log_dir = Path(tempfile.mkdtemp(prefix="afm-sandbox-nobody-"))
    log_dir.chmod(0o777)  # the server writes its ready file there as nobody
    try:
        with ServerGroup(log_dir=log_dir) as group:
            url = _server_as(group, "sandbox", ["--max-concurrency", "4", "--max-queue", "64"], AFM_TEST_UID="65534",
                             AFM_TEST_SECRET=SECRET)  # fmt: skip
            assert health(url)["uids"] is None and psutil.Process(group.processes()[0].pid).uids().real == 65534
            yield url, group
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


#: The hostile snippets that a server without root puts to another test: the process limit (set in each jail's own
#: user namespace, which the slots no longer tell apart by uid) and what one snippet can reach of another or of
#: the server when all run as the same host uid.
WITHOUT_ROOT = [test_fork_bomb, test_thread_bomb, test_signal_a_neighbour, test_kill_the_parent, test_proc_snooping,
                test_the_zygote_is_out_of_reach, test_privilege_escalation]  # fmt: skip


@pytest.mark.parametrize("hostile", WITHOUT_ROOT, ids=lambda test: test.__name__.removeprefix("test_"))
def test_hostile_snippets_on_a_server_without_root(unprivileged_server, hostile):
    hostile(unprivileged_server)
