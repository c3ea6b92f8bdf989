"""Our SFT step and Hugging Face transformers' on one GPU, each in its own process: tokens/s, TFLOP/s, MFU, memory.

    python -m benchmarks.sft_gpu --out runs/bench/sft_gpu.json       # Qwen2.5-1.5B, 2 x 4096 tokens a step
    python -m benchmarks.sft_gpu --model qwen2.5-3b-instruct --out runs/bench/sft_gpu_3b.json
    python -m benchmarks.sft_gpu --profile                           # + the top-20 kernels of one step of each
    python -m benchmarks.sft_gpu --dry-run                           # CPU: tiny-llama, the whole path in seconds
    python -m benchmarks.sft_gpu --write-lengths                     # re-derive coa_doc_lengths.json (needs the data)

Sized for one GPU call of at most 6 minutes (the defaults: Qwen2.5-1.5B's published shape with random weights, 2
micro batches of 4096 tokens per step, 2 warmup and 8 timed steps per engine).

* **Data**: packed sequences of documents whose lengths are drawn from the real CoA traces' length distribution,
  committed as ``benchmarks/coa_doc_lengths.json`` (the data folder does not travel to a GPU machine): the token
  counts of the trajectories the SFT data module tokenizes (``conf/sft.yaml``'s data and model, observation-masked),
  in 64-token bins, with their trained-token share. Every step gets new documents (new lengths), packed
  first-fit-decreasing as the SFT data module packs (:func:`afm_core.data.packing.first_fit_decreasing`); in a
  document the leading ``1 - target share`` of its tokens are prompt (no loss), random token ids.
* **ours**: the SFT job's path, as :func:`benchmarks.plan_vs_gpu.measure` builds it (``conf/sft.yaml``, precision
  ``auto``: bf16 on GPU; megatron's GPTModel of ``build_model``, :class:`~afm_core.train.trainer.SFTTrainer`,
  ``train_step``); its peak memory against ``jobs.plan``'s prediction (:func:`benchmarks.plan_vs_gpu.compare`).
* **hf**: ``AutoModelForCausalLM.from_config`` (SDPA attention, the documents by a 4-D block-causal mask), fp32
  weights and fused AdamW with the forward under ``torch.autocast(bf16)`` on GPU (HF Trainer's ``bf16=True``;
  ``--hf-precision bf16``: bf16 weights), :func:`benchmarks.sft_throughput.hf_train_step`.

The engines run one after the other, each in a process of its own (its peak memory is its own), on the same
sequences in the same order. Per engine: median seconds per step over the timed steps, input tokens/s (all
positions) and target tokens/s (trained tokens), model TFLOP/s per second of step as ``6 N`` (``N``: all parameters,
as ``jobs.plan`` counts them) and with attention (:mod:`afm_core.train.flops`: ``6 N`` over the matrix parameters
plus the causal attention pairs of the documents), MFU against the dense bf16 matmul rate measured in the same run
(``[8192, 8192] x [8192, 8192]`` on GPU) and against the device's datasheet peak, peak allocated memory. Writes
JSON (``--out``) with the command, device and versions, and prints a Markdown row for ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from afm_core.data.packing import PackedSequences, PackingStats, fill_sequences, first_fit_decreasing
from afm_core.utils.atomic import atomic_write_json

LENGTHS_PATH = Path(__file__).with_name("coa_doc_lengths.json")
BIN_TOKENS = 64
GIB = 1024**3


def write_lengths(path: Path = LENGTHS_PATH) -> dict[str, Any]:
    """Token counts of the real CoA trajectories as the SFT data module tokenizes them (``conf/sft.yaml``'s data
    and model, observation-masked), as a histogram of ``BIN_TOKENS``-token bins, written to ``path``."""
    from transformers import AutoTokenizer

    import afm_core.config  # noqa: F401  (registers the typed schema the defaults list names)
    from afm_core.data.loader import read_sft_examples
    from afm_core.data.prepare import ensure_prepared
    from afm_core.launch.plan import compose
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint

    cfg = compose("sft", [])
    data_dir = ensure_prepared(cfg.data)
    tokenizer = AutoTokenizer.from_pretrained(ensure_hf_checkpoint(cfg.model), local_files_only=True)
    parquet = [data_dir / "train.parquet", data_dir / "heldout.parquet"]
    examples = read_sft_examples(parquet, tokenizer, mask_observations=bool(cfg.data.mask_observations))
    lengths = np.array([len(e.input_ids) for e in examples])
    trained = sum(sum(label != -100 for label in e.labels) for e in examples)
    counts = np.bincount(lengths // BIN_TOKENS)
    histogram = {
        "source": f"conf/sft.yaml data={cfg.data.name} (train + heldout), tokenizer of model={cfg.model.name}",
        "documents": len(examples),
        "bin_tokens": BIN_TOKENS,
        "counts": counts.tolist(),  # counts[i]: documents of [i * bin_tokens, (i + 1) * bin_tokens) tokens
        "target_share": round(trained / int(lengths.sum()), 4),
        "mean_tokens": round(float(lengths.mean()), 1),
    }
    path.write_text(json.dumps(histogram, indent=1) + "\n")
    return histogram


def draw_lengths(histogram: dict[str, Any], count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` document lengths (tokens, >= 2) drawn from the histogram: a bin by its count, then uniformly in it."""
    counts = np.asarray(histogram["counts"], dtype=np.float64)
    width = int(histogram["bin_tokens"])
    bins = rng.choice(len(counts), size=count, p=counts / counts.sum())
    return np.maximum(bins * width + rng.integers(0, width, size=count), 2)


