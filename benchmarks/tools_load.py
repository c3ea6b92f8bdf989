"""Load test of the tool layer against real local servers: warm vs cold sandbox, and wiki_search.

    .venv/bin/python -m benchmarks.tools_load                      # warm and cold sandbox side by side, 1,000 wiki queries
    .venv/bin/python -m benchmarks.tools_load --json out.json      # also write the numbers
    .venv/bin/python -m benchmarks.tools_load --rounds 3 --wiki-queries 0

Starts two sandbox servers with the same slots, one with warm jails (the default: a zygote per slot forks
each snippet) and one with ``--cold`` (a new jail and interpreter per snippet, the old path), and a wiki
retrieval server (HotpotQA-500 corpus), all on 127.0.0.1. Through one
:class:`~afm_core.tools.pool.ToolPool` per sandbox (the real clients; cache off), in each of ``--rounds``
rounds, cold and warm taking turns phase by phase:
1. ``--trivial-calls`` trivial snippets (``print(1)``) one at a time: unloaded latency;
2. ``--sandbox-calls`` snippets at once (small CPU work each): latency under load and throughput;
then ``--wiki-queries`` wiki_search calls (the HotpotQA questions, cycled), ``--wiki-concurrency`` in flight.
Prints p50/p99 latency (ms) and throughput per phase, and the warm/cold ratios; prints the first failing
observation of a phase whole (also ``first_failure`` in the JSON rows); exits 1 if any call failed.
Targets (printed, not enforced): warm trivial-snippet p50 <= 15 ms; warm throughput at 64 concurrent
>= 2x cold; wiki_search >= 300 queries/s on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from afm_core.tools import CodeTool, ToolLimits, ToolPool, WikiSearchTool
from afm_core.tools.launcher import ServerGroup
from afm_core.utils.paths import shared_data_dir

SNIPPET = "```py\nimport math\nprint(sum(math.isqrt(i) for i in range({n})))\n```"
OK = "[EXECUTED] Code exited with status 0."
SANDBOXES = ("cold", "warm")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def timed(pool: ToolPool, name: str, content: str) -> tuple[float, str]:
    start = time.perf_counter()
    observation = await pool.call(name, content)
    return time.perf_counter() - start, observation


def first_failure(phase: str, results: list[tuple[float, str]], ok: str) -> str | None:
    """The first observation of ``results`` that does not start with ``ok``, printed whole (None: all passed)."""
    for index, (latency, observation) in enumerate(results):
        if not observation.startswith(ok):
            print(f"{phase}: call {index} failed after {latency:.2f} s: {observation!r}", flush=True)
            return observation
    return None


def summarize(phase: str, latencies: list[float], wall_s: float, failures: int) -> dict:
    row = {
        "phase": phase,
        "calls": len(latencies),
        "failures": failures,
        "p50_ms": round(1000 * percentile(latencies, 0.50), 1),
        "p99_ms": round(1000 * percentile(latencies, 0.99), 1),
        "mean_ms": round(1000 * statistics.fmean(latencies), 1),
        "throughput_per_s": round(len(latencies) / wall_s, 1),
        "wall_s": round(wall_s, 3),
    }
    print(
        f"{phase:<28} calls={row['calls']:>5} failures={failures} p50={row['p50_ms']:>7.1f} ms "
        f"p99={row['p99_ms']:>7.1f} ms throughput={row['throughput_per_s']:>7.1f}/s wall={row['wall_s']:.2f} s",
        flush=True,
    )
    return row


async def sandbox_phases(pools: dict[str, ToolPool], args) -> list[dict]:
    """Trivial sequential calls and a concurrent burst, cold and warm taking turns, ``args.rounds`` times."""
    rows = []
    for pool in pools.values():
        await pool.call("code", "print(0)")  # warm up connections and the jails
    for _ in range(args.rounds):
        for mode, pool in pools.items():
            results, start = [], time.perf_counter()
            for _ in range(args.trivial_calls):
                results.append(await timed(pool, "code", "```py\nprint(1)\n```"))
            phase = f"sandbox {mode} trivial, sequential"
            failure = first_failure(phase, results, OK)
            failures = sum(not obs.startswith(OK) for _, obs in results)
            rows.append(summarize(phase, [lat for lat, _ in results], time.perf_counter() - start, failures))
            rows[-1]["first_failure"] = failure
        for mode, pool in pools.items():
            start = time.perf_counter()
            results = await asyncio.gather(
                *(timed(pool, "code", SNIPPET.format(n=10_000 + i)) for i in range(args.sandbox_calls))
            )
            failures = sum(not obs.startswith(OK) for _, obs in results)
            phase = f"sandbox {mode} {args.sandbox_calls} concurrent"
            failure = first_failure(phase, results, OK)
            rows.append(summarize(phase, [lat for lat, _ in results], time.perf_counter() - start, failures))
            rows[-1]["first_failure"] = failure
    return rows


def ratios(rows: list[dict], args) -> dict:
    """Median over rounds of the warm and cold figures, and warm/cold ratios."""

    def median(phase: str, key: str) -> float:
        return statistics.median(row[key] for row in rows if row["phase"] == phase)

    trivial = {m: median(f"sandbox {m} trivial, sequential", "p50_ms") for m in SANDBOXES}
    burst = {m: median(f"sandbox {m} {args.sandbox_calls} concurrent", "throughput_per_s") for m in SANDBOXES}
    summary = {
        "phase": "warm vs cold",
        "trivial_p50_ms": trivial,
        "trivial_p50_speedup": round(trivial["cold"] / trivial["warm"], 2),
        "concurrent_throughput_per_s": burst,
        "concurrent_throughput_ratio": round(burst["warm"] / burst["cold"], 2),
        "failures": 0,
    }
    print(
        f"warm vs cold (median of {args.rounds} round(s)): trivial p50 {trivial['warm']:.1f} ms vs {trivial['cold']:.1f} ms "
        f"({summary['trivial_p50_speedup']:.2f}x faster; target warm <= 15 ms: {'met' if trivial['warm'] <= 15 else 'NOT met'}); "
        f"{args.sandbox_calls}-concurrent throughput {burst['warm']:.1f}/s vs {burst['cold']:.1f}/s "
        f"({summary['concurrent_throughput_ratio']:.2f}x; target >= 2x: {'met' if summary['concurrent_throughput_ratio'] >= 2 else 'NOT met'})",
        flush=True,
    )
    return summary


async def wiki_phase(url: str, questions: list[str], args) -> list[dict]:
    limits = {"wiki_search": ToolLimits(timeout_s=30, retries=0, concurrency=args.wiki_concurrency, cache_ttl_s=None)}
    async with ToolPool([WikiSearchTool(url, topk=3)], limits) as pool:
        await pool.call("wiki_search", "warm up")
        queries = [questions[i % len(questions)] for i in range(args.wiki_queries)]
        slots = asyncio.Semaphore(args.wiki_concurrency)

        async def one(query: str) -> tuple[float, str]:
            async with slots:
                return await timed(pool, "wiki_search", query)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(q) for q in queries))
        failures = sum(not obs.startswith("Doc 1 (Title:") for _, obs in results)
        phase = f"wiki_search {args.wiki_queries} queries"
        failure = first_failure(phase, results, "Doc 1 (Title:")
        row = summarize(phase, [lat for lat, _ in results], time.perf_counter() - start, failures)
        return [{**row, "first_failure": failure}]


async def run_load(urls: dict[str, str], questions: list[str], args) -> list[dict]:
    limits = {"code": ToolLimits(timeout_s=60, retries=0, concurrency=args.sandbox_calls, cache_ttl_s=None)}
    pools = {m: ToolPool([CodeTool(urls[f"sandbox_{m}"], timeout_s=10)], limits) for m in SANDBOXES}
    for pool in pools.values():
        await pool.start()
    try:
        rows = await sandbox_phases(pools, args)
        rows.append(ratios(rows, args))
    finally:
        for pool in pools.values():
            await pool.close()
    if args.wiki_queries:
        rows += await wiki_phase(urls["wiki"], questions, args)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sandbox-calls", type=int, default=64)
    parser.add_argument("--trivial-calls", type=int, default=50)
    parser.add_argument("--sandbox-slots", type=int, default=4, help="sandbox server --max-concurrency")
    parser.add_argument("--rounds", type=int, default=1, help="cold/warm rounds (medians are reported)")
    parser.add_argument("--wiki-queries", type=int, default=1000)
    parser.add_argument("--wiki-concurrency", type=int, default=16)
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="default: $AFM_SHARED_DATA or <repo>/../shared/data"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the result rows here")
    args = parser.parse_args(argv)
    data_dir = args.data_dir or shared_data_dir()
    folder = data_dir / "mhqa" / "hotpotqa500"
    if not folder.is_dir():
        print(f"data folder {folder} not found (set AFM_SHARED_DATA or --data-dir)", file=sys.stderr)
        return 2
    questions = [json.loads(line)["question"] for line in (folder / "questions.jsonl").open()]
    sandbox_args = ["--max-concurrency", str(args.sandbox_slots), "--max-queue", str(args.sandbox_calls * 4)]
    with ServerGroup() as group:
        group.launch("sandbox_warm", sandbox_args, module="sandbox.server")
        group.launch("sandbox_cold", [*sandbox_args, "--cold"], module="sandbox.server")
        if args.wiki_queries:
            group.launch("wiki", ["--corpus", str(folder / "corpus.jsonl")])
        urls = group.wait()
        rows = asyncio.run(run_load(urls, questions, args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if any(row["failures"] for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
