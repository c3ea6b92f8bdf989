"""slurm/local-cluster.sh on the real local cluster: a cluster started again has no jobs of the one before.

slurmctld recovers the jobs of its saved state. After a machine's session ended (daemons and job processes killed
together) a started cluster held such jobs RUNNING with no process behind them: their nodes stayed allocated and
the next session's jobs pended behind them until their time limits. So ``stop`` cancels the queue before it stops
the daemons, and ``start`` cancels what a controller stopped any other way left.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from afm_core.launch.status import slurm_states
from tests.slurm.tiny_sft import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


def sbatch(*args: str) -> str:
    done = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def start(script: Path) -> str:
    out = subprocess.run([script, "start", "--nodes", "2"], capture_output=True, text=True, timeout=600, check=True)
    assert subprocess.run(["squeue", "-h"], capture_output=True, text=True, check=True).stdout == ""
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, check=True).stdout
    assert set(nodes.split()) == {"idle"}
    return out.stdout


def test_stop_cancels_the_queue_and_start_cancels_what_a_controller_stopped_otherwise_left(slurm_cluster, tmp_path):
    out = str(tmp_path / "%j.out")
    running = sbatch("-N", "2", "-c", "1", "-o", out, "--wrap", "sleep 600")
    queued = sbatch("-c", "1", "--begin=now+3600", "-o", out, "--wrap", "true")
    wait_until(lambda: slurm_states([running]).get(running) == "RUNNING", f"job {running} to start", 60)

    stopped = subprocess.run([slurm_cluster, "stop"], check=True, capture_output=True, text=True, timeout=300)
    assert f"cancelling job(s) still queued or running: {running} {queued}" in stopped.stdout
    assert "cancelling" not in start(slurm_cluster)
    assert slurm_states([running, queued]) == {running: "CANCELLED", queued: "CANCELLED"}

    # the controller alone stopped (SIGTERM: it saves its state), as a session's end stops it
    left = sbatch("-c", "1", "--begin=now+3600", "-o", out, "--wrap", "true")
    state = Path(os.environ.get("AFM_SLURM_STATE", "/var/lib/afm-slurm"))
    pid = int((state / "run" / "slurm" / "slurmctld.pid").read_text())
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), "slurmctld to exit", 60)
    assert f"cancelling job(s) left from the previous controller: {left}" in start(slurm_cluster)
    assert slurm_states([left]) == {left: "CANCELLED"}