def packed_steps(
    histogram: dict[str, Any], steps: int, global_batch: int, seq_length: int, vocab_size: int, seed: int = 0
) -> PackedSequences:
    """``steps * global_batch`` packed sequences, new documents for every step's ``global_batch`` sequences: lengths
    drawn (:func:`draw_lengths`, cut to ``seq_length``) until they fill 1.25 times the step's tokens, packed
    first-fit-decreasing, the fullest ``global_batch`` sequences kept; random token ids, the leading
    ``1 - target_share`` of each document's tokens without a label."""
    rng = np.random.default_rng(seed)
    share = float(histogram["target_share"])
    docs: list[tuple[list[int], list[int]]] = []
    bins: list[list[int]] = []
    for _ in range(steps):
        lengths: list[int] = []
        while sum(lengths) < 1.25 * global_batch * seq_length:
            lengths.extend(int(x) for x in np.minimum(draw_lengths(histogram, 8, rng), seq_length))
        packed = first_fit_decreasing(np.array(lengths), seq_length)
        packed.sort(key=lambda members: -sum(lengths[i] for i in members))
        for members in packed[:global_batch]:
            bins.append([])
            for i in members:
                ids = rng.integers(0, vocab_size, size=lengths[i]).tolist()
                prompt = max(1, round(lengths[i] * (1 - share)))
                docs.append((ids, [-100] * prompt + ids[prompt:]))
                bins[-1].append(len(docs) - 1)
    input_ids, labels, position_ids, cu_seqlens = fill_sequences(docs, bins, seq_length, 0)
    n, tokens = len(bins), sum(len(ids) for ids, _ in docs)
    stats = PackingStats(len(docs), n, 0, 0, tokens, int((labels != -100).sum()), n * seq_length)
    return PackedSequences(input_ids, labels, position_ids, cu_seqlens, stats)


def compose(args: argparse.Namespace, run_dir: Path) -> Any:
    """``conf/sft.yaml`` with the benchmark's model and shapes (:func:`benchmarks.plan_vs_gpu.compose_config`)."""
    from benchmarks.plan_vs_gpu import compose_config

    steps = args.warmup + args.steps + int(args.profile)
    return compose_config(
        args.model, args.seq_length, args.recompute, args.micro_batch, args.global_batch, steps, run_dir
    )


def matmul_peak_tflops(device: str, dtype: torch.dtype, size: int) -> float:
    """The dense ``[size, size] x [size, size]`` matmul rate of this device in ``dtype``, TFLOP/s (median of timed
    bursts, :func:`benchmarks.roofline.measure_linear_gflops`)."""
    from benchmarks.roofline import measure_linear_gflops

    return measure_linear_gflops(size, size, size, dtype, torch.get_num_threads(), seconds=1.0, device=device) / 1e3


