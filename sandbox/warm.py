"""Warm jails: one long-lived jail per snippet slot, whose zygote (:mod:`sandbox.zygote`) forks a fresh
child per snippet, so a snippet pays for a ``fork`` instead of a new jail and a new interpreter.

Server side of the zygote's protocol. Per snippet: the code goes to the slot's folder (bound read-only at
``/code``), three new pipes go to the zygote with the limits, the snippet's output is read from the pipes as
it comes, and the zygote's reply gives the exit status. The server keeps a backstop: when the zygote does not
answer within the timeout plus :data:`BACKSTOP_S`, when the client goes away, or when the jail died, the
whole jail is killed and the slot starts a new one before its next snippet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import time
from pathlib import Path

from sandbox.jail import (
    JailConfig,
    Limits,
    UidBlock,
    bwrap_zygote_argv,
    jail_env,
    launcher_env,
    nsjail_zygote_argv,
    slot_identity,
)
from sandbox.seccomp import bpf_program

log = logging.getLogger(__name__)

#: Seconds past a snippet's timeout before the server stops waiting for the zygote and kills the jail.
BACKSTOP_S = 5.0
#: Seconds a new jail may take to send its hello.
START_TIMEOUT_S = 30.0
_STDERR_TAIL = 8 << 10


class JailStartError(RuntimeError):
    """The jail (bubblewrap or nsjail) or its zygote failed to start; the message holds their stderr."""


def seccomp_memfd() -> int:
    """A file descriptor holding the seccomp BPF program (``bwrap --seccomp FD``); the caller closes it."""
    fd = os.memfd_create("afm-seccomp", 0)
    os.write(fd, bpf_program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class WarmJail:
    """The warm jail of one snippet slot.

    Args:
        jail: how jails are built.
        slot: the slot number.
        work_dir: the server's folder; the slot's code folder is created in it.
        ceiling: the largest limits any snippet may ask for (the jail's own rlimits).
        uids: the server's uid block (root): the jail runs as the slot's uid of it; None: as the server's uid.
    """

    def __init__(
        self, jail: JailConfig, slot: int, work_dir: Path, ceiling: Limits, uids: UidBlock | None = None
    ) -> None:
        self.jail, self.slot, self.ceiling, self.uids = jail, slot, ceiling, uids
        self.code_dir = work_dir / f"slot-{slot}"
        self.code_dir.mkdir(mode=0o711)
        self._staging = work_dir / f"slot-{slot}.py"
        self._proc: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self._stderr = bytearray()
        self._stderr_task: asyncio.Task | None = None
        self._busy = False

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None and self._sock is not None

    async def start(self) -> None:
        """Start the jail and wait for the zygote's hello.

        Raises:
            JailStartError: the jail exited or did not answer within :data:`START_TIMEOUT_S`.
        """
        self.kill()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        seccomp_fd = seccomp_memfd() if self.jail.backend == "bwrap" else None
        try:
            if seccomp_fd is not None:
                argv = bwrap_zygote_argv(self.jail, self.ceiling, self.code_dir, theirs.fileno(), seccomp_fd=seccomp_fd)
            else:
                argv = nsjail_zygote_argv(self.jail, self.ceiling, self.code_dir, theirs.fileno())
            pass_fds = [theirs.fileno()] + ([seccomp_fd] if seccomp_fd is not None else [])
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                env=launcher_env(),
                start_new_session=True,
                pass_fds=pass_fds,
                **slot_identity(self.uids, self.slot),
            )
        finally:
            theirs.close()
            if seccomp_fd is not None:
                os.close(seccomp_fd)
        self._stderr = bytearray()
        self._stderr_task = asyncio.create_task(self._drain_stderr(self._proc))
        ours.setblocking(False)
        self._sock = ours
        try:
            hello = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(ours, 4096), START_TIMEOUT_S)
        except TimeoutError:
            hello = b""
        if not hello or not json.loads(hello).get("ready"):
            await self.wait_exit(2.0)
            message = self.stderr_tail() or f"no hello from the zygote within {START_TIMEOUT_S:g} s"
            self.kill()
            raise JailStartError(message)

    def stderr_tail(self) -> str:
        return self._stderr.decode("utf-8", errors="replace").strip()

    def kill(self) -> None:
        """Kill the jail (all of it: its process group) and close the control socket."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        proc = self._proc
        if proc is not None and proc.returncode is None:
            for action in (proc.kill, lambda: os.killpg(proc.pid, signal.SIGKILL)):
                try:
                    action()
                except (ProcessLookupError, PermissionError):
                    pass

    async def run(self, code: str, stdin: str | None, limits: Limits, readers) -> tuple[int | None, bool, float]:
        """Run one snippet; ``readers(out_stream, err_stream, kill)`` builds the output readers.

        Returns:
            ``(exit_code, timed_out, duration_s)``; exit_code None when the jail died mid-run.

        Raises:
            JailStartError: the jail had to be (re)started and could not be.
        """
        self._staging.write_text(code, encoding="utf-8")
        self._staging.chmod(0o644)
        os.replace(self._staging, self.code_dir / "main.py")
        request = {"limits": _rlimits(limits), "timeout_s": limits.timeout_s, "env": {**jail_env(), "PWD": "/tmp"}}
        loop = asyncio.get_running_loop()
        pipes = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr: (read end, write end)
        child_ends = [pipes[0][0], pipes[1][1], pipes[2][1]]
        try:
            sock = await self._send(json.dumps(request).encode(), child_ends)
        except BaseException:
            for fd in (pipes[0][1], pipes[1][0], pipes[2][0]):
                os.close(fd)
            raise
        finally:
            for fd in child_ends:
                os.close(fd)
        start = time.perf_counter()
        out_stream, out_transport = await _read_pipe(loop, pipes[1][0])
        err_stream, err_transport = await _read_pipe(loop, pipes[2][0])
        self._busy = True
        out, err = readers(out_stream, err_stream, self._stop_snippet)
        tasks = [asyncio.create_task(out.run()), asyncio.create_task(err.run())]
        tasks.append(asyncio.create_task(_feed(loop, pipes[0][1], stdin.encode("utf-8") if stdin else b"")))
        exit_code, timed_out = None, False
        try:
            try:
                reply = await asyncio.wait_for(loop.sock_recv(sock, 4096), limits.timeout_s + BACKSTOP_S)
            except OSError:  # the socket broke: as if the jail died
                reply = b""
            self._busy = False
            if reply:
                answer = json.loads(reply)
                exit_code, timed_out = answer["exit_code"], answer["timed_out"]
            else:  # the jail died mid-run
                log.warning("sandbox slot %d: the jail died during a snippet: %s", self.slot, self.stderr_tail()[-500:])
                self.kill()
        except TimeoutError:
            log.warning(
                "sandbox slot %d: no answer from the zygote %g s after the timeout; killing the jail",
                self.slot,
                BACKSTOP_S,
            )
            self.kill()
            timed_out = True
        except asyncio.CancelledError:  # the client went away: leave nothing running
            self.kill()
            raise
        finally:
            self._busy = False
            _, pending = await asyncio.wait(tasks, timeout=2.0)
            for task in pending:
                task.cancel()
            out_transport.close()
            err_transport.close()
        return exit_code, timed_out, time.perf_counter() - start

    async def _send(self, message: bytes, fds: list[int]) -> socket.socket:
        """Hand a request to the zygote, starting the jail first if needed, and once more if it has died since."""
        for attempt in range(2):
            if not self.alive:
                await self.start()
            sock = self._sock
            assert sock is not None  # started above
            try:
                socket.send_fds(sock, [message], fds)
                return sock
            except OSError as e:
                log.warning("sandbox slot %d: the jail stopped taking snippets (%s); starting a new one", self.slot, e)
                self.kill()
                if attempt:
                    raise JailStartError(f"the new jail did not take the snippet either: {e}") from e
        raise AssertionError("unreachable")

    def _stop_snippet(self) -> None:
        """Ask the zygote to kill the running snippet (its output flooded)."""
        if self._busy and self._sock is not None:
            try:
                self._sock.send(b"kill")
            except OSError:
                self.kill()

    async def _drain_stderr(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None  # started with stderr=PIPE
        while chunk := await proc.stderr.read(1 << 12):
            self._stderr += chunk
            del self._stderr[:-_STDERR_TAIL]

    async def wait_exit(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the jail process to exit and its stderr to close."""
        if self._proc is None:
            return
        try:
            await asyncio.wait_for(self._proc.wait(), timeout_s)
            if self._stderr_task is not None:
                await asyncio.wait_for(self._stderr_task, timeout_s)
        except TimeoutError:
            pass


def _rlimits(limits: Limits) -> dict:
    """The zygote's rlimit request (units the kernel uses: seconds, bytes, counts); [soft, hard] or one value."""
    cpu = max(1, int(-(-limits.cpu_s // 1)))
    return {
        "cpu": [cpu, cpu + 1],  # soft: SIGXCPU; hard, a second later: SIGKILL
        "as": limits.memory_mb << 20,
        "nproc": (limits.max_processes or 0) + 1,  # the zygote runs under the same uid
        "fsize": limits.max_file_mb << 20,
        "nofile": limits.max_open_files,
        "core": 0,
    }


async def _read_pipe(loop: asyncio.AbstractEventLoop, fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    stream = asyncio.StreamReader(limit=1 << 20)
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(stream), os.fdopen(fd, "rb", buffering=0)
    )
    return stream, transport


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _feed(loop: asyncio.AbstractEventLoop, fd: int, data: bytes) -> None:
    """Write ``data`` to the snippet's stdin pipe without blocking the loop, then close it."""
    os.set_blocking(fd, False)
    view = memoryview(data)
    try:
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                ready: asyncio.Future[None] = loop.create_future()
                loop.add_writer(fd, _resolve, ready)
                try:
                    await ready
                finally:
                    loop.remove_writer(fd)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the snippet exited without reading all of its input
    finally:
        os.close(fd)
