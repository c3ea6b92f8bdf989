"""Load test of the tool layer against real local servers (acceptance b).

    python benchmarks/tools_load.py                       # 64 concurrent sandbox calls, 1,000 wiki_search queries
    python benchmarks/tools_load.py --json out.json       # also write the numbers

Starts a sandbox server and a wiki retrieval server (HotpotQA-500 corpus) on 127.0.0.1, then through one
:class:`~afm_core.tools.pool.ToolPool` (the real clients; cache off):
1. trivial snippets (``print(1)``) one at a time: unloaded latency;
2. ``--sandbox-calls`` snippets at once (small CPU work each): latency under load and throughput;
3. ``--wiki-queries`` wiki_search calls (the HotpotQA questions, cycled), ``--wiki-concurrency`` in flight.
Prints p50/p99 latency (ms) and throughput per phase; exits 1 if any call failed.
Targets (recorded either way): trivial-snippet p50 <= 50 ms; wiki_search >= 300 queries/s on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from afm_core.tools import CodeTool, ToolLimits, ToolPool, WikiSearchTool  # noqa: E402
from afm_core.tools.launcher import ServerGroup  # noqa: E402
from afm_core.utils.paths import shared_data_dir  # noqa: E402

SNIPPET = "```py\nimport math\nprint(sum(math.isqrt(i) for i in range({n})))\n```"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def timed(pool: ToolPool, name: str, content: str) -> tuple[float, str]:
    start = time.perf_counter()
    observation = await pool.call(name, content)
    return time.perf_counter() - start, observation


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


async def run_load(urls: dict[str, str], questions: list[str], args) -> list[dict]:
    tools = [CodeTool(urls["sandbox"], timeout_s=10), WikiSearchTool(urls["wiki"], topk=3)]
    limits = {
        "code": ToolLimits(timeout_s=60, retries=0, concurrency=args.sandbox_calls, cache_ttl_s=None),
        "wiki_search": ToolLimits(timeout_s=30, retries=0, concurrency=args.wiki_concurrency, cache_ttl_s=None),
    }
    rows = []
    async with ToolPool(tools, limits) as pool:
        await pool.call("code", "print(0)")  # warm up connections and the jail
        await pool.call("wiki_search", "warm up")

        latencies, failures, start = [], 0, time.perf_counter()
        for _ in range(args.trivial_calls):
            latency, observation = await timed(pool, "code", "```py\nprint(1)\n```")
            latencies.append(latency)
            failures += not observation.startswith("[EXECUTED] Code exited with status 0.")
        rows.append(summarize("sandbox trivial, sequential", latencies, time.perf_counter() - start, failures))

        start = time.perf_counter()
        results = await asyncio.gather(
            *(timed(pool, "code", SNIPPET.format(n=10_000 + i)) for i in range(args.sandbox_calls))
        )
        failures = sum(not obs.startswith("[EXECUTED] Code exited with status 0.") for _, obs in results)
        rows.append(summarize(f"sandbox {args.sandbox_calls} concurrent", [lat for lat, _ in results], time.perf_counter() - start, failures))

        queries = [questions[i % len(questions)] for i in range(args.wiki_queries)]
        slots = asyncio.Semaphore(args.wiki_concurrency)

        async def one(query: str) -> tuple[float, str]:
            async with slots:
                return await timed(pool, "wiki_search", query)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(q) for q in queries))
        failures = sum(not obs.startswith("Doc 1 (Title:") for _, obs in results)
        rows.append(summarize(f"wiki_search {args.wiki_queries} queries", [lat for lat, _ in results], time.perf_counter() - start, failures))
        errors = {name: dict(m.errors) for name, m in pool.metrics.items() if m.errors}
        if errors:
            print(f"errors by kind: {errors}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sandbox-calls", type=int, default=64)
    parser.add_argument("--trivial-calls", type=int, default=50)
    parser.add_argument("--sandbox-slots", type=int, default=4, help="sandbox server --max-concurrency")
    parser.add_argument("--wiki-queries", type=int, default=1000)
    parser.add_argument("--wiki-concurrency", type=int, default=16)
    parser.add_argument("--data-dir", type=Path, default=None, help="default: $AFM_SHARED_DATA or <repo>/../shared/data")
    parser.add_argument("--json", type=Path, default=None, help="write the result rows here")
    args = parser.parse_args(argv)
    data_dir = args.data_dir or shared_data_dir()
    folder = data_dir / "mhqa" / "hotpotqa500"
    if not folder.is_dir():
        print(f"data folder {folder} not found (set AFM_SHARED_DATA or --data-dir)", file=sys.stderr)
        return 2
    questions = [json.loads(line)["question"] for line in (folder / "questions.jsonl").open()]
    with ServerGroup() as group:
        group.launch("sandbox", ["--max-concurrency", str(args.sandbox_slots), "--max-queue", str(args.sandbox_calls * 4)])
        group.launch("wiki", ["--corpus", str(folder / "corpus.jsonl")])
        urls = group.wait()
        rows = asyncio.run(run_load(urls, questions, args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if any(row["failures"] for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
