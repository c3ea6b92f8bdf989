"""Per-document causal attention on CPU at the documents' own lengths vs at ``cpu_kernel_length`` (the trainer's
way in bf16/fp16): resident-set growth and time over many new document lengths, side by side, each in a fresh
process.

    .venv/bin/python -m benchmarks.cpu_attention_lengths                      # bf16 and fp32, 300 documents
    .venv/bin/python -m benchmarks.cpu_attention_lengths --dtypes bf16 --docs 600 --out runs/bench/attn.json

Each run attends ``--docs`` documents of random lengths in ``[--min-len, --max-len]`` (seeded; SmolLM2-135M's
heads: 9 query, 3 key/value, 64 wide) forward and backward through
``afm_core.models.attention._DocumentCausalAttention`` (the trainer's CPU kernel of packed documents) and prints the
growth of the resident set over the run and the seconds it took. ``exact`` attends each document at its own
length (what the trainer did before); ``bucketed`` at :func:`afm_core.models.attention.cpu_kernel_length` (what
it does now: the same as ``exact`` in fp32). In bf16 on a CPU with AVX512/AMX, ATen's flash-attention kernel runs
oneDNN brgemm micro-kernels cached per shape and thread without bound (``KernelCache``,
``aten/src/ATen/native/CPUBlas.cpp``): a few MB per new length, never returned.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.json_out import write_out

_CHILD = """
import json, random, sys, time
import torch
from afm_core.models import attention
dtype, mode, docs, low, high, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
if mode == "exact":
    attention.cpu_kernel_length = lambda tokens, dtype: tokens
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
rng = random.Random(seed)
torch.manual_seed(seed)
start, t0 = rss(), time.perf_counter()
for _ in range(docs):
    s = rng.randint(low, high)
    q = torch.randn(s, 9, 64, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(s, 3, 64, dtype=dtype, requires_grad=True) for _ in range(2))
    attention._DocumentCausalAttention.apply(q, k, v, [0, s], 0.125).sum().backward()
print(json.dumps({"rss_growth_mib": round(rss() - start, 1), "seconds": round(time.perf_counter() - t0, 2)}))
"""


def measure(dtype: str, mode: str, args: argparse.Namespace) -> dict[str, float]:
    """One run in a fresh process: ``{"rss_growth_mib", "seconds"}``.

    Raises:
        subprocess.CalledProcessError: the child failed.
    """
    argv = [dtype, mode, args.docs, args.min_len, args.max_len, args.seed]
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, *map(str, argv)], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--min-len", type=int, default=20)
    parser.add_argument("--max-len", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, dict[str, float]]] = {}
    print(f"{args.docs} documents of {args.min_len}-{args.max_len} tokens, forward + backward, one process per run")
    print(f"{'dtype':6} {'lengths':9} {'RSS growth (MiB)':>17} {'seconds':>8}")
    for dtype in args.dtypes:
        results[dtype] = {mode: measure(dtype, mode, args) for mode in ("exact", "bucketed")}
        for mode, r in results[dtype].items():
            print(f"{dtype:6} {mode:9} {r['rss_growth_mib']:17.0f} {r['seconds']:8.1f}")
        exact, bucketed = results[dtype]["exact"], results[dtype]["bucketed"]
        print(
            f"{dtype:6} bucketed/exact: RSS growth {bucketed['rss_growth_mib'] / max(exact['rss_growth_mib'], 1.0):.2f}x,"
            f" time {bucketed['seconds'] / exact['seconds']:.2f}x"
        )
    return write_out(args.out, results)


if __name__ == "__main__":
    main()
