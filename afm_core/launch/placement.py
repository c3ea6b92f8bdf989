"""Where the ranks of a job run: the rank → node map, the rendezvous address and the world size, at each start.

On Slurm the map follows from the step's environment: the node list (``SLURM_STEP_NODELIST``, else
``SLURM_JOB_NODELIST``, expanded by submitit), the tasks on each node (``SLURM_STEP_TASKS_PER_NODE``, else
``SLURM_TASKS_PER_NODE``, e.g. ``8(x4)`` or ``3,1``) and the distribution (``SLURM_STEP_DISTRIBUTION`` /
``SLURM_DISTRIBUTION``): *block* (Slurm's default, and submitit's ``srun``) fills node 1 with ranks
``0..n1-1``, then node 2; *cyclic* deals ranks round-robin (``srun --distribution``, Slurm docs). Every rank
checks its own entry against the node it runs on (``SLURMD_NODENAME``) and warns in its log if they disagree.
On this machine (submitit's local runner) every rank is on this host.

Printed at every start (rank 0: the whole map; every rank: its own line) and recorded by rank 0 in
``RUN_DIR/logs/job.json`` under ``start`` (:mod:`afm_core.launch.records`).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import submitit
from submitit.slurm.slurm import (
    _parse_node_list,  # what submitit's SlurmJobEnvironment.hostnames uses
)

from afm_core.utils.hardware import this_node

_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_tasks_per_node(value: str) -> list[int]:
    """Slurm's compressed task counts (``"8(x4)"``, ``"3,1"``, ``"2(x2),1"``) as one count per node.

    Raises:
        ValueError: not in that form.
    """
    counts: list[int] = []
    for part in value.split(","):
        match = _TASKS.match(part.strip())
        if not match:
            raise ValueError(f"SLURM_TASKS_PER_NODE={value!r}: expected counts like '8(x4)' or '3,1'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def rank_nodes(nodes: list[str], tasks_per_node: list[int], distribution: str = "block") -> list[str]:
    """The node of each rank (index = rank) for Slurm's ``block`` or ``cyclic`` task distribution.

    Raises:
        ValueError: the node and task-count lists differ in length.
    """
    if len(nodes) != len(tasks_per_node):
        raise ValueError(f"{len(nodes)} nodes {nodes} but {len(tasks_per_node)} task counts {tasks_per_node}")
    if distribution.split(":")[0] != "cyclic":
        return [node for node, count in zip(nodes, tasks_per_node) for _ in range(count)]
    left, placed = list(tasks_per_node), []
    while any(left):
        for i, node in enumerate(nodes):
            if left[i]:
                placed.append(node)
                left[i] -= 1
    return placed


def compress_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"``."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def job_placement(world_size: int, master_addr: str, master_port: int) -> dict[str, Any]:
    """The placement of the current submitit job (call inside the job, after the rendezvous env is exported).

    Returns:
        ``{"job_id", "time" (unix s), "world_size", "master_addr", "master_port", "nodelist" (Slurm's compressed
        form, or the host name), "nodes" (one name per node, in node order), "ranks" ({node: [rank, ...]})}``.
    """
    env = submitit.JobEnvironment()
    if env.cluster == "slurm":
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
        nodes = _parse_node_list(nodelist)  # the step's nodes: fewer than the job's with srun -N
        counts = parse_tasks_per_node(
            os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE", str(world_size))
        )
        distribution = os.environ.get("SLURM_STEP_DISTRIBUTION") or os.environ.get("SLURM_DISTRIBUTION", "block")
        per_rank = rank_nodes(nodes, counts, distribution)
    else:
        nodelist = this_node()
        nodes, per_rank = [nodelist], [nodelist] * world_size
    return {
        "job_id": env.job_id,
        "time": time.time(),
        "world_size": world_size,
        "master_addr": master_addr,
        "master_port": master_port,
        "nodelist": nodelist,
        "nodes": nodes,
        "ranks": {node: [r for r, n in enumerate(per_rank) if n == node] for node in nodes},
    }


def describe(placement: dict[str, Any]) -> list[str]:
    """Log lines for rank 0: the rendezvous and world size, then one line per node with its ranks."""
    nodes = placement["nodes"]
    lines = [
        (
            f"[afm] job {placement['job_id']}: world size {placement['world_size']} on {len(nodes)} node(s) "
            f"{placement['nodelist']}; MASTER_ADDR={placement['master_addr']} "
            f"MASTER_PORT={placement['master_port']}"
        )
    ]
    lines += [f"[afm]   {node}: rank(s) {compress_ranks(placement['ranks'][node])}" for node in nodes]
    return lines


def check_own_rank(placement: dict[str, Any], rank: int, local_rank: int) -> str:
    """This rank's log line; a warning instead when the map puts it on another node than the one it runs on."""
    node = this_node()
    planned = next((n for n, ranks in placement["ranks"].items() if rank in ranks), None)
    if planned not in (None, node):
        return (
            f"[afm] warning: rank {rank} runs on {node}, but the placement from Slurm's task layout puts it on "
            f"{planned} (job.json's map is wrong for this job)"
        )
    return f"[afm] rank {rank}/{placement['world_size']} on {node} (local rank {local_rank})"
