"""The ``env://`` rendezvous variables of one rank, taken from the scheduler (Slurm or submitit's local runner).

:class:`submitit.helpers.TorchDistributedEnvironment` reads the job environment (``SLURM_PROCID``,
``SLURM_LOCALID``, ``SLURM_NTASKS``, ``SLURM_JOB_NODELIST``... or their ``SUBMITIT_LOCAL_*`` twins) and this
module exports them as ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` (the job's
first node) and ``MASTER_PORT``, so one node and many nodes run the same code.
"""

from __future__ import annotations

import socket

import submitit
from submitit.helpers import TorchDistributedEnvironment


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (for a local job's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def export_distributed_env(master_port: int | None = None) -> TorchDistributedEnvironment:
    """Export RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT for this rank.

    Must run inside a submitit job. Values already in the environment are overwritten (a job started from
    another job must not inherit its parent's rendezvous). ``CUDA_VISIBLE_DEVICES`` is left alone: every rank
    sees the node's GPUs and picks ``cuda:LOCAL_RANK``.

    Args:
        master_port: rendezvous port; None: ``$MASTER_PORT`` if set, else a port derived from the job id
            (submitit's rule, identical on every node). Local jobs pass a port picked free at submission and
            rendezvous on 127.0.0.1.
    Returns:
        The exported environment (``rank``, ``world_size``, ``local_rank``, ``master_addr``, ``master_port``).
    """
    env = TorchDistributedEnvironment()
    if master_port is not None:
        env.master_port = master_port
    if submitit.JobEnvironment().cluster == "local":
        env.master_addr = "127.0.0.1"
    return env.export(set_cuda_visible_devices=False, overwrite=True)
