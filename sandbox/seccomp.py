"""The jail's seccomp filter: one deny list, compiled for both backends.

Everything is allowed except the system calls below, which fail with ``EPERM`` (``clone3`` with ``ENOSYS``,
so that glibc falls back to ``clone``, whose flags a filter can see). The list follows the syscalls Docker's
default profile keeps from unprivileged containers (``moby/moby``, ``profiles/seccomp/default.json``): new
namespaces (``unshare``, ``setns``, ``clone`` with ``CLONE_NEWUSER``), mounts, ``ptrace`` and cross-process
memory access, kernel keyrings, eBPF, perf events, ``userfaultfd``, io_uring, modules, kexec, clocks, swap and
reboot. System V IPC and POSIX message queues are refused too: their objects outlive the process that made
them and would carry state from one snippet to the next in a warm jail.

- bubblewrap: :func:`bpf_program` (compiled by libseccomp through ``pyseccomp``) is passed with ``--seccomp FD``;
- nsjail: :func:`kafel_policy` is passed with ``--seccomp_string`` (nsjail's kafel language).
"""

from __future__ import annotations

import errno
import functools
import logging
import tempfile

log = logging.getLogger(__name__)

CLONE_NEWUSER = 0x10000000

#: System calls that fail with EPERM inside the jail.
DENIED = (
    # namespaces and mounts
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    # other processes' memory and files
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "kcmp",
    # kernel attack surface
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "fanotify_init",
    "open_by_handle_at",
    "name_to_handle_at",
    "lookup_dcookie",
    "quotactl",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "syslog",
    "vhangup",
    "iopl",
    "ioperm",
    "uselib",
    "ustat",
    "sysfs",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    # IPC objects that outlive their process
    "shmget",
    "semget",
    "msgget",
    "mq_open",
)
#: System calls that fail with ENOSYS (callers fall back to an older call the filter can inspect).
UNAVAILABLE = ("clone3",)


@functools.cache
def bpf_program() -> bytes:
    """The filter as a classic BPF program for the host architecture (``bwrap --seccomp``).

    Raises:
        ImportError: ``pyseccomp`` is missing (``requirements/base.txt``), or libseccomp is not installed
            (``libseccomp2``, ``requirements/apt.txt``).
    """
    import pyseccomp as sc

    flt = sc.SyscallFilter(defaction=sc.ALLOW)
    for names, action in ((DENIED, sc.ERRNO(errno.EPERM)), (UNAVAILABLE, sc.ERRNO(errno.ENOSYS))):
        for name in names:
            try:
                flt.add_rule(action, name)
            except (ValueError, OSError, RuntimeError) as e:  # a call this libseccomp or architecture lacks
                log.debug("seccomp: skipping %s: %s", name, e)
    flt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    with tempfile.TemporaryFile() as out:  # libseccomp writes to a file descriptor
        flt.export_bpf(out)
        out.seek(0)
        return out.read()


def kafel_policy() -> str:
    """The filter in nsjail's kafel language (``nsjail --seccomp_string``)."""
    deny = ", ".join(_KAFEL_NAMES.get(n, n) for n in DENIED)
    clone = "clone(clone_flags, newsp, parent_tidptr, child_tidptr, tls)"
    return (
        f"ERRNO({errno.EPERM}) {{ {deny} }} "
        f"ERRNO({errno.ENOSYS}) {{ {', '.join(UNAVAILABLE)} }} "
        f"ERRNO({errno.EPERM}) {{ {clone} {{ (clone_flags & {CLONE_NEWUSER:#x}) == {CLONE_NEWUSER:#x} }} }} "
        "DEFAULT ALLOW"
    )


# Kafel's names where they differ from the kernel's (kafel's x86_64 table calls umount2 "umount").
_KAFEL_NAMES = {"umount2": "umount"}
