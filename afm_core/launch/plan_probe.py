"""How fast a node writes a checkpoint to the run dir's file system, for the plan's lead-time check: configured,
read from the run's own latest checkpoint, or measured by writing and fsyncing a probe file.

The probe is the one part of ``jobs.plan`` that writes to a disk (a temporary file in the run dir's nearest
existing folder, removed after); the estimates (:mod:`afm_core.launch.plan_estimates`) take its result as a number.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from afm_core.engine.checkpoint_dirs import measured_write_speed

#: MiB the probe writes at most (less for a smaller checkpoint).
WRITE_PROBE_MIB = 256


def write_speed(
    checkpoint_bytes: int, run_dir: str | Path, configured: float | None = None, probe_mib: int = WRITE_PROBE_MIB
) -> tuple[float, str]:
    """GB/s one node writes to the run dir's file system, and where the figure comes from: ``configured``
    (``cluster.checkpoint_write_gb_s``) when set ("configured"); else the run's own latest checkpoint when
    ``run_dir`` has one (a resubmitted or requeued run: :func:`afm_core.engine.checkpoint_dirs.measured_write_speed`);
    else a probe (:func:`probe_write_speed`) of ``min(probe_mib, checkpoint size)`` MiB into ``run_dir``'s nearest
    existing folder. The probe writes from one process of the submitting node; a node's ranks write in parallel,
    so on a parallel file system it is a lower bound (the lead it asks for errs long)."""
    if configured:
        return float(configured), "configured"
    run_dir = Path(run_dir)
    measured = measured_write_speed(run_dir / "checkpoints")
    if measured is not None:
        return measured["gb_s_per_node"], f"measured by this run's {measured['checkpoint']}"
    size_mib = max(1, min(probe_mib, checkpoint_bytes // 2**20))
    directory = _nearest_existing(run_dir)
    return probe_write_speed(directory, size_mib), f"measured: {size_mib} MiB written and fsynced to {directory}"


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.is_dir():
        path = path.parent
    return path


def probe_write_speed(directory: str | Path, size_mib: int, block_mib: int = 8) -> float:
    """GB/s (1e9 bytes) of writing ``size_mib`` MiB of random bytes (incompressible) to a temporary file in
    ``directory`` and fsyncing it, as a checkpoint is written (:func:`afm_core.utils.atomic.atomic_path`); the file is
    removed. Raises ``OSError`` when ``directory`` is not writable or full."""
    block = os.urandom(min(size_mib, block_mib) * 2**20)
    left = size_mib * 2**20
    fd, name = tempfile.mkstemp(prefix=".afm-write-probe-", dir=directory)
    try:
        start = time.perf_counter()
        while left > 0:
            left -= os.write(fd, block[: min(left, len(block))])
        os.fsync(fd)
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(name)
    return size_mib * 2**20 / max(seconds, 1e-6) / 1e9
