"""Inside a warm jail: a zygote that forks one fresh child per snippet (run by :mod:`sandbox.warm`).

``python -I -u -B /sandbox/zygote.py FD`` runs as the jail's process 1 (the init of its pid namespace), so
snippets can neither signal it (the kernel drops signals to a namespace init that has no handler) nor
ptrace or read it (it is not dumpable). It talks to the server over the ``SOCK_SEQPACKET`` socket ``FD``:

- hello, sent once: ``{"ready": true, "pid": 1}``;
- request: ``{"limits": {...}, "timeout_s": float, "env": {...}}`` with three file descriptors attached
  (``SCM_RIGHTS``): the snippet's stdin, stdout and stderr pipes. The snippet is ``/code/main.py``;
- while a snippet runs, the message ``kill`` ends it (output flood, client gone);
- reply: ``{"exit_code": int, "timed_out": bool}``; ``exit_code`` is 128 + N when signal N ended it, -9
  when the zygote killed it (deadline or ``kill``).

Each child, before it runs the snippet: joins a new session, takes the pipes as fds 0-2 and closes every
other fd (the control socket included), sets the snippet's rlimits (CPU seconds count from the fork, so no
budget carries over), a fresh environment, ``/tmp`` as working directory, Python's default signal handlers,
a fresh ``__main__`` module and ``sys.argv``; then runs the file as ``python /code/main.py`` would (exit
status, tracebacks without the zygote's frames, ``sys.excepthook``, non-daemon threads and ``atexit`` at
the end). After the snippet, the zygote kills every other process of the jail, reaps them, and empties
``/tmp`` and ``/dev/shm``: the next snippet starts from the same state as the first. If that cleanup
fails, the zygote exits and the server starts a new jail.

Only the standard library; kept compatible with Python >= 3.9 (the jail's interpreter is configurable).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import socket
import stat
import sys
import time
import types

CODE_PATH = "/code/main.py"
WIPED = ("/tmp", "/dev/shm")
_PR_SET_DUMPABLE = 4
_RLIMITS = {
    "cpu": resource.RLIMIT_CPU,
    "as": resource.RLIMIT_AS,
    "nproc": resource.RLIMIT_NPROC,
    "fsize": resource.RLIMIT_FSIZE,
    "nofile": resource.RLIMIT_NOFILE,
    "core": resource.RLIMIT_CORE,
}
_libc = ctypes.CDLL(None, use_errno=True)


def run_snippet() -> int:
    """Run ``/code/main.py`` in this (child) process like the interpreter's main; returns the exit status."""
    import builtins

    main = types.ModuleType("__main__")
    main.__file__ = CODE_PATH
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    main.__cached__ = None  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    sys.argv[:] = [CODE_PATH]
    try:
        with open(CODE_PATH, "rb") as f:
            source = f.read()
        exec(compile(source, CODE_PATH, "exec", dont_inherit=True), main.__dict__)
        return 0
    except SystemExit as e:
        return _exit_status(e)
    except BaseException as e:  # what the interpreter does with an uncaught exception
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # hide the zygote's frames, as a traceback of `python main.py` has none
        try:
            sys.excepthook(type(e), e, e.with_traceback(tb).__traceback__)
        except BaseException:
            pass
        if isinstance(e, KeyboardInterrupt):
            return 128 + signal.SIGINT
        return 1


def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    try:
        print(e.code, file=sys.stderr)
    except BaseException:
        pass
    return 1


def _finalize(status: int) -> None:
    """End the child as the interpreter ends: join non-daemon threads, run atexit, flush, exit."""
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()  # type: ignore[attr-defined]
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(status)


def child(request: dict, fds: list[int]) -> None:
    """In the forked child: isolate from the zygote, set limits, run the snippet, exit (never returns)."""
    status = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)  # the control socket and anything else the zygote holds
        for name, value in request["limits"].items():
            soft, hard = value if isinstance(value, list) else (value, value)
            resource.setrlimit(_RLIMITS[name], (soft, hard))
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir("/tmp")
        os.umask(0o022)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
        status = run_snippet()
    except BaseException:
        import traceback

        traceback.print_exc()
    _finalize(status)


def supervise(pid: int, ctrl: socket.socket, timeout_s: float) -> tuple[int, bool]:
    """Wait for the snippet's process: its exit, the wall-clock deadline, or ``kill`` from the server.

    Returns:
        ``(exit_code, timed_out)``; ``exit_code`` is 128 + N when signal N ended it, -9 when the zygote
        killed it (deadline or ``kill``).
    """
    pidfd = os.pidfd_open(pid)
    deadline = time.monotonic() + timeout_s
    timed_out = False
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.register(ctrl.fileno(), select.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            events = dict(poller.poll(left * 1000))
            if pidfd in events:
                break
            if ctrl.fileno() in events:
                if ctrl.recv(64) != b"kill":  # b"": the server is gone
                    os._exit(0)
                break
        killed = not _exited(pid)
        if killed:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(pidfd)
    if killed:  # as a killed one-shot jail reports it
        return -signal.SIGKILL, timed_out
    code = os.waitstatus_to_exitcode(status)
    return (128 - code if code < 0 else code), timed_out


def _exited(pid: int) -> bool:
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def clean_up() -> None:
    """Kill and reap every process of the jail but this one, and empty the writable folders.

    Raises:
        OSError: something could not be removed (the caller then ends the jail).
    """
    while True:
        try:
            os.kill(-1, signal.SIGKILL)  # every process of the namespace but its init (this one)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    for folder in WIPED:
        if os.path.isdir(folder) and os.access(folder, os.W_OK):
            _empty(folder)


def _empty(folder: str) -> None:
    for entry in os.scandir(folder):
        if entry.is_dir(follow_symlinks=False):
            os.chmod(entry.path, stat.S_IRWXU)
            _empty(entry.path)
            os.rmdir(entry.path)
        else:
            os.unlink(entry.path)


def serve(ctrl: socket.socket) -> None:
    ctrl.send(json.dumps({"ready": True, "pid": os.getpid()}).encode())
    while True:
        message, fds, _, _ = socket.recv_fds(ctrl, 1 << 16, 3)
        if not message:
            return  # the server closed the socket
        if message == b"kill":  # meant for a snippet that ended meanwhile
            continue
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            child(request, fds)
        for fd in fds:
            os.close(fd)
        exit_code, timed_out = supervise(pid, ctrl, float(request["timeout_s"]))
        clean_up()
        ctrl.send(json.dumps({"exit_code": exit_code, "timed_out": timed_out}).encode())


def main() -> None:
    # As the namespace's init, a signal reaches this process only through a handler: install none.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    ctrl = socket.socket(fileno=int(sys.argv[1]))
    try:
        serve(ctrl)
    except OSError as e:  # cleanup failed or the socket broke: end the jail, the server starts a new one
        print(f"zygote: {e.__class__.__name__}: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
