"""Suite-wide settings.

``make test`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``). Tests marked ``slurm`` share
one local Slurm cluster (started once per worker session by tests/slurm/conftest.py) and size their jobs to its
CPUs, so they all go to one worker, in collection order; they are also collected first, so that their ~20 minutes
of jobs, requeues and preemptions start at once beside the rest of the suite instead of after it.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the group marks into node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.xdist_group("slurm"))
    items.sort(key=lambda item: item.get_closest_marker("slurm") is None)  # stable: order kept within each part
