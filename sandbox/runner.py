"""Run Python snippets in jails without blocking the event loop: bounded concurrency, a bounded queue,
capped output and a wall-clock kill.

Each slot keeps a warm jail (:mod:`sandbox.warm`) whose zygote forks a fresh child per snippet; with
``RunnerConfig.warm=False`` (``--cold``) every snippet gets a jail and an interpreter of its own instead.

The upstream code tool runs one snippet at a time on the rollout's event loop (a blocking
``p.join()`` inside ``async def``; OPPO-PersonalAI/Agent_Foundation_Models, ``verl/verl/tools/code_executor.py``). Here every snippet is
an asyncio subprocess; at most ``max_concurrency`` run at once, up to ``max_queue`` more wait for a slot,
and anything beyond that is refused at once (:class:`QueueFullError`, HTTP 503 at the server).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from sandbox.jail import (
    UIDS_PER_SERVER,
    JailConfig,
    Limits,
    UidBlock,
    bwrap_argv,
    claim_uid_block,
    launcher_env,
    nsjail_argv,
    slot_identity,
)
from sandbox.warm import JailStartError, WarmJail, seccomp_memfd

#: Every status a run can end with.
STATUSES = ("ok", "error", "timeout", "memory_limit", "output_limit", "killed", "sandbox_error")


class QueueFullError(RuntimeError):
    """All slots are busy and ``max_queue`` snippets already wait."""


@dataclass
class RunResult:
    """The outcome of one snippet (the server's JSON response body).

    Attributes:
        status: one of :data:`STATUSES`. ``timeout``: the wall clock or the CPU limit ran out;
            ``memory_limit``: the address-space limit was hit (``MemoryError``); ``output_limit``: a stream
            passed ``kill_output_bytes`` and the snippet was killed; ``killed``: ended by another signal;
            ``sandbox_error``: the jail itself failed to start (the snippet never ran).
        stdout, stderr: decoded output (UTF-8, invalid bytes replaced), at most ``max_output_bytes`` each,
            followed by a truncation marker when cut.
        exit_code: the snippet's exit status (128 + signal number when killed), None when not known.
        duration_s: wall-clock seconds from start to exit, queueing excluded.
        truncated: whether stdout or stderr was cut.
    """

    status: str
    stdout: str
    stderr: str
    exit_code: int | None
    duration_s: float
    truncated: bool

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class RunnerConfig:
    """Server-wide limits and defaults (bytes, seconds, MiB as named).

    ``warm``: keep a warm jail per slot (a zygote forks each snippet); False: a new jail per snippet.
    """

    jail: JailConfig = field(default_factory=JailConfig)
    warm: bool = True
    max_concurrency: int = 4
    max_queue: int = 256
    max_output_bytes: int = 64 << 10
    kill_output_bytes: int = 8 << 20
    max_code_bytes: int = 1 << 20
    max_stdin_bytes: int = 16 << 20
    default_timeout_s: float = 10.0
    max_timeout_s: float = 60.0
    default_memory_mb: int = 512
    min_memory_mb: int = 64
    max_memory_mb: int = 4096
    max_processes: int = 32
    max_file_mb: int = 16
    max_open_files: int = 64
    tmp_size_mb: int = 64


class _CappedReader:
    """Drains a stream, keeping the first ``keep`` bytes; calls ``on_flood`` once past ``flood`` bytes."""

    def __init__(self, stream: asyncio.StreamReader, keep: int, flood: int, on_flood) -> None:
        self.data = bytearray()
        self.total = 0
        self.flooded = False
        self._stream, self._keep, self._flood, self._on_flood = stream, keep, flood, on_flood

    async def run(self) -> None:
        while chunk := await self._stream.read(1 << 16):
            self.total += len(chunk)
            if len(self.data) < self._keep:
                self.data += chunk[: self._keep - len(self.data)]
            if self.total > self._flood and not self.flooded:
                self.flooded = True
                self._on_flood()

    def text(self) -> tuple[str, bool]:
        """Decoded kept bytes plus a marker when cut, and whether it was cut."""
        text = self.data.decode("utf-8", errors="replace")
        if self.total <= self._keep:
            return text, False
        more = f"{self.total - self._keep}+" if self.flooded else str(self.total - self._keep)
        return f"{text}\n[... output truncated: {more} more bytes ...]", True


class SnippetRunner:
    """Runs snippets in jails, ``max_concurrency`` at a time, with a bounded wait queue.

    As root it holds a uid block of its own (:func:`sandbox.jail.claim_uid_block`) from construction to
    :meth:`close`: each slot's jails run as that slot's uid of it.

    Raises:
        ValueError: ``max_concurrency`` outside ``[1, UIDS_PER_SERVER]``.
        RuntimeError: (root) every uid block is held by another live server.
    """

    def __init__(self, cfg: RunnerConfig) -> None:
        if not 1 <= cfg.max_concurrency <= UIDS_PER_SERVER:
            raise ValueError(f"max_concurrency must be in [1, {UIDS_PER_SERVER}], got {cfg.max_concurrency}")
        self.cfg = cfg
        self.uids: UidBlock | None = claim_uid_block(cfg.jail) if os.geteuid() == 0 else None
        self._free_slots: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(cfg.max_concurrency):
            self._free_slots.put_nowait(slot)
        self._waiting = 0
        self._work_dir = Path(tempfile.mkdtemp(prefix="afm-sandbox-"))
        # Slot uids must reach the snippet files, but not list the folder.
        self._work_dir.chmod(0o711)
        self._jails: list[WarmJail] = []
        if cfg.warm:
            # The jail's own limits: the most a snippet may ask for. No process limit: one on the jail would
            # count the slot uid's tasks on the host, zombies of the slot's replaced jails among them (see
            # sandbox.jail.bwrap_argv); the zygote sets each snippet's in the jail's own user namespace.
            ceiling = replace(self.limits(cfg.max_timeout_s, cfg.max_memory_mb), max_processes=None)
            self._jails = [WarmJail(cfg.jail, slot, self._work_dir, ceiling, self.uids)
                           for slot in range(cfg.max_concurrency)]  # fmt: skip

    async def start(self) -> None:
        """Start the warm jails (else each starts before its slot's first snippet).

        Raises:
            JailStartError: a jail could not start (the message holds bubblewrap's or nsjail's).
        """
        await asyncio.gather(*(jail.start() for jail in self._jails))

    def close(self) -> None:
        """Kill the warm jails, remove the folder of snippet files and release the uid block (see :meth:`aclose`
        in a running loop)."""
        for jail in self._jails:
            jail.kill()
        shutil.rmtree(self._work_dir, ignore_errors=True)
        if self.uids is not None:
            self.uids.close()

    async def aclose(self) -> None:
        """Kill the warm jails, wait until they have exited, then :meth:`close`."""
        for jail in self._jails:
            jail.kill()
        await asyncio.gather(*(jail.wait_exit(5.0) for jail in self._jails))
        self.close()

    @property
    def running(self) -> int:
        return self.cfg.max_concurrency - self._free_slots.qsize()

    @property
    def queued(self) -> int:
        return self._waiting

    def limits(self, timeout_s: float, memory_mb: int) -> Limits:
        """Limits of one snippet; the CPU limit equals the wall-clock timeout.

        ``RLIMIT_NPROC`` counts the tasks of the real uid in the task's user namespace (and checks each
        enclosing namespace against the limit its creator had). Every jail sets it inside its own user
        namespace, which holds only the jail's init (the zygote, or bubblewrap's pid 1) and the snippet, so
        ``max_processes`` bounds the snippet alone, whatever else runs under the same host uid.
        """
        return Limits(
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            cpu_s=timeout_s,
            max_processes=self.cfg.max_processes,
            max_file_mb=self.cfg.max_file_mb,
            max_open_files=self.cfg.max_open_files,
            tmp_size_mb=self.cfg.tmp_size_mb,
        )

    async def run(self, code: str, stdin: str | None, timeout_s: float, memory_mb: int) -> RunResult:
        """Run ``code`` with ``stdin`` under the given wall-clock timeout (s) and memory limit (MiB).

        Raises:
            QueueFullError: all slots busy and the wait queue is full.
        """
        if self._free_slots.empty() and self._waiting >= self.cfg.max_queue:
            raise QueueFullError(f"{self.running} snippets running and {self._waiting} queued (max_queue)")
        self._waiting += 1
        try:
            slot = await self._free_slots.get()
        finally:
            self._waiting -= 1
        try:
            limits = self.limits(timeout_s, memory_mb)
            if self._jails:
                return await self._run_warm(self._jails[slot], code, stdin, limits)
            return await self._run_cold(slot, code, stdin, limits)
        finally:
            self._free_slots.put_nowait(slot)

    def _readers(self, out_stream, err_stream, kill) -> tuple[_CappedReader, _CappedReader]:
        keep, flood = self.cfg.max_output_bytes, self.cfg.kill_output_bytes
        return _CappedReader(out_stream, keep, flood, kill), _CappedReader(err_stream, keep, flood, kill)

    async def _run_warm(self, jail: WarmJail, code: str, stdin: str | None, limits: Limits) -> RunResult:
        readers: list[_CappedReader] = []

        def make_readers(out_stream, err_stream, kill):
            readers.extend(self._readers(out_stream, err_stream, kill))
            return readers

        try:
            exit_code, timed_out, duration = await jail.run(code, stdin, limits, make_readers)
        except JailStartError as e:
            return RunResult("sandbox_error", "", str(e), None, 0.0, False)
        out, err = readers
        if exit_code is None and not timed_out:
            return RunResult(
                "sandbox_error",
                "",
                f"the jail died during the snippet: {jail.stderr_tail()[-500:]}",
                None,
                round(duration, 4),
                False,
            )
        return self._result(exit_code, timed_out, out, err, limits, duration, jail_may_fail=False)

    async def _run_cold(self, slot: int, code: str, stdin: str | None, limits: Limits) -> RunResult:
        code_file = self._work_dir / f"{uuid.uuid4().hex}.py"
        code_file.write_text(code, encoding="utf-8")
        code_file.chmod(0o644)
        jail = self.cfg.jail
        seccomp_fd = seccomp_memfd() if jail.backend == "bwrap" else None
        try:
            if seccomp_fd is not None:
                argv = bwrap_argv(jail, limits, code_file, seccomp_fd=seccomp_fd)
            else:
                argv = nsjail_argv(jail, limits, code_file)
            start = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=launcher_env(),
                start_new_session=True,
                pass_fds=() if seccomp_fd is None else (seccomp_fd,),
                **slot_identity(self.uids, slot),
            )
            if seccomp_fd is not None:
                os.close(seccomp_fd)
                seccomp_fd = None
            return await self._supervise(proc, stdin, limits, start)
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)
            code_file.unlink(missing_ok=True)

    async def _supervise(self, proc, stdin: str | None, limits: Limits, start: float) -> RunResult:
        def kill() -> None:
            for action in (proc.kill, lambda: os.killpg(proc.pid, signal.SIGKILL)):
                try:
                    action()
                except (ProcessLookupError, PermissionError):
                    pass

        out, err = self._readers(proc.stdout, proc.stderr, kill)
        tasks = [asyncio.create_task(out.run()), asyncio.create_task(err.run())]
        tasks.append(asyncio.create_task(_feed_stdin(proc, stdin)))
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), timeout=limits.timeout_s)
        except TimeoutError:
            timed_out = True
            kill()
            await proc.wait()
        except asyncio.CancelledError:  # the client went away: leave nothing running
            kill()
            raise
        finally:
            # The jail's pid namespace is gone with its init; the pipes close right after.
            _, pending = await asyncio.wait(tasks, timeout=2.0)
            for task in pending:
                task.cancel()
        return self._result(
            proc.returncode, timed_out, out, err, limits, time.perf_counter() - start, jail_may_fail=True
        )

    def _result(
        self,
        exit_code: int | None,
        timed_out: bool,
        out: _CappedReader,
        err: _CappedReader,
        limits: Limits,
        duration: float,
        jail_may_fail: bool,
    ) -> RunResult:
        stdout, cut_out = out.text()
        stderr, cut_err = err.text()
        jail_failed = jail_may_fail and _jail_failed(exit_code, stdout, stderr, self.cfg.jail)
        status = _classify(exit_code, stderr, timed_out, out.flooded or err.flooded, jail_failed)
        if status == "timeout" and not stderr:
            stderr = f"Timed out after {limits.timeout_s:g} s. Check for infinite loops, blocked I/O (e.g., input()), or deadlocks."
        return RunResult(status, stdout, stderr, exit_code, round(duration, 4), cut_out or cut_err)


async def _feed_stdin(proc, stdin: str | None) -> None:
    try:
        if stdin:
            proc.stdin.write(stdin.encode("utf-8"))
            await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the snippet exited without reading all of its input


def _jail_failed(exit_code: int | None, stdout: str, stderr: str, jail: JailConfig) -> bool:
    """Whether the jail itself failed before the snippet ran.

    bubblewrap reports setup errors as ``bwrap: ...`` on stderr with exit status 1; nsjail (quiet) exits
    255 with no output. A snippet that imitates this only mislabels its own result.
    """
    if stdout:
        return False
    if jail.backend == "bwrap":
        return exit_code == 1 and stderr.startswith("bwrap: ")
    return exit_code == 255 and not stderr


def _classify(exit_code: int | None, stderr: str, timed_out: bool, flooded: bool, jail_failed: bool) -> str:
    if timed_out:
        return "timeout"
    if flooded:
        return "output_limit"
    if jail_failed:
        return "sandbox_error"
    if exit_code == 0:
        return "ok"
    if exit_code in (128 + signal.SIGXCPU, -signal.SIGXCPU):
        return "timeout"
    if "MemoryError" in stderr.rstrip().rsplit("\n", 1)[-1]:
        return "memory_limit"
    if exit_code is not None and (exit_code > 128 or exit_code < 0):
        return "killed"
    return "error"
