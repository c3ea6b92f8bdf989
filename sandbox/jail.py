"""The command lines of the jails: bubblewrap by default, nsjail when configured.

Two shapes: a one-shot jail that runs one snippet (``python /code/main.py``, the cold path), and a warm jail
whose process 1 is the zygote (:mod:`sandbox.zygote`) that forks one fresh child per snippet. Both backends
build the same jail (the upstream AFM code tool runs nsjail with a similar recipe:
OPPO-PersonalAI/Agent_Foundation_Models, ``verl/verl/tools/code_executor.py``):

- namespaces: user, pid, net (only a loopback of its own: no network), ipc, uts, mount, cgroup;
- a read-only root holding only ``/usr`` (plus the ``/bin``, ``/lib``, ``/lib64``, ``/sbin`` links),
  ``/etc/ld.so.cache``, the interpreter's prefix and any configured read-only paths. The host's
  ``/home``, ``/root``, the repository, ``/etc/shadow`` and every other path are absent;
- a private, size-capped tmpfs on ``/tmp`` (the working directory), a minimal read-only ``/dev`` (with a
  size-capped ``/dev/shm``), a fresh ``/proc`` that shows only the jail's own processes;
- an empty environment apart from ``PATH``, ``HOME`` and ``LANG``, no capabilities,
  ``no_new_privs``, a new session, and SIGKILL of the jail when its parent dies;
- a seccomp filter (:mod:`sandbox.seccomp`: no new namespaces, mounts, ptrace, keyrings, eBPF, ...), and on
  bubblewrap >= 0.8 ``--disable-userns`` as well: no nested user namespace;
- rlimits: CPU seconds (soft limit sends SIGXCPU, hard limit one second later sends SIGKILL), address
  space, processes, file size, open files, no core dumps. The snippet's are set inside the jail (by
  ``prlimit`` in a one-shot jail, by the zygote in a warm one, by nsjail in its child), and the process
  limit never on the jail binary: ``RLIMIT_NPROC`` counts the tasks of the jail's own user namespace (the
  snippet's and its init's), nothing else that runs under the same host uid (see :func:`bwrap_argv`).

When the server runs as root, each snippet slot runs as its own unprivileged host uid/gid
(``uid_base + block * UIDS_PER_SERVER + slot``): concurrent snippets, also those of other sandbox servers on the
host, cannot signal or ptrace each other. Each live server holds its block alone (:func:`claim_uid_block`: an
advisory lock on a per-block file, taken at start, released at exit). Not root, every slot runs as the server's
own uid; the jails still keep snippets apart (own pid, user and IPC namespaces: nothing outside is visible or
reachable) and the process limit is counted in each jail's user namespace, as above.
"""

from __future__ import annotations

import fcntl
import functools
import math
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from sandbox.seccomp import kafel_policy

# Uids reserved per sandbox server process (its max_concurrency must not exceed this).
UIDS_PER_SERVER = 1024
# Uid blocks on a host: at most this many root sandbox servers at once (the last block ends below 2**31 by far).
UID_BLOCKS = 1000
# Where the snippet file appears inside the jail.
CODE_DIR_IN_JAIL = "/code"
CODE_PATH_IN_JAIL = "/code/main.py"
# The zygote of warm jails (sandbox/zygote.py), bound read-only into the jail.
ZYGOTE_FILE = Path(__file__).with_name("zygote.py")
ZYGOTE_PATH_IN_JAIL = "/sandbox/zygote.py"
_PATH_ENV = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class Limits:
    """Resource limits for one snippet.

    Attributes:
        timeout_s: wall-clock seconds before the whole jail is killed.
        memory_mb: address-space limit (``RLIMIT_AS``) in MiB.
        cpu_s: CPU seconds (``RLIMIT_CPU`` soft limit, rounded up; the hard limit is one second more).
        max_processes: processes and threads the snippet may have at once, itself included (its
            ``RLIMIT_NPROC``, counted in the jail's own user namespace); None: unchanged.
        max_file_mb: largest file the snippet may write (``RLIMIT_FSIZE``), MiB.
        max_open_files: ``RLIMIT_NOFILE``.
        tmp_size_mb: size of the private ``/tmp`` tmpfs, MiB.
    """

    timeout_s: float
    memory_mb: int
    cpu_s: float
    max_processes: int | None = 32
    max_file_mb: int = 16
    max_open_files: int = 64
    tmp_size_mb: int = 64


