"""``ToolPool``: every tool call of a trainer or evaluator goes through one pool.

The pool holds one shared :class:`aiohttp.ClientSession` (connection limits overall and per host), and
per tool: a concurrency limit, a rate limit, per-attempt timeouts with retries and exponential backoff
(:class:`~afm_core.tools.http.ToolHttp`), a TTL cache (memory and disk, :class:`~afm_core.tools.cache.ToolCache`)
and metrics (:class:`~afm_core.tools.metrics.ToolMetrics`). It also keeps the per-trajectory duplicate
guard of the upstream rollout (a repeated ``web_search``/``wiki_search`` query or ``crawl_page`` URL list in
the same trajectory gets a canned observation instead of a call; OPPO-PersonalAI/Agent_Foundation_Models,
``verl/verl/workers/rollout/sglang_rollout/sglang_rollout.py``).

:meth:`ToolPool.call` never raises (except :class:`asyncio.CancelledError`): a failure becomes an error
observation, so one bad tool call cannot end a rollout.

A circuit breaker per tool (:class:`~afm_core.tools.circuit.Circuit`, ``ToolLimits.circuit_failures`` and
``circuit_cooldown_s``) stops calling a server after that many consecutive calls failed to connect: one
ERROR log line per outage, ``circuit_opens`` in the metrics, and until a probe call after the cool-down
reaches the server again, every call returns a ``[tool error: circuit_open]`` observation at once, or, with
``fail_fast=True``, raises :class:`~afm_core.tools.errors.ToolCircuitOpenError` (end the job rather than fill
its trajectories with error observations).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import aiohttp

from afm_core.tools.base import Tool
from afm_core.tools.cache import ToolCache
from afm_core.tools.circuit import OPENED, RECOVERED, REOPENED, Circuit
from afm_core.tools.errors import ToolCircuitOpenError, ToolError
from afm_core.tools.http import ToolHttp, ToolLimits
from afm_core.tools.metrics import ToolMetrics

log = logging.getLogger(__name__)


def error_observation(tool: str, error: ToolError) -> str:
    """The observation text of a failed call, e.g. ``[wiki_search error: timeout] no answer ... (3 attempts)``."""
    tries = f" ({error.attempts} attempts)" if error.attempts > 1 else ""
    return f"[{tool} error: {error.kind}] {error}{tries}"


class ToolPool:
    """Calls tools by name, with limits, retries, caching, a duplicate guard and metrics.

    Use as ``async with ToolPool(tools, limits) as pool: obs = await pool.call("wiki_search", "query", "traj-1")``.

    Args:
        tools: the tools, keyed by their ``name``.
        limits: :class:`ToolLimits` per tool name; missing names get ``default_limits``.
        default_limits: limits for tools not in ``limits``.
        cache: a :class:`ToolCache` (None: no caching).
        connection_limit: open connections in total (aiohttp ``TCPConnector(limit=...)``).
        connection_limit_per_host: open connections per host:port.
        max_trajectories: trajectories the duplicate guard remembers (oldest forgotten first).
        fail_fast: :meth:`call` raises :class:`ToolCircuitOpenError` instead of returning a ``circuit_open``
            error observation while a tool's circuit is open.
    """

    def __init__(
        self,
        tools: Iterable[Tool],
        limits: Mapping[str, ToolLimits] | None = None,
        *,
        default_limits: ToolLimits | None = None,
        cache: ToolCache | None = None,
        connection_limit: int = 512,
        connection_limit_per_host: int = 256,
        max_trajectories: int = 100_000,
        fail_fast: bool = False,
    ) -> None:
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools named {tool.name!r}")
            self.tools[tool.name] = tool
        limits = dict(limits or {})
        unknown = set(limits) - set(self.tools)
        if unknown:
            raise ValueError(f"limits given for unknown tools {sorted(unknown)}; tools are {sorted(self.tools)}")
        default_limits = default_limits or ToolLimits()
        self.limits = {name: limits.get(name, default_limits) for name in self.tools}
        self.cache = cache
        self.metrics = {name: ToolMetrics() for name in self.tools}
        self.fail_fast = fail_fast
        self.circuits = {
            name: Circuit(lim.circuit_failures, lim.circuit_cooldown_s)
            for name, lim in self.limits.items()
            if lim.circuit_failures is not None
        }
        self._connection_limit = connection_limit
        self._connection_limit_per_host = connection_limit_per_host
        self._max_trajectories = max_trajectories
        self._seen: OrderedDict[str, set[tuple[str, str]]] = OrderedDict()
        self._session: aiohttp.ClientSession | None = None
        self._http: dict[str, ToolHttp] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}

    async def __aenter__(self) -> ToolPool:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        """Open the shared session (call from the event loop that will make the calls)."""
        connector = aiohttp.TCPConnector(limit=self._connection_limit, limit_per_host=self._connection_limit_per_host)
        self._session = aiohttp.ClientSession(connector=connector)
        for name in self.tools:
            self._http[name] = ToolHttp(self._session, self.limits[name], self.metrics[name])
            self._slots[name] = asyncio.Semaphore(self.limits[name].concurrency)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.cache is not None:
            self.cache.close()

    async def call(
        self, name: str, content: str, trajectory_id: str | None = None, context: Mapping[str, str] | None = None
    ) -> str:
        """Run tool ``name`` on the content of its tag and return the observation text.

        Args:
            name: the tool's name (= its CoA tag).
            content: the text between ``<tag>`` and ``</tag>``.
            trajectory_id: enables the duplicate guard for this trajectory; None disables it.
            context: trajectory facts a tool may use (e.g. ``{"task": question}``), see :meth:`Tool.call`.

        Returns:
            The observation, or an error observation (:func:`error_observation`) when the call failed.

        Raises:
            ToolCircuitOpenError: only with ``fail_fast``, when the tool's circuit is open.
        """
        if self._session is None:
            raise RuntimeError("ToolPool.call before start(): use 'async with ToolPool(...)'")
        tool = self.tools.get(name)
        if tool is None:
            return f"[{name} error: bad_input] unknown tool {name!r}; available: {', '.join(sorted(self.tools))}"
        metrics = self.metrics[name]
        metrics.calls += 1
        start = time.perf_counter()
        try:
            return await self._call(tool, content, trajectory_id, context or {}, metrics)
        except ToolError as e:
            metrics.errors[e.kind] += 1
            if e.kind == "circuit_open" and self.fail_fast:
                raise ToolCircuitOpenError(name, f"{name}: {e}") from e
            return error_observation(name, e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug in a tool must not end the rollout; count it and say so
            log.exception("tool %s raised", name)
            metrics.errors["bad_response"] += 1
            return f"[{name} error: bad_response] {e.__class__.__name__}: {e}"
        finally:
            metrics.latency.observe(time.perf_counter() - start)

    async def call_many(
        self,
        calls: Sequence[tuple[str, str]],
        trajectory_id: str | None = None,
        context: Mapping[str, str] | None = None,
    ) -> list[str]:
        """Run ``(name, content)`` calls concurrently (as the upstream rollout's ``asyncio.gather``); results in order."""
        return list(await asyncio.gather(*(self.call(n, c, trajectory_id, context) for n, c in calls)))

    def end_trajectory(self, trajectory_id: str) -> None:
        """Forget the duplicate-guard memory of a finished trajectory."""
        self._seen.pop(trajectory_id, None)

    def metrics_snapshot(self) -> dict[str, dict]:
        """``{tool name: counters, latency histogram and circuit state}`` as plain JSON-able dicts."""
        snapshot = {}
        for name, m in self.metrics.items():
            circuit = self.circuits.get(name)
            snapshot[name] = {**m.snapshot(), "circuit": circuit.state if circuit is not None else None}
        return snapshot

    async def _call(
        self, tool: Tool, content: str, trajectory_id: str | None, context: Mapping[str, str], metrics: ToolMetrics
    ) -> str:
        args = tool.parse(content)
        key = tool.cache_key(args, context)
        duplicate = tool.duplicate_observation
        guarded = trajectory_id if duplicate is not None else None  # the trajectory the guard watches
        if guarded is not None and duplicate is not None and (tool.name, key) in self._trajectory(guarded):
            metrics.duplicates += 1
            return duplicate
        ttl = self.limits[tool.name].cache_ttl_s
        observation = self.cache.get(tool.name, key) if self.cache is not None and ttl else None
        if observation is not None:
            metrics.cache_hits += 1
        else:
            async with self._slots[tool.name]:
                observation = await self._guarded_call(tool, args, context, metrics)
            metrics.ok += 1
            if self.cache is not None and ttl:
                self.cache.put(tool.name, key, observation, ttl)
        if guarded is not None:  # only a call that worked counts as done: a failed one may be repeated
            self._trajectory(guarded).add((tool.name, key))
        return observation

    async def _guarded_call(self, tool: Tool, args, context: Mapping[str, str], metrics: ToolMetrics) -> str:
        """``tool.call`` behind the tool's circuit breaker."""
        circuit = self.circuits.get(tool.name)
        if circuit is None:
            return await tool.call(args, self._http[tool.name], context)
        admitted = circuit.admit()
        if admitted is None:
            raise ToolError(
                "circuit_open",
                f"{tool.name} is not called: its server refused {circuit.consecutive} connections in a row "
                f"(next try in {circuit.retry_in_s():.0f} s)",
            )
        outcome = "neutral"
        try:
            observation = await tool.call(args, self._http[tool.name], context)
            outcome = "answered"
            return observation
        except ToolError as e:
            outcome = "connect" if e.kind == "connect" else "neutral" if e.kind == "timeout" else "answered"
            raise
        finally:
            change = circuit.record(outcome, probe=admitted == "probe")
            if change == OPENED:
                metrics.circuit_opens += 1
                log.error(
                    "tool %s: circuit OPEN after %d consecutive connection failures (is its server down?); "
                    "calls fail at once%s, next probe in %g s",
                    tool.name,
                    circuit.consecutive,
                    " and raise (fail_fast)" if self.fail_fast else "",
                    circuit.cooldown_s,
                )
            elif change == REOPENED:
                log.info("tool %s: probe failed, circuit stays open for %g s", tool.name, circuit.cooldown_s)
            elif change == RECOVERED:
                log.warning("tool %s: circuit closed, its server answers again", tool.name)

    def _trajectory(self, trajectory_id: str) -> set[tuple[str, str]]:
        seen = self._seen.get(trajectory_id)
        if seen is None:
            seen = self._seen[trajectory_id] = set()
            while len(self._seen) > self._max_trajectories:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(trajectory_id)
        return seen
