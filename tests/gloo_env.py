"""The torch.distributed environment of one rank of a local gloo world (what a launcher exports)."""

from __future__ import annotations

import os

import pytest


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT of ``rank``."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip


def set_rank_env(rank: int, world: int, port: int) -> None:
    """Export :func:`rank_env` in a spawned rank process (it ends with the process)."""
    os.environ.update(rank_env(rank, world, port))


def set_rank_env_for_test(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """A one-rank world in the pytest process itself, undone after the test: a later test (or a Slurm job,
    which sbatch gives the submitter's environment) must not inherit a stale MASTER_PORT or RANK."""
    for key, value in rank_env(0, 1, port).items():
        monkeypatch.setenv(key, value)
