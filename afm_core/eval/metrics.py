"""Evaluation metrics over k samples per problem: avg@k, unbiased pass@k, maj@k, best-of-n, breakdowns.

- avg@k: the mean score of the k samples of a problem, averaged over problems (the paper's "pass@1",
  reported as avg@16 for AIME and AMC).
- pass@k: the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374, eq. 1 and its numerically stable
  product form in Fig. 3): ``1 - C(n-c, k) / C(n, k)`` for n samples of which c are correct.
- maj@k: the score of the most frequent final answer among the k samples (ties: the answer seen first);
  samples without an answer do not vote.
- best-of-n: the sample a selector picks among the first n (the model's own ``<double_check>`` score, or a
  judge); the paper's "Bo3".
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

_DOUBLE_CHECK_RE = re.compile(r"<double_check>(.*?)(?:</double_check>|$)", re.DOTALL)
_SCORE_RE = re.compile(r"\b([1-4])\b")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for ``n`` samples with ``c`` correct (Chen et al. 2021).

    Raises:
        ValueError: not ``0 <= c <= n`` or not ``1 <= k <= n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_vote(answers: Sequence[str | None], scores: Sequence[float]) -> float:
    """The score of the most frequent non-empty answer (first seen wins ties); 0.0 when no sample answered."""
    counts = Counter(a for a in answers if a)
    if not counts:
        return 0.0
    best = max(counts.values())
    winner = next(a for a in answers if a and counts[a] == best)
    return next(s for a, s in zip(answers, scores) if a == winner)


def double_check_score(response: str) -> int | None:
    """The 1-4 score of the LAST ``<double_check>`` block of a response, None when there is none."""
    blocks = _DOUBLE_CHECK_RE.findall(response)
    if not blocks:
        return None
    match = _SCORE_RE.search(blocks[-1])
    return int(match.group(1)) if match else None


def best_of(
    samples: Sequence[Mapping[str, Any]], n: int = 3, key: Callable[[Mapping[str, Any]], float] | None = None
) -> float:
    """The score of the sample picked among the first ``n`` by ``key`` (highest wins, first on ties).

    Default key: the ``double_check`` score (samples without one rank lowest).
    """
    pool = list(samples[:n])
    if not pool:
        return 0.0
    key = key or (lambda s: s.get("double_check") or 0)
    best = max(range(len(pool)), key=lambda i: (key(pool[i]), -i))
    return float(pool[best]["score"])


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean (sample std / sqrt(n)); 0.0 for fewer than 2 values."""
    if len(values) < 2:
        return 0.0
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def benchmark_metrics(samples: Sequence[Mapping[str, Any]], k: int, best_of_n: int = 3) -> dict[str, Any]:
    """Metrics of one benchmark from its ``samples.jsonl`` records (each with ``problem_id``, ``sample``,
    ``score``, ``answer_key``, ``reason``, ``grader_error``, ``finish_reason``, ``num_tool_calls``, ``turns``,
    ``tool_calls``, ``level``, ``double_check``, ``format_valid``).

    Only problems with all k samples count toward avg@k / pass@k / maj@k (``n`` says how many did).
    """
    by_problem: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for s in samples:
        by_problem[s["problem_id"]].append(s)
    complete = {p: sorted(v, key=lambda s: s["sample"])[:k] for p, v in by_problem.items() if len(v) >= k}
    per_problem = {p: _mean(s["score"] for s in v) for p, v in complete.items()}
    out: dict[str, Any] = {"n": len(complete), "k": k, "samples": sum(len(v) for v in complete.values())}
    out[f"avg@{k}"] = _mean(per_problem.values())
    out[f"avg@{k}_se"] = standard_error(list(per_problem.values()))
    for kk in sorted({1, k} | ({kk for kk in (2, 4, 8, 16) if kk < k})):
        out[f"pass@{kk}"] = _mean(pass_at_k(len(v), sum(s["score"] >= 1.0 for s in v), kk) for v in complete.values())
    out[f"maj@{k}"] = _mean(
        majority_vote([s.get("answer_key") for s in v], [s["score"] for s in v]) for v in complete.values()
    )
    if k >= best_of_n:
        out[f"best_of_{best_of_n}"] = _mean(best_of(v, best_of_n) for v in complete.values())
    flat = [s for v in complete.values() for s in v]
    out["grader_errors"] = sum(bool(s.get("grader_error")) for s in flat)
    out["format_valid"] = _mean(float(bool(s.get("format_valid"))) for s in flat)
    out["tool_calls_per_problem"] = _mean(float(s.get("num_tool_calls", 0)) for s in flat)
    out["turns"] = _mean(float(s.get("turns", 0)) for s in flat)
    out["response_tokens"] = _mean(float(s.get("response_tokens", 0)) for s in flat)
    out["finish_reasons"] = dict(Counter(s.get("finish_reason") for s in flat))
    out["reasons"] = dict(Counter(s.get("reason") for s in flat))
    errors: dict[str, Counter] = defaultdict(Counter)
    calls: Counter = Counter()
    for s in flat:
        for call in s.get("tool_calls", []):
            calls[call["name"]] += 1
            if call.get("error"):
                errors[call["name"]][call["error"]] += 1
    out["tool_calls"] = dict(calls)
    out["tool_errors"] = {name: dict(c) for name, c in errors.items()}
    levels: dict[str, list[float]] = defaultdict(list)
    for p, v in complete.items():
        level = str(v[0].get("level") or "")
        if level:
            levels[level].append(per_problem[p])
    if levels:
        out["by_level"] = {lv: {"n": len(vals), f"avg@{k}": _mean(vals)} for lv, vals in sorted(levels.items())}
    return out