def ours(args: argparse.Namespace, data: PackedSequences) -> dict[str, Any]:
    """Our engine in this (spawned) process: plan, steps, memory readings; then the device's matmul rate."""
    from afm_core.models.attention import SDPAttention
    from afm_core.models.bridge import transformer_engine_available
    from afm_core.train.distributed import destroy_distributed, training_dtype
    from benchmarks import plan_vs_gpu

    on_gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="afm-sft-gpu-") as run_dir:
        cfg = compose(args, Path(run_dir))
        pred = plan_vs_gpu.predict(cfg, on_gpu=on_gpu, transformer_engine=transformer_engine_available())
        kernel = {}

        def note_kernel(module: Any, inputs: tuple[Any, ...]) -> None:  # the thd kernel of the first attention call
            if isinstance(module, SDPAttention):
                kernel["attention"] = module.thd_kernel(inputs[0])
                hook.remove()  # a global hook costs every module call: gone before the first step ends

        hook = torch.nn.modules.module.register_module_forward_pre_hook(note_kernel)
        try:
            steps = args.warmup + args.steps
            meas = plan_vs_gpu.measure(cfg, steps, 0, pred["hf_config"], "trainer", data, args.profile, args.threads)
        finally:
            hook.remove()
            destroy_distributed()
        dtype = training_dtype(cfg.trainer.precision)
    layout = pred["layout"]
    tokens = layout["num_microbatches"] * layout["micro_batch_size"] * layout["seq_length"]
    memory = plan_vs_gpu.compare(pred, meas, tokens // layout["seq_length"], layout["seq_length"])["rows"]
    device = "cuda" if on_gpu else "cpu"
    return {
        "engine": "ours",
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "attention": kernel.get("attention"),
        "precision": str(dtype).removeprefix("torch."),
        "step_s": [s["seconds"] for s in meas["steps"][args.warmup :]],
        "losses": [s["loss"] for s in meas["steps"]],
        "peak_allocated_bytes": max(max(s["fwd_bwd_peak"], s["optimizer_peak"]) for s in meas["steps"][args.warmup :]),
        "memory_vs_plan": memory,
        "params": pred["params"],
        "profile": meas["profile"],
        "matmul_peak_tflops": matmul_peak_tflops(device, torch.bfloat16 if on_gpu else dtype, args.matmul_size),
    }


def hf(args: argparse.Namespace, data: PackedSequences) -> dict[str, Any]:
    """HF transformers' engine in this (spawned) process (module docstring)."""
    from transformers import AutoModelForCausalLM

    from afm_core.launch.plan import hf_config_of
    from afm_core.train.distributed import training_dtype
    from benchmarks.sft_throughput import hf_train_step, profile_step

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="afm-sft-gpu-hf-") as run_dir:
        cfg = compose(args, Path(run_dir))
    torch.manual_seed(int(cfg.trainer.seed))
    bf16 = training_dtype(cfg.trainer.precision) == torch.bfloat16
    weights = torch.bfloat16 if bf16 and args.hf_precision == "bf16" else torch.float32
    with device:
        model = AutoModelForCausalLM.from_config(hf_config_of(cfg.model), attn_implementation="sdpa", dtype=weights)
    autocast = torch.bfloat16 if bf16 and weights == torch.float32 else None
    step = hf_train_step(model, cfg, data, args.warmup + args.steps + int(args.profile), device, autocast=autocast)
    step_s, losses = [], []
    for index in range(args.warmup + args.steps):
        if index == args.warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        losses.append(step()["loss"])
        if index >= args.warmup:
            step_s.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return {
        "engine": "hf",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "attention": f"HF {model.config._attn_implementation}, 4-D block-causal bool mask",
        "precision": "bf16 weights" if weights == torch.bfloat16 else ("autocast bf16" if autocast else "fp32"),
        "step_s": step_s,
        "losses": losses,
        "peak_allocated_bytes": peak,
        "profile": profile_step(step) if args.profile else None,
    }


