"""Agent-loop generation speed vs raw vLLM on the same prompts, against this machine's compute roofline.

    .venv/bin/python -m benchmarks.rollout_throughput --prompts 128 --max-tokens 256   # d92c413 vs now, side by side
    .venv/bin/python -m benchmarks.rollout_throughput --engines default --rounds 1      # the current settings alone
    .venv/bin/python -m benchmarks.rollout_throughput --model tiny-llama --prompts 64 --max-tokens 128
    .venv/bin/python -m benchmarks.rollout_throughput --json runs/bench/rollout.json

Each engine setting of ``--engines`` (:data:`ENGINES`: ``d92c413`` is the engine as commit d92c413 started it, fp32,
eager, vLLM's own core binding; ``default`` is ``conf/engine/vllm.yaml`` today) gets a fresh vLLM engine
(``afm_core.rollout.vllm_engine``) per round, in ABBA order over ``--rounds``; on the same GSM8K-test prompts (math
task prompt) it runs, with all requests in flight at once:

1. raw: ``engine.generate`` once per prompt, ``max_tokens`` tokens, no stop strings (vLLM's own speed);
2. agent: :class:`~afm_core.rollout.AgentLoop` on the same prompts with the CoA stop strings and a tool runner that
   answers every call at once (the loop's own overhead: stop-string turns, observation tokens appended,
   bookkeeping), ``max_response_tokens`` = ``max_tokens``.

Before the engines, :func:`benchmarks.roofline.decode_roofline` measures this machine's dense matmul GFLOP/s at the
model's linear-layer shapes (``[prompts, in]`` activations, fp32 and bf16, the engine's thread count) and turns the
model's FLOP per token (linear layers with the LM head, plus attention at the mean context the agent rounds measured)
into a bound on tokens/s. Prints, per engine, raw and agent tokens/s (medians over rounds), agent/raw (goal >= 0.9),
the agent loop's fraction of the bound, and its speed-up over the first engine of ``--engines``; the JSON holds the
same (``bound_tokens_per_s``, ``agent_fraction_of_bound``, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

ENGINES: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    # name: (VLLMConfig fields, environment at engine start)
    "d92c413": (
        {"dtype": "float32", "enforce_eager": True, "cpu_kv_cache_gib": 1.0},
        {"VLLM_CPU_OMP_THREADS_BIND": "auto"},
    ),
    "default": ({}, {}),
    "compiled": ({"enforce_eager": False}, {}),
    "fp32": ({"dtype": "float32"}, {}),
    # knobs measured once against the profile (benchmarks/README.md): neither helps on 2 cores
    "no-split-kv": ({}, {"VLLM_CPU_ATTN_SPLIT_KV": "0"}),
    "omp-passive": ({}, {"OMP_WAIT_POLICY": "PASSIVE"}),
}


class InstantTools:
    """Every tool call is answered at once with a short fixed observation."""

    async def call(self, name, content, trajectory_id=None, context=None) -> str:
        return "42"

    def end_trajectory(self, trajectory_id: str) -> None:
        pass


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """``os.environ`` with ``values`` set, restored after."""
    old = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


async def run_engine(
    name: str, args: argparse.Namespace, hf_dir: Path, tokenizer: Any, tasks: list, round_: int
) -> dict:
    """One round of one engine setting: start, warm up, raw and agent phases, close."""
    from afm_core.data.tokenize import encode_prompt
    from afm_core.rollout import AgentConfig, AgentLoop, SamplingConfig
    from afm_core.rollout.vllm_engine import VLLMEngine
    from afm_core.rollout.vllm_platform import engine_args
    from afm_core.rollout.vllm_settings import VLLMConfig

    fields, env = ENGINES[name]
    settings = {"cpu_kv_cache_gib": args.kv_cache_gib, **fields}
    cfg = VLLMConfig(model=str(hf_dir), max_model_len=args.max_model_len, max_num_seqs=max(args.prompts, 8),
                     in_process=args.in_process, **settings)  # fmt: skip
    start = time.perf_counter()
    with environment(env):
        engine = await VLLMEngine.start(cfg)
        dtype = engine_args(cfg)["dtype"]
    start_s = time.perf_counter() - start
    sampling = SamplingConfig(temperature=args.temperature, max_tokens=args.max_tokens)
    loop = AgentLoop(engine, tokenizer, InstantTools(), AgentConfig(max_response_tokens=args.max_tokens, max_turns=64,
                     max_tool_calls=64, timeout_s=None), sampling)  # fmt: skip
    prompts = [encode_prompt(tokenizer, t.prompt) for t in tasks]
    try:
        await loop.run_many([(t, -1) for t in tasks[:8]], concurrency=8, progress=None)  # warm-up: sampler compile
        out: dict[str, Any] = {"engine": name, "dtype": dtype, "start_s": round(start_s, 1)}
        phases = ("raw", "agent") if round_ % 2 == 0 else ("agent", "raw")
        for phase in phases:
            began = time.perf_counter()
            if phase == "raw":
                gens = await asyncio.gather(
                    *(engine.generate(p, sampling, f"raw{round_}-{i}") for i, p in enumerate(prompts))
                )
                tokens = sum(len(g.token_ids) for g in gens)
            else:
                rollouts = await loop.run_many([(t, round_) for t in tasks], concurrency=len(tasks), progress=None)
                tokens = sum(r.num_generated_tokens for r in rollouts)
                out["context"] = statistics.mean(len(r.prompt_ids) + len(r.response_ids) / 2 for r in rollouts)
            seconds = time.perf_counter() - began
            out[phase] = tokens / seconds
            print(f"round {round_} {name:8s} {phase:5s}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.0f} "
                  f"tok/s ({dtype}, load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
        return out
    finally:
        await engine.close()


async def main(args: argparse.Namespace) -> dict:
    from afm_core.coa import user_prompt
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rollout import AgentTask
    from afm_core.rollout.factory import load_tokenizer
    from afm_core.utils.paths import shared_data_dir
    from benchmarks.roofline import DecoderShape, decode_roofline, roofline_table

    hf_dir = ensure_hf_checkpoint(args.model)
    tokenizer = load_tokenizer(hf_dir)
    lines = (shared_data_dir() / "math/gsm8k/test.jsonl").read_text().splitlines()[: args.prompts]
    records = [json.loads(line) for line in lines]
    tasks = [AgentTask(f"gsm8k:{i}", "math", user_prompt("math", r["question"]), r["question"],
                       r["answer"].rsplit("####", 1)[1].strip().replace(",", "")) for i, r in enumerate(records)]  # fmt: skip
    threads = len(os.sched_getaffinity(0))
    runs: dict[str, list[dict]] = {name: [] for name in args.engines}
    for round_ in range(args.rounds):
        order = args.engines if round_ % 2 == 0 else list(reversed(args.engines))
        for name in order:
            runs[name].append(await run_engine(name, args, hf_dir, tokenizer, tasks, round_))
    context = statistics.mean(run["context"] for name in args.engines for run in runs[name])
    shape = DecoderShape.from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    roof = decode_roofline(shape, batch=args.prompts, context=context, threads=threads)
    print(roofline_table(roof))
    bound = roof["bound_tokens_per_s"]
    base = args.engines[0]
    results = {}
    for name in args.engines:
        raw_tps = statistics.median(run["raw"] for run in runs[name])
        agent_tps = statistics.median(run["agent"] for run in runs[name])
        results[name] = {
            "dtype": runs[name][0]["dtype"], "start_s": [run["start_s"] for run in runs[name]],
            "raw_tokens_per_s": round(raw_tps, 1), "agent_tokens_per_s": round(agent_tps, 1),
            "ratio_agent_over_raw": round(agent_tps / raw_tps, 3),
            "agent_fraction_of_bound": round(agent_tps / bound, 3),
        }  # fmt: skip
    for name in args.engines:
        results[name]["agent_speedup_over_" + base] = round(
            results[name]["agent_tokens_per_s"] / results[base]["agent_tokens_per_s"], 2
        )
    out = {
        "model": args.model, "prompts": len(tasks), "max_tokens": args.max_tokens, "rounds": args.rounds,
        "threads": threads, "in_process": args.in_process, "bound_tokens_per_s": bound, "roofline": roof,
        "engines": results, "load_average": os.getloadavg(),
        # the last engine of --engines, at the top level for scripts that read one engine
        **{k: v for k, v in results[args.engines[-1]].items() if k != "start_s"},
    }  # fmt: skip
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rollout throughput: {args.model}, {len(tasks)} prompts x {args.max_tokens} tokens, "
                  f"median of {args.rounds}, bound {bound:.0f} tok/s ({threads} threads)")  # fmt: skip
    for column in ("engine", "dtype", "raw tok/s", "agent tok/s", "agent / raw (>= 0.9)", "agent / bound",
                   f"agent / {base}", "start s"):  # fmt: skip
        table.add_column(column)
    for name, r in results.items():
        table.add_row(name, r["dtype"], f"{r['raw_tokens_per_s']:.0f}", f"{r['agent_tokens_per_s']:.0f}",
                      f"{r['ratio_agent_over_raw']:.2f}", f"{r['agent_fraction_of_bound']:.2f}",
                      f"{r['agent_speedup_over_' + base]:.2f}", " ".join(f"{x:.0f}" for x in r["start_s"]))  # fmt: skip
    Console().print(table)
    print("load average " + " ".join(f"{x:.1f}" for x in os.getloadavg()))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engines", nargs="+", default=["d92c413", "default"], choices=sorted(ENGINES))
    parser.add_argument("--in-process", action="store_true", help="InprocVLLMEngine (the RL path) instead of AsyncLLM")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = asyncio.run(main(args))
    print(json.dumps({k: v for k, v in result.items() if k != "roofline"}))
    if args.json:
        from afm_core.utils.atomic import atomic_write_json

        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.json, result)
