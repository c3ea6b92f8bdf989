"""The run-and-teardown shared by evaluation and distillation (afm_core.utils.aio), on a real ToolPool."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from afm_core.tools.pool import ToolPool
from afm_core.utils.aio import run_until_stopped, run_with_tools


def test_run_until_stopped_cancels_work_when_the_flag_turns() -> None:
    flag = {"stop": False}

    async def work() -> None:
        flag["stop"] = True
        await asyncio.sleep(30)

    assert asyncio.run(run_until_stopped(work(), lambda: flag["stop"], "the work", poll_s=0.01)) is True


def test_run_with_tools_closes_everything_in_order_also_when_work_raises() -> None:
    closed: list[str] = []
    pool = ToolPool([])

    def closer(name: str) -> Callable[[], Awaitable[None]]:
        async def close() -> None:
            closed.append(name)

        return close

    async def fails() -> None:
        assert pool._session is not None  # the pool is open while the work runs
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(run_with_tools(fails, pool, lambda: False, "x", close=(closer("graders"), closer("engine"))))
    assert closed == ["graders", "engine"]
    assert pool._session is None

    async def fine() -> None:
        await asyncio.sleep(0)

    result = asyncio.run(run_with_tools(fine, None, lambda: False, "x", close=(closer("engine"),)))
    assert result["tool_metrics"] == {} and result["seconds"] >= 0
    assert closed == ["graders", "engine", "engine"]