@dataclass
class JailConfig:
    """How jails are built on this host.

    Attributes:
        nsjail_path: path to an nsjail binary; when set, nsjail is the backend, else bubblewrap.
        bwrap_path: the bubblewrap binary (looked up on PATH).
        python: interpreter run inside the jail; its ``sys.prefix`` is bound read-only when it is
            outside ``/usr``.
        ro_paths: extra host paths bound read-only at the same place (e.g. a conda env with numpy).
        uid_base: first host uid/gid of the snippet slots when the server is root.
        uid_lock_dir: the host-wide folder of the uid blocks' lock files (:func:`claim_uid_block`); servers that
            share the host's uids (containers included) must see the same folder.
    """

    nsjail_path: str | None = None
    bwrap_path: str = "bwrap"
    python: str = "/usr/bin/python3"
    ro_paths: list[str] = field(default_factory=list)
    uid_base: int = 2_000_000
    uid_lock_dir: str = "/run/lock/afm-sandbox"

    @property
    def backend(self) -> str:
        return "nsjail" if self.nsjail_path else "bwrap"

    def check(self) -> None:
        """Fail early with a clear message when the backend or the interpreter is missing.

        Raises:
            FileNotFoundError: the jail binary, the interpreter or a read-only path does not exist.
        """
        binary = self.nsjail_path or self.bwrap_path
        if shutil.which(binary) is None:
            hint = (
                "set nsjail_path to an nsjail binary"
                if self.nsjail_path
                else "install bubblewrap (requirements/apt.txt)"
            )
            raise FileNotFoundError(f"sandbox backend {self.backend!r}: {binary!r} not found; {hint}")
        if not os.access(self.python, os.X_OK):
            raise FileNotFoundError(f"sandbox python {self.python!r} is not an executable file")
        for path in self.ro_paths:
            if not os.path.exists(path):
                raise FileNotFoundError(f"sandbox ro_paths entry {path!r} does not exist")


class UidBlock:
    """A block of :data:`UIDS_PER_SERVER` host uids that this process holds alone while the block is open.

    Held through an exclusive ``flock`` on its lock file: the kernel releases it when the file is closed, by
    :meth:`close` or by the end of the process, however it ends (SIGKILL included), so a dead server's block is
    free again and a live one's is never handed out twice.
    """

    def __init__(self, cfg: JailConfig, index: int, fd: int) -> None:
        self.index, self.first = index, cfg.uid_base + index * UIDS_PER_SERVER
        self._fd: int | None = fd

    def uid(self, slot: int) -> int:
        """Host uid (and gid) of snippet slot ``slot``.

        Raises:
            ValueError: ``slot`` outside ``[0, UIDS_PER_SERVER)``.
        """
        if not 0 <= slot < UIDS_PER_SERVER:
            raise ValueError(f"sandbox slot {slot} out of range: max_concurrency is at most {UIDS_PER_SERVER}")
        return self.first + slot

    @property
    def uids(self) -> tuple[int, int]:
        """The first and the last uid of the block."""
        return self.first, self.first + UIDS_PER_SERVER - 1

    def close(self) -> None:
        """Release the block (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def claim_uid_block(cfg: JailConfig) -> UidBlock:
    """The first uid block no other live process holds, from block ``pid % UID_BLOCKS`` on (which spreads the
    servers over the blocks: a block is seldom held, and a released one seldom taken again at once).

    Raises:
        RuntimeError: all :data:`UID_BLOCKS` blocks are held (as many root sandbox servers alive on this host).
        OSError: ``cfg.uid_lock_dir`` cannot be created or written (the message names it and the flag).
    """
    lock_dir = Path(cfg.uid_lock_dir)
    start = os.getpid() % UID_BLOCKS
    try:
        lock_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        for step in range(UID_BLOCKS):
            index = (start + step) % UID_BLOCKS
            fd = os.open(lock_dir / f"uid-block-{index:03d}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another live server's
                os.close(fd)
                continue
            return UidBlock(cfg, index, fd)
    except OSError as e:
        raise OSError(e.errno, f"sandbox uid blocks: cannot use {lock_dir} ({e.strerror}); set --uid-lock-dir to "
                      "a writable folder that every sandbox server on this host sees") from e  # fmt: skip
    raise RuntimeError(f"all {UID_BLOCKS} sandbox uid blocks are held (lock files in {lock_dir})")


def slot_identity(uids: UidBlock | None, slot: int) -> dict:
    """``subprocess`` keyword arguments that run slot ``slot`` as its own unprivileged host uid of ``uids`` (the
    server's block when it is root; None: the server's own uid)."""
    if uids is None:
        return {}
    uid = uids.uid(slot)
    return {"user": uid, "group": uid, "extra_groups": []}


def _prefix_binds(cfg: JailConfig) -> list[str]:
    """Host paths to bind read-only: the interpreter's prefix (when outside /usr) and ``ro_paths``."""
    paths = list(cfg.ro_paths)
    python = Path(cfg.python).resolve()
    if not str(python).startswith("/usr/"):
        # e.g. a pyenv or conda interpreter at <prefix>/bin/python3.x
        paths.append(str(python.parent.parent))
    return paths


