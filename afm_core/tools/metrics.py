"""Per-tool counters and latency histograms, kept by :class:`~afm_core.tools.pool.ToolPool`.

The histogram has fixed upper bounds in seconds (Prometheus-style cumulative buckets on export); the
quantiles it reports are the upper bound of the bucket that holds them.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

#: Upper bounds (seconds) of the latency buckets; the last bucket is +inf.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class LatencyHistogram:
    """Counts of call latencies per bucket of :data:`LATENCY_BUCKETS_S` (+ one overflow bucket)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.total_s += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def quantile(self, q: float) -> float | None:
        """Upper bound (s) of the bucket holding quantile ``q`` (inf for the overflow bucket); None if empty."""
        n = self.count
        if n == 0:
            return None
        rank, seen = q * n, 0
        for bound, c in zip((*LATENCY_BUCKETS_S, float("inf")), self.counts):
            seen += c
            if seen >= rank:
                return bound
        return float("inf")

    def snapshot(self) -> dict:
        cumulative, seen = {}, 0
        for bound, c in zip((*LATENCY_BUCKETS_S, float("inf")), self.counts):
            seen += c
            cumulative["+Inf" if bound == float("inf") else f"{bound:g}"] = seen
        return {
            "count": self.count,
            "sum_s": round(self.total_s, 6),
            "buckets_le_s": cumulative,
            "p50_le_s": self.quantile(0.5),
            "p99_le_s": self.quantile(0.99),
        }


@dataclass
class ToolMetrics:
    """Counters of one tool.

    Attributes:
        calls: calls made through the pool (cache hits and duplicates included).
        ok: calls that returned a backend observation.
        errors: failed calls by error kind (:data:`~afm_core.tools.base.ERROR_KINDS`).
        retries: HTTP attempts repeated after a retryable failure.
        cache_hits: calls answered from the cache.
        duplicates: calls answered by the per-trajectory duplicate guard.
        circuit_opens: times the tool's circuit opened (outages; refused calls count as ``circuit_open`` errors).
        latency: wall-clock latency of every call, seconds.
    """

    calls: int = 0
    ok: int = 0
    errors: Counter = field(default_factory=Counter)
    retries: int = 0
    cache_hits: int = 0
    duplicates: int = 0
    circuit_opens: int = 0
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    def snapshot(self) -> dict:
        return {
            "calls": self.calls,
            "ok": self.ok,
            "errors": dict(self.errors),
            "retries": self.retries,
            "cache_hits": self.cache_hits,
            "duplicates": self.duplicates,
            "circuit_opens": self.circuit_opens,
            "latency": self.latency.snapshot(),
        }
