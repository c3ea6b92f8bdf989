"""Suite-wide settings.

``make test`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``). Tests marked ``slurm`` share
one local Slurm cluster (started once per worker session by tests/slurm/conftest.py) and size their jobs to its
CPUs, so they all go to one worker, in collection order; they are also collected first, so that their ~20 minutes
of jobs, requeues and preemptions start at once beside the rest of the suite instead of after it.

The tests of a module that share a module-scoped fixture (an RL run, a DeepSpeed run, an engine) form one group
too: xdist runs a module fixture once per worker that gets one of its tests, so a module split over both workers
paid for its run twice (two ~100 s setups of tests/rl/test_rl_job_ux.py's resumed run in one full run).
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the group marks into node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
    items.sort(key=lambda item: item.get_closest_marker("slurm") is None)  # stable: order kept within each part


def uses_module_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` requests (directly or through other fixtures) a fixture of module or class scope."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs and defs[-1].scope in ("module", "class") for defs in info.name2fixturedefs.values())
