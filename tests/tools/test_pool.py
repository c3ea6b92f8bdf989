"""ToolPool against real local servers, including ones that misbehave (acceptance c), plus cache, duplicate
guard, rate/concurrency/connection limits and metrics."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from afm_core.tools import ToolCache, ToolLimits, ToolPool, WikiSearchTool
from afm_core.tools.base import Tool, ToolError
from afm_core.tools.wiki_search import REPEATED_SEARCH
from afm_core.utils.ports import free_port
from tests.tools.conftest import serve_app

GOOD = {"result": [[{"document": {"id": "1", "title": "T", "contents": '"T"\nbody text'}, "score": 1.0}]]}
FAST_RETRY = {"timeout_s": 0.5, "retries": 2, "backoff_s": 0.01, "backoff_max_s": 0.05}


class Backend:
    """A /retrieve server whose behaviour is chosen per test; counts requests and concurrency."""

    def __init__(self, mode: str = "ok", fail_first: int = 0, delay_s: float = 0.0) -> None:
        self.mode, self.fail_first, self.delay_s = mode, fail_first, delay_s
        self.hits = 0
        self.in_flight = self.max_in_flight = 0

    def app(self) -> web.Application:
        async def retrieve(request: web.Request) -> web.StreamResponse:
            self.hits += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.delay_s)
                mode = self.mode if self.hits <= self.fail_first or not self.fail_first else "ok"
                if mode == "slow":
                    await asyncio.sleep(1.5)
                if mode == "http_500":
                    return web.Response(status=500, text="internal error")
                if mode == "http_404":
                    return web.Response(status=404, text="no such route")
                if mode in ("http_429", "http_503"):
                    status = 429 if mode == "http_429" else 503
                    return web.Response(status=status, text="slow down", headers={"Retry-After": "1"})
                if mode == "bad_json":
                    return web.Response(text='{"result": [[{"document": ', content_type="application/json")
                if mode == "wrong_shape":
                    return web.json_response({"answer": 42})
                return web.json_response(GOOD)
            finally:
                self.in_flight -= 1

        app = web.Application()
        app.router.add_post("/retrieve", retrieve)
        return app


async def one_call(url: str, limits: ToolLimits, content: str = "query") -> tuple[str, ToolPool]:
    async with ToolPool([WikiSearchTool(url)], {"wiki_search": limits}) as pool:
        return await pool.call("wiki_search", content, "traj-1"), pool


@pytest.mark.parametrize(
    "mode, kind",
    [("slow", "timeout"), ("http_500", "http_5xx"), ("bad_json", "bad_json")],
)
def test_faults_give_error_observations_after_the_configured_retries(mode, kind):
    async def main():
        backend = Backend(mode)
        async with serve_app(backend.app()) as url:
            observation, pool = await one_call(url, ToolLimits(**FAST_RETRY))
        return observation, pool, backend

    observation, pool, backend = asyncio.run(main())
    assert observation.startswith(f"[wiki_search error: {kind}]") and "(3 attempts)" in observation
    assert backend.hits == 3  # 1 + retries
    m = pool.metrics["wiki_search"]
    assert m.calls == 1 and m.ok == 0 and dict(m.errors) == {kind: 1} and m.retries == 2
    assert m.latency.count == 1


def test_retries_leave_the_process_wide_random_state_alone():
    """The trainer seeds and checkpoints ``random``'s state; a retry's backoff jitter must not draw from it, or a
    resumed RL run's RNG state depends on how many tool calls were retried (the machine's load)."""
    import random

    async def main():
        backend = Backend("http_500")
        async with serve_app(backend.app()) as url:
            random.seed(1234)
            before = random.getstate()
            observation, _ = await one_call(url, ToolLimits(**FAST_RETRY))
            return observation, before, random.getstate(), backend.hits

    observation, before, after, hits = asyncio.run(main())
    assert hits == 3 and "(3 attempts)" in observation  # two backoff waits
    assert after == before


def test_server_down():
    url = f"http://127.0.0.1:{free_port()}"
    observation, pool = asyncio.run(one_call(url, ToolLimits(**FAST_RETRY)))
    assert observation.startswith("[wiki_search error: connect]") and "(3 attempts)" in observation
    m = pool.metrics["wiki_search"]
    assert dict(m.errors) == {"connect": 1} and m.retries == 2


def test_4xx_and_wrong_shape_are_not_retried():
    async def main():
        results = []
        for mode in ("http_404", "wrong_shape"):
            backend = Backend(mode)
            async with serve_app(backend.app()) as url:
                observation, pool = await one_call(url, ToolLimits(**FAST_RETRY))
            results.append((observation, pool.metrics["wiki_search"], backend.hits))
        return results

    (obs_404, m_404, hits_404), (obs_shape, m_shape, hits_shape) = asyncio.run(main())
    assert obs_404.startswith("[wiki_search error: http_4xx]") and hits_404 == 1 and m_404.retries == 0
    assert obs_shape.startswith("[wiki_search error: bad_response]") and hits_shape == 1
    assert dict(m_shape.errors) == {"bad_response": 1}


def test_recovers_when_a_retry_succeeds():
    async def main():
        backend = Backend("http_500", fail_first=2)
        async with serve_app(backend.app()) as url:
            observation, pool = await one_call(url, ToolLimits(**FAST_RETRY))
        return observation, pool.metrics["wiki_search"]

    observation, m = asyncio.run(main())
    assert observation == 'Doc 1 (Title: "T")\nbody text'
    assert m.ok == 1 and m.retries == 2 and not m.errors


def test_no_exception_escapes_the_pool():
    class Broken(Tool):
        name = "broken"

        def parse(self, content):
            return content

        async def call(self, args, http, context):
            raise KeyError("a bug in the tool")

    async def main():
        async with ToolPool(
            [Broken(), WikiSearchTool("http://127.0.0.1:9")], default_limits=ToolLimits(**FAST_RETRY)
        ) as pool:
            return await asyncio.gather(
                pool.call("broken", "x"),
                pool.call("nope", "x"),
                pool.call("wiki_search", "   "),
            ), pool

    (bug, unknown, empty), pool = asyncio.run(main())
    assert bug.startswith("[broken error: bad_response] KeyError")
    assert unknown.startswith("[nope error: bad_input] unknown tool")
    assert empty.startswith("[wiki_search error: bad_input] empty wiki_search query")
    assert pool.metrics["broken"].errors["bad_response"] == 1
    assert pool.metrics["wiki_search"].errors["bad_input"] == 1


def test_cache_in_memory_on_disk_and_ttl(tmp_path):
    async def main():
        backend = Backend("ok")
        async with serve_app(backend.app()) as url:
            limits = {"wiki_search": ToolLimits(cache_ttl_s=60)}
            async with ToolPool([WikiSearchTool(url)], limits, cache=ToolCache(tmp_path / "cache.sqlite")) as pool:
                first = await pool.call("wiki_search", "q1")
                again = await pool.call("wiki_search", "  q1 ")  # same query after whitespace normalisation
                hits_after_first_pool = backend.hits
                cache_hits = pool.metrics["wiki_search"].cache_hits
            async with ToolPool([WikiSearchTool(url)], limits, cache=ToolCache(tmp_path / "cache.sqlite")) as pool2:
                from_disk = await pool2.call("wiki_search", "q1")
                disk_hits = pool2.metrics["wiki_search"].cache_hits
            short = {"wiki_search": ToolLimits(cache_ttl_s=0.2)}
            async with ToolPool([WikiSearchTool(url)], short, cache=ToolCache()) as pool3:
                await pool3.call("wiki_search", "q2")
                await asyncio.sleep(0.3)
                await pool3.call("wiki_search", "q2")
                expired_hits = pool3.metrics["wiki_search"].cache_hits
        return first, again, from_disk, hits_after_first_pool, cache_hits, disk_hits, expired_hits, backend.hits

    first, again, from_disk, hits1, cache_hits, disk_hits, expired_hits, total = asyncio.run(main())
    assert first == again == from_disk
    assert hits1 == 1 and cache_hits == 1 and disk_hits == 1
    assert expired_hits == 0 and total == 3  # q1 once, q2 twice (expired)


def test_errors_are_not_cached():
    async def main():
        backend = Backend("http_500", fail_first=3)
        async with serve_app(backend.app()) as url:
            async with ToolPool(
                [WikiSearchTool(url)], {"wiki_search": ToolLimits(**FAST_RETRY)}, cache=ToolCache()
            ) as pool:
                failed = await pool.call("wiki_search", "q")
                ok = await pool.call("wiki_search", "q")
        return failed, ok

    failed, ok = asyncio.run(main())
    assert failed.startswith("[wiki_search error: http_5xx]") and ok.startswith("Doc 1")


def test_duplicate_guard_per_trajectory():
    async def main():
        backend = Backend("http_500", fail_first=3)
        async with serve_app(backend.app()) as url:
            async with ToolPool([WikiSearchTool(url)], {"wiki_search": ToolLimits(**FAST_RETRY)}) as pool:
                failed = await pool.call("wiki_search", "q", "t1")
                first = await pool.call("wiki_search", "q", "t1")  # a failed call may be repeated
                repeat = await pool.call("wiki_search", "q", "t1")
                other_trajectory = await pool.call("wiki_search", "q", "t2")
                pool.end_trajectory("t1")
                after_end = await pool.call("wiki_search", "q", "t1")
                no_guard = await pool.call("wiki_search", "q")
                return (
                    failed,
                    first,
                    repeat,
                    other_trajectory,
                    after_end,
                    no_guard,
                    pool.metrics["wiki_search"].duplicates,
                )

    failed, first, repeat, other, after_end, no_guard, duplicates = asyncio.run(main())
    assert failed.startswith("[wiki_search error")
    assert first.startswith("Doc 1") and repeat == REPEATED_SEARCH
    assert other.startswith("Doc 1") and after_end.startswith("Doc 1") and no_guard.startswith("Doc 1")
    assert duplicates == 1


def test_concurrency_rate_and_connection_limits():
    async def main():
        backend = Backend("ok", delay_s=0.1)
        async with serve_app(backend.app()) as url:
            limits = {"wiki_search": ToolLimits(concurrency=3, cache_ttl_s=None)}
            async with ToolPool([WikiSearchTool(url)], limits) as pool:
                await pool.call_many([("wiki_search", f"q{i}") for i in range(12)])
            concurrency_peak = backend.max_in_flight
            backend.max_in_flight = 0
            async with ToolPool([WikiSearchTool(url)], connection_limit_per_host=2) as pool:
                await pool.call_many([("wiki_search", f"c{i}") for i in range(8)])
            connection_peak = backend.max_in_flight
            backend.delay_s = 0
            rate = {"wiki_search": ToolLimits(rate_per_s=20, burst=1, cache_ttl_s=None)}
            async with ToolPool([WikiSearchTool(url)], rate) as pool:
                start = time.monotonic()
                results = await pool.call_many([("wiki_search", f"r{i}") for i in range(11)])
                elapsed = time.monotonic() - start
        return concurrency_peak, connection_peak, elapsed, results

    concurrency_peak, connection_peak, elapsed, results = asyncio.run(main())
    assert concurrency_peak == 3
    assert connection_peak == 2
    assert elapsed >= 0.45 and all(r.startswith("Doc 1") for r in results)  # 10 waits of 1/20 s


def test_limits_are_validated():
    with pytest.raises(ValueError, match="timeout_s"):
        ToolLimits(timeout_s=0)
    with pytest.raises(ValueError, match="unknown tools"):
        ToolPool([WikiSearchTool("http://x")], {"web_search": ToolLimits()})
    with pytest.raises(ValueError, match="unknown tool error kind"):
        ToolError("boom", "x")


def test_metrics_snapshot_is_plain_json():
    import json

    async def main():
        backend = Backend("ok")
        async with serve_app(backend.app()) as url:
            async with ToolPool([WikiSearchTool(url)]) as pool:
                await pool.call_many([("wiki_search", "a"), ("wiki_search", "b")])
                return pool.metrics_snapshot()

    snapshot = json.loads(json.dumps(asyncio.run(main())))
    w = snapshot["wiki_search"]
    assert w["calls"] == 2 and w["ok"] == 2 and w["latency"]["count"] == 2
    assert w["latency"]["buckets_le_s"]["+Inf"] == 2 and w["latency"]["p50_le_s"] <= 0.25


@pytest.mark.parametrize("mode, kind", [("http_429", "rate_limited"), ("http_503", "http_5xx")])
def test_429_and_503_are_retried_after_the_servers_retry_after(mode, kind):
    """The first answer says Retry-After: 1 (the backoff alone would wait 10 ms); the retry then succeeds."""

    async def main():
        backend = Backend(mode, fail_first=1)
        async with serve_app(backend.app()) as url:
            start = time.monotonic()
            observation, pool = await one_call(url, ToolLimits(**FAST_RETRY))
            elapsed = time.monotonic() - start
            backend.fail_first, backend.hits = 0, 0
            backend.mode = mode  # always refuse: the error observation names the kind
            refused, _ = await one_call(url, ToolLimits(timeout_s=5, retries=1, backoff_s=0.01, retry_after_max_s=0.2))
        return observation, pool, elapsed, refused

    observation, pool, elapsed, refused = asyncio.run(main())
    assert observation.startswith("Doc 1 (Title: ") and pool.metrics["wiki_search"].retries == 1
    assert 0.9 <= elapsed < 5
    assert refused.startswith(f"[wiki_search error: {kind}] HTTP {mode[-3:]}") and "(2 attempts)" in refused


def test_retry_after_reads_seconds_and_http_dates():
    from afm_core.tools.http import retry_after_s

    assert retry_after_s("3") == 3.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490.0) == 0.0
    assert retry_after_s("soon") is None and retry_after_s(None) is None


def test_circuit_states_with_one_probe_at_a_time():
    from afm_core.tools.circuit import OPENED, RECOVERED, REOPENED, Circuit

    now = [0.0]
    circuit = Circuit(failures=2, cooldown_s=10.0, clock=lambda: now[0])
    assert circuit.admit() == "call" and circuit.record("connect") is None
    assert circuit.record("timeout") is None and circuit.consecutive == 1  # a timeout is neutral
    assert circuit.record("connect") == OPENED and circuit.state == "open"
    assert circuit.admit() is None and circuit.retry_in_s() == 10.0
    now[0] = 10.0
    assert circuit.admit() == "probe" and circuit.admit() is None  # one probe at a time
    assert circuit.record("connect", probe=True) == REOPENED and circuit.admit() is None
    now[0] = 20.0
    assert circuit.admit() == "probe"
    assert circuit.record("answered", probe=True) == RECOVERED and circuit.state == "closed"
    assert circuit.admit() == "call" and circuit.consecutive == 0


def test_fail_fast_raises_a_dedicated_error_once_the_circuit_is_open():
    from afm_core.tools.errors import ToolCircuitOpenError

    url = f"http://127.0.0.1:{free_port()}"
    limits = ToolLimits(timeout_s=1, retries=0, circuit_failures=2, circuit_cooldown_s=60)

    async def main():
        async with ToolPool([WikiSearchTool(url)], {"wiki_search": limits}, fail_fast=True) as pool:
            first = [await pool.call("wiki_search", f"q{i}") for i in range(2)]
            with pytest.raises(ToolCircuitOpenError, match="wiki_search") as raised:
                await pool.call("wiki_search", "q3")
            return first, raised.value, pool

    first, error, pool = asyncio.run(main())
    assert all(o.startswith("[wiki_search error: connect]") for o in first)
    assert error.tool == "wiki_search"
    assert pool.metrics["wiki_search"].circuit_opens == 1


def test_a_killed_tool_server_opens_its_circuit_once_then_recovers(data_dir, tmp_path, caplog):
    """A real wiki server is SIGKILLed mid-run: after N=3 calls that cannot connect the circuit opens (one
    ERROR log line, counted in the metrics), later calls get circuit_open observations at once; the server
    comes back on the same port and the probe after the cool-down closes the circuit."""
    import logging
    import os
    import signal

    from afm_core.tools.launcher import ServerGroup

    corpus = str(data_dir / "mhqa" / "hotpotqa500" / "corpus.jsonl")
    limits = ToolLimits(
        timeout_s=5, retries=1, backoff_s=0.01, cache_ttl_s=None, circuit_failures=3, circuit_cooldown_s=1.0
    )
    caplog.set_level(logging.INFO, logger="afm_core.tools.pool")
    with ServerGroup(log_dir=tmp_path) as group:
        group.launch("wiki", ["--corpus", corpus])
        url = group.wait()["wiki"]
        port = int(url.rsplit(":", 1)[1])

        async def main():
            async with ToolPool([WikiSearchTool(url)], {"wiki_search": limits}) as pool:
                before = await pool.call("wiki_search", "Shirley Temple")
                [proc] = group.processes()
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                start = time.monotonic()
                during = [await pool.call("wiki_search", f"question {i}") for i in range(6)]
                refused_s = time.monotonic() - start
                opened = pool.metrics_snapshot()["wiki_search"]
                group.urls.pop("wiki")
                group.launch("wiki", ["--corpus", corpus], port=port)
                await asyncio.to_thread(group.wait)
                await asyncio.sleep(1.2)  # past the cool-down
                after = await pool.call("wiki_search", "Shirley Temple Black")
                return before, during, refused_s, opened, after, pool.metrics_snapshot()["wiki_search"]

        before, during, refused_s, opened, after, final = asyncio.run(main())
    assert before.startswith("Doc 1 (Title:")
    assert all(o.startswith("[wiki_search error: connect]") for o in during[:3])
    assert all(o.startswith("[wiki_search error: circuit_open]") for o in during[3:]), during
    assert refused_s < 2.0  # refused calls do not wait for connections
    assert opened["circuit_opens"] == 1 and opened["circuit"] == "open"
    assert opened["errors"] == {"connect": 3, "circuit_open": 3}
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(loud) == 1 and "circuit OPEN after 3 consecutive connection failures" in loud[0].getMessage()
    assert after.startswith("Doc 1 (Title:") and final["circuit"] == "closed" and final["circuit_opens"] == 1
    assert any("circuit closed" in r.getMessage() for r in caplog.records)
