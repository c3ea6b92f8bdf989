"""The real local Slurm cluster for tests marked ``slurm``: started once per session by slurm/local-cluster.sh,
with two nodes (``afm-n1``, ``afm-n2``: two slurmd on this host) so multi-node jobs run for real.

The script needs root on Debian (it installs slurm-wlm, munge and MariaDB when missing and starts the daemons);
elsewhere these tests are skipped with the reason. A cluster this session started is stopped at its end; one
that was already running is left running.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from afm_core.utils.paths import repo_root

SCRIPT = repo_root() / "slurm" / "local-cluster.sh"
NODES = 2


def _why_not_here() -> str | None:
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (slurm/local-cluster.sh installs packages and starts daemons)"
    if not Path("/etc/debian_version").is_file() or shutil.which("apt-get") is None:
        return "the local Slurm cluster needs Debian with apt-get (slurm/local-cluster.sh)"
    return None


@pytest.fixture(scope="session")
def slurm_cluster():
    """Start (or reuse) the local two-node cluster; jobs see the repo root on PYTHONPATH (they import tests.slurm.*).

    A running cluster with another node count fails the start with the script's message (stop it first).
    """
    reason = _why_not_here()
    if reason:
        pytest.skip(reason)
    was_running = subprocess.run([SCRIPT, "status"], capture_output=True).returncode == 0
    started = subprocess.run([SCRIPT, "start", "--nodes", str(NODES)], capture_output=True, text=True, timeout=900)
    if started.returncode != 0:
        pytest.fail(f"slurm/local-cluster.sh start failed ({started.returncode}):\n{started.stdout}{started.stderr}")
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root()), saved]))
    yield SCRIPT
    if saved is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = saved
    if not was_running:
        subprocess.run([SCRIPT, "stop"], capture_output=True, timeout=120)
