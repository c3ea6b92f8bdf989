"""HTTP for tools: one request with a per-attempt timeout, a rate limit, and retries with exponential
backoff on connection errors, timeouts, 5xx answers, 429 (too many requests) and malformed JSON.

Backoff: attempt ``k`` (0-based) waits ``min(backoff_max_s, backoff_s * 2**k)`` seconds, times a jitter
factor in [0.5, 1.0] ("equal jitter", Brooker 2015, *Exponential Backoff And Jitter*), before attempt
``k + 1``. A 429 or 503 answer with a ``Retry-After`` header (seconds or an HTTP date, RFC 9110 §10.2.3)
waits that long instead, at most ``retry_after_max_s``. Any other 4xx answer is not retried: the request
itself is wrong.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from afm_core.tools.errors import ToolError
from afm_core.tools.metrics import ToolMetrics

RETRYABLE = frozenset({"connect", "timeout", "http_5xx", "rate_limited", "bad_json"})


#: The backoff jitter's own generator: the process-wide ``random`` is the trainer's, seeded and checkpointed
#: (``afm_core.engine.checkpoint.rng_state``), and how many retries a run meets depends on the machine's load, so a
#: draw from it would make a resumed run's RNG state differ from the uninterrupted run's.
_JITTER = random.Random()


@dataclass
class ToolLimits:
    """Per-tool limits (seconds, calls, calls per second).

    Attributes:
        timeout_s: limit on one HTTP attempt, connect to last byte.
        retries: further attempts after the first on a retryable failure.
        backoff_s: base of the exponential backoff between attempts.
        backoff_max_s: cap on one backoff wait.
        concurrency: calls of this tool in flight at once (more wait).
        rate_per_s: HTTP attempts started per second (token bucket); None: unlimited.
        burst: token-bucket capacity (attempts that may start back to back).
        cache_ttl_s: how long a successful observation is reused; None or 0: no caching.
        retry_after_max_s: cap on a wait asked for by ``Retry-After``.
        circuit_failures: consecutive calls failing to connect that open the tool's circuit in the pool
            (see :class:`~afm_core.tools.pool.ToolPool`); None (the default here): no circuit.
            ``conf/tools/default.yaml`` sets 5 for every tool.
        circuit_cooldown_s: how long an open circuit refuses calls before one probe call may try again.
    """

    timeout_s: float = 30.0
    retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    concurrency: int = 64
    rate_per_s: float | None = None
    burst: int = 1
    cache_ttl_s: float | None = 3600.0
    retry_after_max_s: float = 60.0
    circuit_failures: int | None = None
    circuit_cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.retries < 0 or self.concurrency < 1 or self.burst < 1:
            raise ValueError(
                f"invalid ToolLimits {self}: need timeout_s > 0, retries >= 0, concurrency >= 1, burst >= 1"
            )
        if (self.circuit_failures is not None and self.circuit_failures < 1) or self.circuit_cooldown_s < 0:
            raise ValueError(
                f"invalid ToolLimits {self}: circuit_failures must be >= 1 or None, circuit_cooldown_s >= 0"
            )
        if self.rate_per_s is not None and self.rate_per_s <= 0:
            raise ValueError(f"invalid ToolLimits {self}: rate_per_s must be > 0 or None")


class TokenBucket:
    """Token bucket (``rate`` tokens per second, capacity ``burst``); :meth:`acquire` waits for a token."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._tokens = float(burst)
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:
            while True:
                now = time.monotonic()
                self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
                self._stamp = now
                if self._tokens >= 1:
                    self._tokens -= 1
                    return
                await asyncio.sleep((1 - self._tokens) / self.rate)


class ToolHttp:
    """What a tool uses to reach its backend; built by the pool, one per tool."""

    def __init__(self, session: aiohttp.ClientSession, limits: ToolLimits, metrics: ToolMetrics) -> None:
        self.session = session
        self.limits = limits
        self.metrics = metrics
        self._bucket = TokenBucket(limits.rate_per_s, limits.burst) if limits.rate_per_s else None

    async def request_json(self, method: str, url: str, *, json_body: Any = None, headers: dict | None = None) -> Any:
        """Send one request (with retries) and return the decoded JSON body.

        Raises:
            ToolError: kind ``connect``, ``timeout``, ``http_5xx``, ``rate_limited`` (429) or ``bad_json``
                after the last attempt, or ``http_4xx`` / ``bad_input`` (invalid URL) at once.
        """
        attempts = self.limits.retries + 1
        for attempt in range(attempts):
            if self._bucket is not None:
                await self._bucket.acquire()
            try:
                return await self._attempt(method, url, json_body, headers)
            except ToolError as e:
                e.attempts = attempt + 1
                if e.kind not in RETRYABLE or attempt + 1 == attempts:
                    raise
                self.metrics.retries += 1
                if e.retry_after_s is not None:
                    delay = min(e.retry_after_s, self.limits.retry_after_max_s)
                else:
                    delay = min(self.limits.backoff_max_s, self.limits.backoff_s * 2**attempt) * _JITTER.uniform(
                        0.5, 1.0
                    )
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _attempt(self, method: str, url: str, json_body: Any, headers: dict | None) -> Any:
        timeout = aiohttp.ClientTimeout(total=self.limits.timeout_s)
        try:
            async with self.session.request(method, url, json=json_body, headers=headers, timeout=timeout) as resp:
                body = await resp.text(errors="replace")
                if resp.status in (429, 503):
                    kind = "rate_limited" if resp.status == 429 else "http_5xx"
                    wait = retry_after_s(resp.headers.get("Retry-After"))
                    raise ToolError(kind, f"HTTP {resp.status} from {url}: {body[:200]}", retry_after_s=wait)
                if resp.status >= 500:
                    raise ToolError("http_5xx", f"HTTP {resp.status} from {url}: {body[:200]}")
                if resp.status >= 400:
                    raise ToolError("http_4xx", f"HTTP {resp.status} from {url}: {body[:200]}")
                try:
                    return json.loads(body)
                except json.JSONDecodeError as e:
                    raise ToolError("bad_json", f"malformed JSON from {url}: {e.msg} at char {e.pos}") from e
        except TimeoutError as e:
            raise ToolError("timeout", f"no answer from {url} within {self.limits.timeout_s:g} s") from e
        except aiohttp.InvalidURL as e:
            raise ToolError("bad_input", f"invalid URL {url!r}") from e
        except aiohttp.ClientError as e:
            # refused, reset, DNS failure, the server closed mid-answer, too many redirects
            raise ToolError("connect", f"cannot reach {url}: {e.__class__.__name__}: {e}") from e


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delay-seconds or an HTTP date (RFC 9110 §10.2.3).

    Returns None when the header is absent or unreadable (the exponential backoff applies then).
    """
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
