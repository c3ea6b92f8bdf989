"""``python -m tests.tools.sandbox_server_as ARGS``: ``python -m sandbox.server ARGS`` under test conditions that a
test cannot otherwise arrange for a real server process:

- ``AFM_TEST_UID``: drop root for this uid (and gid) first, so the server runs without root (every slot as itself);
- ``AFM_TEST_PID``: the process id ``os.getpid()`` answers in the server, so two servers whose pids collide
  modulo :data:`sandbox.jail.UID_BLOCKS` can be started side by side.
"""

from __future__ import annotations

import ctypes
import os
import signal

from sandbox.seccomp import bpf_program
from sandbox.server import main

# Imported and built as the starting user: the interpreter's own files (a pyenv under /root) may be out of the
# other user's reach, and these import more on first use.
bpf_program()

PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4

if uid := os.environ.get("AFM_TEST_UID"):
    os.setgroups([])
    os.setgid(int(uid))
    os.setuid(int(uid))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # cleared by the change of uid (ServerGroup had set it)
    libc.prctl(PR_SET_DUMPABLE, 1)  # cleared too; as after an exec by that user

if pid := os.environ.get("AFM_TEST_PID"):
    os.getpid = lambda: int(pid)

if __name__ == "__main__":
    main()