def _rlimit_args(limits: Limits, cpu: bool = True, other_tasks: int = 0) -> list[str]:
    """``prlimit(1)`` options (values in the units the kernel uses: bytes, seconds, counts).

    Args:
        other_tasks: tasks besides the snippet's that ``RLIMIT_NPROC`` counts where it is set.
    """
    seconds = max(1, math.ceil(limits.cpu_s))
    nproc = None if limits.max_processes is None else limits.max_processes + other_tasks
    return [
        *([f"--cpu={seconds}:{seconds + 1}"] if cpu else []),
        f"--as={limits.memory_mb << 20}",
        *([f"--nproc={nproc}"] if nproc is not None else []),
        f"--fsize={limits.max_file_mb << 20}",
        f"--nofile={limits.max_open_files}",
        "--core=0",
    ]


def jail_env() -> dict[str, str]:
    """The snippet's whole environment."""
    return {"PATH": _PATH_ENV, "HOME": "/tmp", "LANG": "C.UTF-8"}


def _python_argv(cfg: JailConfig) -> list[str]:
    """Isolated mode (no PYTHON* env, no user site), unbuffered (output before a kill is kept), no .pyc."""
    return [cfg.python, "-I", "-u", "-B", CODE_PATH_IN_JAIL]


def _zygote_argv(cfg: JailConfig, ctrl_fd: int) -> list[str]:
    return [cfg.python, "-I", "-u", "-B", ZYGOTE_PATH_IN_JAIL, str(ctrl_fd)]


def bwrap_supports_disable_userns(cfg: JailConfig) -> bool:
    """Whether this bubblewrap has ``--disable-userns`` (0.8.0 and later)."""
    return _bwrap_has_flag(cfg.bwrap_path, "--disable-userns")


@functools.cache
def _bwrap_has_flag(bwrap: str, flag: str) -> bool:
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return flag in out.stdout + out.stderr


