"""The ``env://`` rendezvous variables of one rank, taken from the scheduler (Slurm or submitit's local runner).

:class:`submitit.helpers.TorchDistributedEnvironment` reads the job environment (``SLURM_PROCID``,
``SLURM_LOCALID``, ``SLURM_NTASKS``, ``SLURM_JOB_NODELIST``... or their ``SUBMITIT_LOCAL_*`` twins) and this
module exports them as ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` (the job's
first node) and ``MASTER_PORT``, so one node and many nodes run the same code. Those a submitter inherited (a
notebook or an ``srun`` step that ran torch.distributed, a torchrun worker) stay out of the jobs it submits
(:func:`without_rendezvous_env`). It also sizes the collective timeout of a job (:func:`collective_timeout_min`)
from the longest a rank waits for another at a collective.
"""

from __future__ import annotations

import errno
import math
import os
import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import submitit
from submitit.helpers import TorchDistributedEnvironment

LOCAL_PORTS = (25000, 32767)  # above slurm_rendezvous_port's 15000-24999, below Linux's default ephemeral range


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` for a local job's rendezvous (or a local server), free now and kept from other takers
    until the job binds it.

    Picking a free port and binding it later races: in between, the port can go to an outgoing connection or to
    another picker (seen as ``TCPStore`` failing with EADDRINUSE on a busy machine). Two measures close it:

    - The port is drawn from :data:`LOCAL_PORTS`, below the kernel's ephemeral range
      (``/proc/sys/net/ipv4/ip_local_port_range``, Linux default 32768-60999), so no outgoing connection and no
      ``bind(port=0)`` is handed it, however long the job takes to start (the reason for
      :func:`slurm_rendezvous_port`'s range too). Where the ephemeral range starts lower, the kernel picks.
    - It is left in TIME_WAIT (a connection to it whose accepted side closes first), Yelp's
      ``ephemeral_port_reserve.reserve``: for the next 60 s a bind without ``SO_REUSEADDR`` -- this function's own
      probe, so a concurrent call -- fails on it, while ``TCPStore``, uvicorn and aiohttp, which set
      ``SO_REUSEADDR``, bind it.

    Raises:
        OSError: no free port in 200 draws.
    """
    low, high = LOCAL_PORTS
    high = min(high, _ephemeral_low() - 1)
    draws = random.SystemRandom()
    for _ in range(200):
        port = draws.randint(low, high) if low <= high else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            try:
                listener.bind((host, port))  # no SO_REUSEADDR yet: fails on a port in use or in TIME_WAIT
            except OSError as err:
                if err.errno == errno.EADDRINUSE and port:
                    continue
                raise
            # set before the connection so the TIME_WAIT socket it leaves lets SO_REUSEADDR binds through
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.listen(1)
            port = listener.getsockname()[1]
            with socket.create_connection((host, port)):
                accepted, _ = listener.accept()
                accepted.close()  # the server side closes first: it is the one left in TIME_WAIT
            return port
    raise OSError(errno.EADDRINUSE, f"no free TCP port on {host} in {low}-{high} after 200 draws")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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


DEFAULT_COLLECTIVE_TIMEOUT_MIN = 30  # torch.distributed's default for NCCL (and megatron's distributed_timeout_minutes)


def collective_timeout_min(longest_wait_s: float | None = None) -> int:
    """The collective timeout (minutes) for a job whose ranks can wait ``longest_wait_s`` seconds at a collective
    while another rank works alone (an RL rank whose trajectories finished waits at the gather for the slowest
    one, up to ``rollout.timeout_s`` per wave of trajectories): twice that plus 10 minutes, never below
    :data:`DEFAULT_COLLECTIVE_TIMEOUT_MIN`."""
    if not longest_wait_s:
        return DEFAULT_COLLECTIVE_TIMEOUT_MIN
    return max(DEFAULT_COLLECTIVE_TIMEOUT_MIN, math.ceil(2 * longest_wait_s / 60) + 10)


def rollout_wait_s(rollout: Any, gen_batch_size: int) -> float:
    """The longest a rank can spend in one generation call: ``rollout.timeout_s`` per wave of at most
    ``rollout.concurrency`` trajectories, over the ``gen_batch_size * rollout.n`` trajectories of a generation batch
    (an upper bound: the batch is split over the engines)."""
    waves = math.ceil(int(gen_batch_size) * int(rollout["n"]) / max(1, int(rollout["concurrency"])))
    return float(rollout["timeout_s"]) * max(1, waves)
