"""The ``env://`` rendezvous variables of one rank, taken from the scheduler (Slurm or submitit's local runner).

:class:`submitit.helpers.TorchDistributedEnvironment` reads the job environment (``SLURM_PROCID``,
``SLURM_LOCALID``, ``SLURM_NTASKS``, ``SLURM_JOB_NODELIST``... or their ``SUBMITIT_LOCAL_*`` twins) and this
module exports them as ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` (the job's
first node) and ``MASTER_PORT``, so one node and many nodes run the same code. Those a submitter inherited (a
notebook or an ``srun`` step that ran torch.distributed, a torchrun worker) stay out of the jobs it submits
(:func:`without_rendezvous_env`). A local job's rendezvous port comes from :func:`afm_core.utils.ports.free_port`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import submitit
from submitit.helpers import TorchDistributedEnvironment

#: The rendezvous variables of a process started for torch.distributed: the ``env://`` ones and the rest of a torchrun
#: worker's (pytorch/pytorch, ``torch/distributed/elastic/agent/server/local_elastic_agent.py``, ``_start_workers``),
#: plus every ``TORCHELASTIC_*`` (:data:`RENDEZVOUS_PREFIXES`).
RENDEZVOUS_VARS = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
)  # fmt: skip
RENDEZVOUS_PREFIXES = ("TORCHELASTIC_",)  # TORCHELASTIC_USE_AGENT_STORE=True: every rank a store client, none a server


def rendezvous_vars(environ: Any = None) -> list[str]:
    """The names of :data:`RENDEZVOUS_VARS` and ``TORCHELASTIC_*`` variables set in ``environ`` (default: ours)."""
    names = os.environ if environ is None else environ
    return sorted(n for n in names if n in RENDEZVOUS_VARS or n.startswith(RENDEZVOUS_PREFIXES))


@contextmanager
def without_rendezvous_env() -> Iterator[dict[str, str]]:
    """Hide this process's rendezvous variables (:func:`rendezvous_vars`) while a job is submitted; yields those
    hidden, puts them back after.

    ``sbatch`` exports the submitter's environment to the job (``--export=ALL``, its default) and submitit's local
    controller copies it to the ranks (``submitit/local/local.py``, ``start_controller``), so values left by a
    notebook or an ``srun`` step that ran torch.distributed would reach the ranks: a stale ``MASTER_PORT`` would
    replace the job's own (:func:`export_distributed_env` keeps a ``MASTER_PORT`` it finds), a stale
    ``TORCHELASTIC_USE_AGENT_STORE=True`` would leave the job without a store server. Everything else, the user's
    ``SBATCH_*`` defaults among it, is passed on as before.
    """
    hidden = {name: os.environ.pop(name) for name in rendezvous_vars()}
    try:
        yield hidden
    finally:
        os.environ.update(hidden)


def export_distributed_env(master_port: int | None = None) -> TorchDistributedEnvironment:
    """Export RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT for this rank.

    Must run inside a submitit job. Values already in the environment are overwritten (a job started from
    another job must not inherit its parent's rendezvous). ``CUDA_VISIBLE_DEVICES`` is left alone: every rank
    sees the node's GPUs and picks ``cuda:LOCAL_RANK``.

    Args:
        master_port: rendezvous port; None: ``$MASTER_PORT`` if set, else :func:`slurm_rendezvous_port` of
            ``$SLURM_JOB_ID`` (identical on every node of the job), else submitit's rule. Local jobs pass a port
            picked free at submission and rendezvous on 127.0.0.1.
    Returns:
        The exported environment (``rank``, ``world_size``, ``local_rank``, ``master_addr``, ``master_port``).
    """
    env = TorchDistributedEnvironment()
    if master_port is None and "MASTER_PORT" not in os.environ and os.environ.get("SLURM_JOB_ID", "").isdigit():
        master_port = slurm_rendezvous_port(int(os.environ["SLURM_JOB_ID"]))
    if master_port is not None:
        env.master_port = master_port
    if submitit.JobEnvironment().cluster == "local":
        env.master_addr = "127.0.0.1"
    return env.export(set_cuda_visible_devices=False, overwrite=True)


def slurm_rendezvous_port(job_id: int) -> int:
    """The rendezvous port of Slurm job ``job_id`` (``SLURM_JOB_ID``: one per array task): ``15000 + job_id %
    10000``, Lightning's rule (Lightning-AI/pytorch-lightning, ``src/lightning/fabric/plugins/environments/
    slurm.py``, ``main_port``). Below the kernel's ephemeral range (Linux: 32768-60999), so no outgoing connection
    on the first node holds it; submitit's rule (a seeded draw in 20000-60000) lands in that range 70% of the time,
    where a busy node's client sockets made ``TCPStore`` fail with EADDRINUSE. Consecutive job ids, as the tasks
    of an array sharing a node, get different ports."""
    return 15000 + int(job_id) % 10000
