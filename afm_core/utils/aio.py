"""asyncio helpers shared by the jobs that run many coroutines at once (evaluation, distillation)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)


class ToolPoolLike(Protocol):
    """What :func:`run_with_tools` needs of a tool pool (:class:`afm_core.tools.pool.ToolPool` is one): named here
    so that utils, the bottom layer, does not import tools."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def metrics_snapshot(self) -> dict[str, Any]: ...


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


async def run_with_tools(
    work: Callable[[], Awaitable[object]],
    pool: ToolPoolLike | None,
    stop: Callable[[], bool],
    dropped: str,
    close: Sequence[Callable[[], Awaitable[object]]] = (),
) -> dict[str, Any]:
    """Open ``pool``, run ``work()`` until it ends or ``stop()`` turns true, then close everything.

    The run-and-teardown of the jobs that drive many agent loops at once (evaluation, distillation): the tool
    pool's metrics are read before it closes, then the pool and each of ``close`` (graders, engines, teachers)
    are closed in order, also when ``work`` raised or was cancelled by :func:`run_until_stopped`.

    Args:
        work: makes the coroutine to run (called once the pool is open).
        pool: the shared :class:`~afm_core.tools.pool.ToolPool`, or None when no tool runs.
        stop: the preemption flag, polled by :func:`run_until_stopped`.
        dropped: what a stop drops, for its warning.
        close: coroutine functions awaited after the pool closes.

    Returns:
        ``{"seconds": wall seconds of the run, "tool_metrics": ToolPool.metrics_snapshot() or {}}``.

    Raises:
        whatever ``work`` or a ``close`` raised.
    """
    started = time.monotonic()
    try:
        if pool is not None:
            await pool.start()
        await run_until_stopped(work(), stop, dropped)
    finally:
        tool_metrics = pool.metrics_snapshot() if pool is not None else {}
        if pool is not None:
            await pool.close()
        for closer in close:
            await closer()
    return {"seconds": time.monotonic() - started, "tool_metrics": tool_metrics}
