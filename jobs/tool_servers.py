"""Start the tool servers (sandbox, wiki retrieval, offline web search, pages, crawl) and publish their addresses.

    python -m jobs.tool_servers                                    # on this machine, until Ctrl-C / SIGTERM
    python -m jobs.tool_servers serve_for_s=600 servers.crawl=null # a subset, for ten minutes
    python -m jobs.tool_servers cluster=slurm cluster.partition=cpu cluster.cpus_per_task=16 host=0.0.0.0

The servers run as child processes of one supervisor (here, or inside a Slurm job submitted with submitit
beside the training job). Once every server answers ``GET /health``, the supervisor writes the addresses
file (``addresses_file``, atomically; see :mod:`afm_core.tools.addresses`), which trainers and evaluators
read. It removes the file when the servers stop, and stops them all (exit code 1) when one of them dies.
Logs: ``<addresses_file folder>/logs/<server>.log``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import hydra
from omegaconf import DictConfig, OmegaConf

from afm_core.tools.launcher import ServerGroup, start_servers
from afm_core.utils.atomic import atomic_write_json
from afm_core.utils.paths import shared_data_dir

log = logging.getLogger("jobs.tool_servers")


def advertised_url(url: str, host: str) -> str:
    """The URL others should use: a wildcard bind address is replaced by this node's host name."""
    if host not in ("0.0.0.0", "::"):
        return url
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{socket.getfqdn()}:{parts.port}"))


def run_servers(cfg: dict) -> int:
    """Start the configured servers, write the addresses file, serve until stopped; returns the exit code.

    Runs in the foreground (``cluster=local``) or as the body of the Slurm job (``cluster=slurm``).
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    data_dir = Path(cfg["data_dir"]) if cfg.get("data_dir") else shared_data_dir()
    addresses_file = Path(cfg["addresses_file"]).absolute()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    exit_code = 0
    with ServerGroup(cfg["host"], addresses_file.parent / "logs", cfg["startup_timeout_s"]) as group:
        urls = start_servers(group, cfg["servers"], data_dir)
        servers = {name: advertised_url(url, cfg["host"]) for name, url in urls.items()}
        atomic_write_json(
            addresses_file,
            {
                "servers": servers,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started_at": time.time(),
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            },
        )
        log.info("tool servers up: %s (addresses in %s)", servers, addresses_file)
        print(f"addresses: {addresses_file}", flush=True)
        deadline = time.monotonic() + cfg["serve_for_s"] if cfg.get("serve_for_s") else None
        try:
            while not stop.wait(0.5):
                if deadline is not None and time.monotonic() >= deadline:
                    break
                dead = group.dead()
                if dead:
                    log.error("server(s) %s died; stopping all:\n%s", dead, group.log_tail(dead[0]))
                    exit_code = 1
                    break
        finally:
            addresses_file.unlink(missing_ok=True)
    log.info("tool servers stopped")
    return exit_code


def submit_to_slurm(cfg: DictConfig, plain: dict) -> None:
    """Submit :func:`run_servers` as a one-task Slurm job and wait until it has written the addresses file.

    The sbatch options come from the ``cluster`` group through :func:`afm_core.launch.executor.make_executor`
    (one node, one task, no GPUs: the servers are CPU services).
    """
    from afm_core.launch.executor import make_executor  # imports submitit: the Slurm path only

    addresses_file = Path(cfg.addresses_file).absolute()
    addresses_file.unlink(missing_ok=True)  # a stale file from an earlier job must not be mistaken for this one
    cluster = {**OmegaConf.to_container(cfg.cluster, resolve=True), "nodes": 1, "tasks_per_node": 1, "gpus_per_node": 0}
    executor = make_executor(cluster, {}, addresses_file.parent / "slurm" / "%j", "afm-tool-servers")
    job = executor.submit(run_servers, plain)
    print(f"submitted tool servers as Slurm job {job.job_id}; waiting for {addresses_file}", flush=True)
    deadline = time.monotonic() + cfg.startup_timeout_s * len(plain["servers"]) + 600  # + time in the queue
    while not addresses_file.exists():
        if job.done():
            raise RuntimeError(f"Slurm job {job.job_id} ended before the servers were up:\n{job.stderr() or ''}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"Slurm job {job.job_id}: no addresses file in time; logs in {executor.folder}")
        time.sleep(2)
    print(addresses_file.read_text(), flush=True)
    if cluster.get("wait"):
        job.result()


@hydra.main(version_base=None, config_path="../conf", config_name="tool_servers")
def main(cfg: DictConfig) -> None:
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("cluster")
    plain["servers"] = {k: v for k, v in plain["servers"].items() if v is not None}
    if cfg.cluster.name == "slurm":
        submit_to_slurm(cfg, plain)
    else:
        code = run_servers(plain)
        if code:
            raise SystemExit(code)


if __name__ == "__main__":
    main()
