"""Agent-loop generation speed vs raw vLLM on the same prompts, and evaluation problems/s.

    .venv/bin/python -m benchmarks.rollout_throughput                        # SmolLM2-135M, 32 GSM8K prompts
    .venv/bin/python -m benchmarks.rollout_throughput --model tiny-llama --prompts 64 --max-tokens 128
    .venv/bin/python -m benchmarks.rollout_throughput --json runs/bench/rollout.json

One vLLM engine (``afm_core.rollout.vllm_engine``) serves three phases on the same GSM8K-test prompts (math
task prompt), each with all requests in flight at once, in ABAB order over ``--rounds`` rounds:

1. raw: ``engine.generate`` once per prompt, ``max_tokens`` tokens, no stop strings (vLLM's own speed);
2. agent: :class:`~afm_core.rollout.AgentLoop` on the same prompts with the CoA stop strings and a tool runner
   that answers every call at once (the loop's own overhead: stop-string turns, observation tokens appended,
   bookkeeping), ``max_response_tokens`` = ``max_tokens``;
then 3. eval: the agent loop plus the math grader (math-verify) per problem: problems/s.

Prints generated tokens/s of raw and agent and their ratio (goal: agent/raw >= 0.9), and problems/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path


class InstantTools:
    """Every tool call is answered at once with a short fixed observation."""

    async def call(self, name, content, trajectory_id=None, context=None) -> str:
        return "42"

    def end_trajectory(self, trajectory_id: str) -> None:
        pass


async def main(args: argparse.Namespace) -> dict:
    from afm_core.coa import user_prompt
    from afm_core.data.tokenize import encode_prompt
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rewards import grade_math
    from afm_core.rollout import AgentConfig, AgentLoop, AgentTask, SamplingConfig
    from afm_core.rollout.factory import load_tokenizer
    from afm_core.rollout.vllm_engine import VLLMConfig, VLLMEngine
    from afm_core.utils.paths import shared_data_dir

    hf_dir = ensure_hf_checkpoint(args.model)
    tokenizer = load_tokenizer(hf_dir)
    lines = (shared_data_dir() / "math/gsm8k/test.jsonl").read_text().splitlines()[: args.prompts]
    records = [json.loads(line) for line in lines]
    tasks = [AgentTask(f"gsm8k:{i}", "math", user_prompt("math", r["question"]), r["question"],
                       r["answer"].rsplit("####", 1)[1].strip().replace(",", "")) for i, r in enumerate(records)]  # fmt: skip
    engine = await VLLMEngine.start(VLLMConfig(model=str(hf_dir), max_model_len=args.max_model_len,
                                               max_num_seqs=max(args.prompts, 8)))  # fmt: skip
    sampling = SamplingConfig(temperature=args.temperature, max_tokens=args.max_tokens)
    loop = AgentLoop(engine, tokenizer, InstantTools(), AgentConfig(max_response_tokens=args.max_tokens, max_turns=64,
                     max_tool_calls=64, timeout_s=None), sampling)  # fmt: skip
    prompts = [encode_prompt(tokenizer, t.prompt) for t in tasks]

    async def raw(round_: int) -> tuple[int, float]:
        start = time.perf_counter()
        gens = await asyncio.gather(*(engine.generate(p, sampling, f"raw{round_}-{i}") for i, p in enumerate(prompts)))
        return sum(len(g.token_ids) for g in gens), time.perf_counter() - start

    async def agent(round_: int) -> tuple[int, float]:
        start = time.perf_counter()
        rollouts = await loop.run_many([(t, round_) for t in tasks], concurrency=len(tasks), progress=None)
        return sum(r.num_generated_tokens for r in rollouts), time.perf_counter() - start

    await raw(-1)  # warm-up: inductor sampler compile, prefix cache of the task prompt
    results: dict[str, list[float]] = {"raw": [], "agent": []}
    for round_ in range(args.rounds):
        for name, phase in (("raw", raw), ("agent", agent)) if round_ % 2 == 0 else (("agent", agent), ("raw", raw)):
            tokens, seconds = await phase(round_)
            results[name].append(tokens / seconds)
            print(
                f"round {round_} {name:5s}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.0f} tok/s",
                flush=True,
            )

    start = time.perf_counter()
    rollouts = await loop.run_many([(t, 99) for t in tasks], concurrency=len(tasks), progress=None)
    grades = [grade_math(r.response_text, r.task.answer) for r in rollouts]
    eval_s = time.perf_counter() - start
    await engine.close()
    raw_tps, agent_tps = statistics.median(results["raw"]), statistics.median(results["agent"])
    out = {
        "model": args.model, "prompts": len(tasks), "max_tokens": args.max_tokens, "rounds": args.rounds,
        "raw_tokens_per_s": round(raw_tps, 1), "agent_tokens_per_s": round(agent_tps, 1),
        "ratio_agent_over_raw": round(agent_tps / raw_tps, 3), "eval_problems_per_s": round(len(tasks) / eval_s, 3),
        "eval_correct": sum(g.correct for g in grades), "load_average": os.getloadavg(),
    }  # fmt: skip
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"rollout throughput: {args.model}, {len(tasks)} prompts x {args.max_tokens} tokens (median of {args.rounds})"
    )
    for column in ("raw vLLM tok/s", "agent loop tok/s", "agent / raw (goal >= 0.9)", "eval problems/s", "load avg"):
        table.add_column(column)
    table.add_row(f"{raw_tps:.0f}", f"{agent_tps:.0f}", f"{agent_tps / raw_tps:.2f}", f"{len(tasks) / eval_s:.2f}",
                  " ".join(f"{x:.1f}" for x in os.getloadavg()))  # fmt: skip
    Console().print(table)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = asyncio.run(main(args))
    print(json.dumps(result))
    if args.json:
        from afm_core.utils.atomic import atomic_write_json

        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.json, result)