def summarize(result: dict[str, Any], args: argparse.Namespace, data: PackedSequences, peaks: dict[str, Any]) -> None:
    """Add tokens/s, TFLOP/s and MFU to an engine's ``result`` (in place)."""
    from afm_core.models.presets import load_preset
    from afm_core.train.flops import batch_attention_pairs, training_flops

    arch = load_preset(args.model).arch
    step_s = statistics.median(result["step_s"])
    tokens = args.global_batch * args.seq_length
    # every step's sequences come from one distribution: the mean over all of them stands for a step's
    pairs = batch_attention_pairs({"tokens": data.input_ids, "cu_seqlens": data.cu_seqlens}, args.seq_length)
    flops = training_flops(arch, tokens, pairs * args.global_batch // len(data))
    with_attention = (flops["linear"] + flops["attention"]) / step_s / 1e12
    result.update(
        median_step_s=step_s,
        input_tokens_per_s=tokens / step_s,
        target_tokens_per_s=data.stats.num_target_tokens / len(data) * args.global_batch / step_s,
        tflops_6n=6 * peaks["params"] * tokens / step_s / 1e12,
        tflops=with_attention,
        attention_flops_share=flops["attention"] / (flops["linear"] + flops["attention"]),
        mfu_measured_peak=with_attention / peaks["matmul_peak_tflops"],
        mfu_datasheet=with_attention / peaks["datasheet_peak_tflops"] if peaks["datasheet_peak_tflops"] else None,
    )


def versions() -> dict[str, Any]:
    import megatron.core
    import transformers

    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": megatron.core.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }


def render(report: dict[str, Any]) -> str:
    """The results as a Markdown table (the README's), one row per engine."""
    head = (
        "| engine | attention | precision | s/step | input tok/s | TFLOP/s 6N | TFLOP/s + attn | MFU (measured peak) "
        "| MFU (datasheet) | peak GiB |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in report["engines"].values():
        datasheet = "" if r["mfu_datasheet"] is None else f"{r['mfu_datasheet']:.1%}"
        lines.append(
            f"| {r['engine']} | {r['attention']} | {r['precision']} | {r['median_step_s']:.3f} | "
            f"{r['input_tokens_per_s']:,.0f} | {r['tflops_6n']:.1f} | {r['tflops']:.1f} | "
            f"{r['mfu_measured_peak']:.1%} | {datasheet} | {r['peak_allocated_bytes'] / GIB:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="qwen2.5-1.5b-instruct", help="a conf/model preset (its shape, random weights)"
    )
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=2, help="packed sequences per optimizer step")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per engine first")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per engine")
    parser.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    parser.add_argument("--hf-precision", choices=("autocast", "bf16"), default="autocast")
    parser.add_argument("--engines", nargs="+", choices=("ours", "hf"), default=["ours", "hf"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (CPU runs)")
    parser.add_argument("--matmul-size", type=int, default=8192, help="square matmul of the measured peak")
    parser.add_argument("--profile", action="store_true", help="one more step per engine: its top-20 kernels")
    parser.add_argument("--dry-run", action="store_true", help="tiny-llama, 2 x 512 tokens, 1 step, on CPU")
    parser.add_argument("--write-lengths", action="store_true", help=f"re-derive {LENGTHS_PATH.name} and exit")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.model, args.seq_length, args.global_batch, args.micro_batch = "tiny-llama", 512, 2, 1
        args.warmup, args.steps, args.matmul_size, args.threads = 0, 1, 512, args.threads or 1
    if args.global_batch % args.micro_batch or args.steps < 1 or args.warmup < 0:
        parser.error("--global-batch must be a multiple of --micro-batch, --steps >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    from afm_core.models.presets import load_preset
    from afm_core.train.flops import datasheet_peak_tflops

    args = parse_args(argv)
    if args.write_lengths:
        print(json.dumps(write_lengths(), indent=1))
        return 0
    histogram = json.loads(LENGTHS_PATH.read_text())
    steps = args.warmup + args.steps + int(args.profile)
    data = packed_steps(histogram, steps, args.global_batch, args.seq_length, load_preset(args.model).arch.vocab_size)
    print(f"[sft_gpu] {args.model}: {args.global_batch} x {args.seq_length} tokens/step, "
          f"{data.stats.num_examples / len(data):.2f} documents/sequence, {args.warmup} + {args.steps} steps", flush=True)  # fmt: skip
    # each engine in a process of its own, one after the other (a dry run: side by side, timings are not its point)
    with ProcessPoolExecutor(len(args.engines) if args.dry_run else 1, mp_context=mp.get_context("spawn")) as pool:
        futures = {name: pool.submit(ours if name == "ours" else hf, args, data) for name in args.engines}
        results = {name: future.result() for name, future in futures.items()}
    first = results.get("ours", {})
    device = next(iter(results.values()))["device"]  # read in the engines: this process keeps off the GPU
    peaks = {
        "params": first.get("params") or _params(args),
        "matmul_peak_tflops": first.get("matmul_peak_tflops")
        or matmul_peak_tflops("cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16, args.matmul_size),
        "datasheet_peak_tflops": datasheet_peak_tflops(device) if device != "cpu" else None,
    }
    for result in results.values():
        summarize(result, args, data, peaks)
    report = {
        "command": "python -m benchmarks.sft_gpu " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": device,
        "versions": versions(),
        "model": args.model,
        "seq_length": args.seq_length,
        "micro_batch": args.micro_batch,
        "global_batch": args.global_batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "documents_per_sequence": data.stats.num_examples / len(data),
        **peaks,
        "engines": results,
    }
    if {"ours", "hf"} <= results.keys():
        report["ratio_ours_over_hf"] = results["hf"]["median_step_s"] / results["ours"]["median_step_s"]
    print(render(report), flush=True)
    for result in results.values():
        if result.get("profile"):
            print(f"\ntop kernels of one {result['engine']} step\n{result['profile']}", flush=True)
    if "ratio_ours_over_hf" in report:
        print(f"ours / HF tokens/s: {report['ratio_ours_over_hf']:.2f}x", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out, report)
        print(f"wrote {args.out}", flush=True)
    return 0


def _params(args: argparse.Namespace) -> int:
    """All parameters of the model preset, as ``jobs.plan`` counts them (when our engine did not run)."""
    from benchmarks.plan_vs_gpu import predict

    with tempfile.TemporaryDirectory(prefix="afm-sft-gpu-") as run_dir:
        cfg = compose(args, Path(run_dir))
    return int(predict(cfg, on_gpu=torch.cuda.is_available(), transformer_engine=False)["params"])


if __name__ == "__main__":
    sys.exit(main())
