"""slurm/local-cluster.sh on the real local cluster: a restarted controller does not bring back a stopped one's jobs.

slurmctld recovers the jobs of its saved state. After a machine's session ends (daemons and job processes killed
together) a restarted cluster held such jobs RUNNING with no process behind them: their nodes stayed allocated
and the next session's jobs pended behind them until their time limits. ``start`` cancels what it recovers.
"""

from __future__ import annotations

import subprocess

import pytest

from afm_core.launch.status import slurm_states
from tests.slurm.tiny_sft import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


def sbatch(*args: str) -> str:
    done = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_a_restarted_cluster_cancels_the_jobs_its_stopped_controller_had_queued_or_running(slurm_cluster, tmp_path):
    out = str(tmp_path / "%j.out")
    running = sbatch("-N", "2", "-c", "1", "-o", out, "--wrap", "sleep 600")
    queued = sbatch("-c", "1", "--begin=now+3600", "-o", out, "--wrap", "true")
    wait_until(lambda: slurm_states([running]).get(running) == "RUNNING", f"job {running} to start", 60)

    subprocess.run([slurm_cluster, "stop"], check=True, capture_output=True, text=True, timeout=120)
    started = subprocess.run(
        [slurm_cluster, "start", "--nodes", "2"], capture_output=True, text=True, timeout=300, check=True
    )

    assert f"cancelling job(s) left from the previous controller: {running} {queued}" in started.stdout
    assert subprocess.run(["squeue", "-h"], capture_output=True, text=True, check=True).stdout == ""
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, check=True).stdout
    assert set(nodes.split()) == {"idle"}
    assert slurm_states([running, queued]) == {running: "CANCELLED", queued: "CANCELLED"}
