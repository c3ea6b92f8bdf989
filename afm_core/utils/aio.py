"""asyncio helpers shared by the jobs that run many coroutines at once (evaluation, distillation)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


async def run_until_stopped(
    work: Awaitable[object], stop: Callable[[], bool], dropped: str, poll_s: float = 0.5
) -> bool:
    """Await ``work``, cancelling it as soon as ``stop()`` turns true (a preemption flag set by a signal handler).

    Args:
        work: the coroutine (e.g. a ``gather`` of every sample).
        stop: polled every ``poll_s`` seconds.
        dropped: what the cancellation drops, for the warning (``"the samples in flight"``).

    Returns:
        True when ``work`` was cancelled, False when it finished.

    Raises:
        whatever ``work`` raised.
    """
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=poll_s)
        if stop() and not task.done():
            log.warning("stop requested: dropping %s (they are redone on resume)", dropped)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return True
    task.result()
    return False