def _bwrap_jail(cfg: JailConfig, tmp_size_mb: int, seccomp_fd: int) -> list[str]:
    """bubblewrap options shared by the one-shot and the warm jail (everything but the snippet's files)."""
    argv = [
        cfg.bwrap_path,
        "--unshare-all",
        "--unshare-user",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
    ]
    if bwrap_supports_disable_userns(cfg):
        argv.append("--disable-userns")  # no nested user namespace (seccomp refuses unshare/clone too)
    argv += ["--seccomp", str(seccomp_fd)]
    argv += ["--uid", "65534", "--gid", "65534", "--hostname", "sandbox"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink(f"/{link}"):
            argv += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
        elif os.path.isdir(f"/{link}"):
            argv += ["--ro-bind", f"/{link}", f"/{link}"]
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for path in _prefix_binds(cfg):
        argv += ["--ro-bind", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(tmp_size_mb << 20), "--tmpfs", "/tmp"]
    # /dev is a tmpfs too: read-only but for a size-capped /dev/shm (POSIX semaphores of multiprocessing)
    argv += ["--size", str(tmp_size_mb << 20), "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    return argv


def _bwrap_tail(binds: list[str]) -> list[str]:
    argv = [*binds, "--remount-ro", "/", "--clearenv"]
    for key, value in jail_env().items():
        argv += ["--setenv", key, value]
    return [*argv, "--chdir", "/tmp"]


def bwrap_argv(cfg: JailConfig, limits: Limits, code_file: Path, *, seccomp_fd: int) -> list[str]:
    """argv for ``bwrap … -- prlimit … -- python -I -u -B /code/main.py`` (one jail per snippet: the cold path).

    The rlimits are set inside the jail, where ``RLIMIT_NPROC`` counts the tasks of the jail's user namespace:
    bubblewrap's pid 1 and the snippet's. Set on bubblewrap itself (before it makes the namespace), the limit
    would count every task of the host uid, among them the pid 1 of the slot's earlier jails: bubblewrap's
    launcher exits as soon as the snippet has (``monitor_child`` returns on the snippet's exit status without
    waiting for the jail's pid 1; containers/bubblewrap, ``bubblewrap.c``), so each jail's pid 1 ends up a
    zombie of the host's init, counted until that init reaps it, which can be seconds later (a burst of cold
    snippets then failed with ``bwrap: Can't fork for pid 1: Resource temporarily unavailable``).

    Args:
        code_file: host path of the snippet (must be readable by the slot uid).
        seccomp_fd: an fd the jail inherits, holding :func:`sandbox.seccomp.bpf_program`.
    """
    argv = _bwrap_jail(cfg, limits.tmp_size_mb, seccomp_fd)
    argv += _bwrap_tail(["--ro-bind", str(code_file), CODE_PATH_IN_JAIL])
    return [*argv, "--", "prlimit", *_rlimit_args(limits, other_tasks=1), "--", *_python_argv(cfg)]


def bwrap_zygote_argv(cfg: JailConfig, limits: Limits, code_dir: Path, ctrl_fd: int, *, seccomp_fd: int) -> list[str]:
    """argv of a warm jail: ``bwrap … python -I -u -B /sandbox/zygote.py CTRL_FD`` as the jail's process 1.

    Args:
        limits: the most any snippet may ask for (the zygote sets each snippet's); its CPU limit is unused, and
            its ``max_processes`` should be None: a process limit set here would count the host uid's tasks
            (see :func:`bwrap_argv`), while the zygote sets the snippet's inside the jail.
        code_dir: host folder holding the slot's ``main.py``, bound read-only at ``/code``.
        ctrl_fd: the zygote's end of the control socket (inherited).
    """
    argv = ["prlimit", *_rlimit_args(limits, cpu=False), "--", *_bwrap_jail(cfg, limits.tmp_size_mb, seccomp_fd)]
    argv.append("--as-pid-1")
    argv += _bwrap_tail(
        ["--ro-bind", str(code_dir), CODE_DIR_IN_JAIL, "--ro-bind", str(ZYGOTE_FILE), ZYGOTE_PATH_IN_JAIL]
    )
    return [*argv, "--", *_zygote_argv(cfg, ctrl_fd)]


def _nsjail_jail(cfg: JailConfig, limits: Limits, warm: bool) -> list[str]:
    if cfg.nsjail_path is None:
        raise ValueError("nsjail command line without JailConfig.nsjail_path")
    cpu = max(1, math.ceil(limits.cpu_s))
    argv = [cfg.nsjail_path, "--mode", "o", "--really_quiet", "--hostname", "sandbox"]
    argv += ["--user", "65534", "--group", "65534", "--seccomp_string", kafel_policy()]
    argv += ["--rlimit_as", str(limits.memory_mb), "--rlimit_cpu", "inf" if warm else str(cpu)]
    nproc = "hard" if limits.max_processes is None else str(limits.max_processes)  # hard: keep the user's
    argv += ["--rlimit_nproc", nproc, "--rlimit_fsize", str(limits.max_file_mb)]
    argv += ["--rlimit_nofile", str(limits.max_open_files), "--rlimit_core", "0"]
    argv += ["--time_limit", "0" if warm else str(math.ceil(limits.timeout_s) + 1)]
    argv += ["--bindmount_ro", "/usr:/usr"]
    for link in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink(f"/{link}"):
            argv += ["--symlink", f"{os.readlink(f'/{link}')}:/{link}"]
        elif os.path.isdir(f"/{link}"):
            argv += ["--bindmount_ro", f"/{link}:/{link}"]
    if os.path.exists("/etc/ld.so.cache"):
        argv += ["--bindmount_ro", "/etc/ld.so.cache:/etc/ld.so.cache"]
    for path in _prefix_binds(cfg):
        argv += ["--bindmount_ro", f"{path}:{path}"]
    for dev in ("null", "zero", "urandom", "random"):
        argv += ["--bindmount", f"/dev/{dev}:/dev/{dev}"]
    argv += ["--mount", f"none:/tmp:tmpfs:size={limits.tmp_size_mb << 20}"]
    for key, value in jail_env().items():
        argv += ["--env", f"{key}={value}"]
    return argv


def nsjail_argv(cfg: JailConfig, limits: Limits, code_file: Path) -> list[str]:
    """argv for ``nsjail --mode o … python -I -u -B /code/main.py`` (the upstream recipe's backend; cold path)."""
    argv = _nsjail_jail(cfg, limits, warm=False)
    argv += ["--bindmount_ro", f"{code_file}:{CODE_PATH_IN_JAIL}"]
    return [*argv, "--cwd", "/tmp", "--", *_python_argv(cfg)]


def nsjail_zygote_argv(cfg: JailConfig, limits: Limits, code_dir: Path, ctrl_fd: int) -> list[str]:
    """argv of a warm nsjail jail running the zygote as its process 1 (see :func:`bwrap_zygote_argv`)."""
    argv = _nsjail_jail(cfg, limits, warm=True)
    argv += [
        "--bindmount_ro",
        f"{code_dir}:{CODE_DIR_IN_JAIL}",
        "--bindmount_ro",
        f"{ZYGOTE_FILE}:{ZYGOTE_PATH_IN_JAIL}",
    ]
    argv += ["--pass_fd", str(ctrl_fd)]
    return [*argv, "--cwd", "/tmp", "--", *_zygote_argv(cfg, ctrl_fd)]


def launcher_env() -> dict[str, str]:
    """Environment of the jail binary itself: nothing of the server's (its /proc/1/environ is visible inside)."""
    return {"PATH": _PATH_ENV}
