"""The collective timeout of a job, sized from the longest a rank waits for another at a collective.

Read by the RL schema's check (:class:`afm_core.config.rl.RLConfig`), by ``jobs.rl`` (which sets
``parallel.collective_timeout_min`` when the config leaves it null) and by the process-group setup
(:func:`afm_core.engine.distributed.init_distributed`, its default).
"""

from __future__ import annotations

import math
from typing import Any

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
