"""Our SFT step and Hugging Face transformers' on one GPU, each in its own process: tokens/s, TFLOP/s, MFU, memory.

    python -m benchmarks.sft_gpu --out runs/bench/sft_gpu.json       # Qwen2.5-1.5B, 2 x 4096 tokens a step
    python -m benchmarks.sft_gpu --model qwen2.5-3b-instruct --out runs/bench/sft_gpu_3b.json
    python -m benchmarks.sft_gpu --profile --trace-dir runs/bench    # + the top kernels of one step of each
    python -m benchmarks.sft_gpu --engines ours-eager ours hf        # our step without / with compiled kernels
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
* **Weights**: one random initialisation (``AutoModelForCausalLM.from_config`` of the preset, seeded, in bf16)
  written as an HF checkpoint by this process and loaded by every engine, so that their first-step losses on the same
  packed batch compare (:data:`LOSS_TOLERANCE`; past it the script exits with status 1).
* **ours**: the SFT job's path, as :func:`benchmarks.plan_vs_gpu.measure` builds it (``conf/sft.yaml``, precision
  ``auto``: bf16 on GPU; megatron's GPTModel of ``build_model``, the checkpoint loaded by ``load_hf_weights``,
  :class:`~afm_core.train.trainer.SFTTrainer`, ``train_step``); its peak memory against ``jobs.plan``'s
  prediction (:func:`benchmarks.plan_vs_gpu.compare`). ``ours`` runs ``trainer.compile`` as configured (null: the
  compiled elementwise kernels on CUDA, eager on CPU), ``ours-eager`` with ``trainer.compile=false``,
  ``ours-compiled`` with ``true``, ``ours-layers`` with ``trainer.compile_layers=true`` (each transformer layer
  compiled whole; ``dynamo_graphs``: the graphs torch.compile built up to the end of the timed steps, a
  recompilation inside them shows as a slow step in ``step_s``). On CUDA one more step runs under
  ``torch.cuda.set_sync_debug_mode("warn")``: every host-device synchronisation inside it is reported by source
  line (``syncs``).
* **hf**: ``AutoModelForCausalLM.from_pretrained`` of that checkpoint (SDPA attention; the documents by a 4-D
  block-causal mask and position ids restarting per document), fp32 weights and fused AdamW with the forward under
  ``torch.autocast(bf16)`` on GPU (HF Trainer's ``bf16=True``), :func:`benchmarks.sft_throughput.hf_train_step`;
  ``hf-bf16`` (or ``--hf-precision bf16``): bf16 weights and optimizer; ``hf-causal``: bf16 weights, each packed
  sequence one causal attention (no document mask: documents attend to the ones before them, not the computation
  the others do, but the fastest HF step: SDPA's flash kernel, as a baseline).

The engines run one after the other, each in a process of its own (its peak memory is its own), on the same
sequences in the same order. Per engine: median seconds per step over the timed steps, input tokens/s (all
positions) and target tokens/s (trained tokens), model TFLOP/s per second of step as ``6 N`` (``N``: all parameters,
as ``jobs.plan`` counts them) and with attention (:mod:`afm_core.engine.flops`: ``6 N`` over the matrix parameters
plus the causal attention pairs of the documents), MFU against the dense bf16 matmul rate measured in the same run
(``[8192, 8192] x [8192, 8192]`` on GPU) and against the device's datasheet peak, peak allocated memory. Writes
JSON (``--out``) with the command, device and versions, and prints a Markdown row for ``benchmarks/README.md``.
``--profile``: one more step per engine under ``torch.profiler``: the top ops by device time and by CPU time, and
a summary (kernels launched, device-busy and CPU seconds against the step's wall time: a step whose CPU time
exceeds its device time is launch-bound); ``--trace-dir``: that step's Chrome trace, gzipped.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import shutil
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
# ours*: their trainer overrides
ENGINES: dict[str, dict[str, Any]] = {
    "ours": {},
    "ours-eager": {"compile": False},
    "ours-compiled": {"compile": True},
    "ours-layers": {"compile_layers": True},
    "hf": {},
    "hf-bf16": {},
    "hf-causal": {},
}
# |first-step loss of ours - HF's| on the same weights and batch, nats: fp32 (CPU) agrees to rounding
# (benchmarks.sft_throughput's bound); bf16 rounds every matmul's output and our residual stream (HF's autocast
# keeps it fp32), about 1e-3 relative on a ~12-nat loss of random weights
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}


def write_lengths(path: Path = LENGTHS_PATH) -> dict[str, Any]:
    """Token counts of the real CoA trajectories as the SFT data module tokenizes them (``conf/sft.yaml``'s data
    and model, observation-masked), as a histogram of ``BIN_TOKENS``-token bins, written to ``path``."""
    from transformers import AutoTokenizer

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


def compose(args: argparse.Namespace, run_dir: Path, engine: str = "ours") -> Any:
    """``conf/sft.yaml`` with the benchmark's model and shapes (:func:`benchmarks.plan_vs_gpu.compose_config`) and
    the engine's trainer overrides (:data:`ENGINES`)."""
    from benchmarks.plan_vs_gpu import compose_config

    steps = args.warmup + args.steps + int(args.profile) + 1  # + the sync check's step
    cfg = compose_config(
        args.model, args.seq_length, args.recompute, args.micro_batch, args.global_batch, steps, run_dir
    )
    for key, value in ENGINES[engine].items():
        cfg.trainer[key] = value
    return cfg


def write_initial_weights(args: argparse.Namespace, out: Path) -> Path:
    """One random initialisation of the preset (HF's ``_init_weights``, seeded by ``trainer.seed``), rounded to
    bf16 (what a bf16 engine trains; an fp32 one loads the same values) and saved as an HF checkpoint in ``out``
    for every engine to load."""
    from transformers import AutoModelForCausalLM

    from afm_core.launch.plan import hf_config_of

    with tempfile.TemporaryDirectory(prefix="afm-sft-gpu-") as run_dir:
        cfg = compose(args, Path(run_dir))
    torch.manual_seed(int(cfg.trainer.seed))
    model = AutoModelForCausalLM.from_config(hf_config_of(cfg.model), dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


def sync_report(step: Any) -> list[dict[str, Any]]:
    """Run ``step()`` under ``torch.cuda.set_sync_debug_mode("warn")``: each host-device synchronisation in it, by
    the Python source line that caused it (``file:line``, with its count), most frequent first."""
    import warnings

    counts: dict[str, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            where = f"{w.filename}:{w.lineno}"
            counts[where] = counts.get(where, 0) + 1
    return [{"where": k, "count": v} for k, v in sorted(counts.items(), key=lambda kv: -kv[1])]


def forward_backward_sync_error(trainer: Any) -> str | None:
    """One ``trainer.train_step()`` with ``torch.cuda.set_sync_debug_mode("error")`` over the forward and backward
    passes of its micro batches (megatron's schedule up to its gradient finalisation, which reads the token count
    back): None when nothing in them synchronised, else the error and the innermost frames that raised it."""
    import traceback

    from megatron.core.utils import get_model_config

    config = get_model_config(trainer.model[0])
    schedule, finalize = trainer.core.forward_backward, config.finalize_model_grads_func

    def finalize_outside(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.set_sync_debug_mode("default")
        return finalize(*args, **kwargs)

    def checked(**kwargs: Any) -> Any:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return schedule(**kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    trainer.core.forward_backward, config.finalize_model_grads_func = checked, finalize_outside
    try:
        trainer.train_step()
    except RuntimeError as error:
        frames = traceback.extract_tb(error.__traceback__)[-4:]
        return f"{error} at " + " <- ".join(f"{f.filename}:{f.lineno}" for f in reversed(frames))
    finally:
        trainer.core.forward_backward, config.finalize_model_grads_func = schedule, finalize
    return None


def profile_report(step: Any, trace: Path | None = None) -> dict[str, Any]:
    """One ``step()`` under ``torch.profiler`` (CPU, and CUDA when present): its top ops by self device time and by
    self CPU time (tables), kernels launched, device-busy seconds (the sum of their durations), CPU seconds (the
    ops' self times) and the wall seconds; ``trace``: the Chrome trace written there, gzipped."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]  # kernels, copies, memsets
    report = {
        "wall_s": wall,
        "kernels": len(kernels),
        "device_busy_s": sum(e.time_range.elapsed_us() for e in kernels) / 1e6,
        "cpu_s": sum(e.self_cpu_time_total for e in averages) / 1e6,
        "by_device_time": averages.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
        if cuda
        else None,
        "by_cpu_time": averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70),
    }
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as raw:
            prof.export_chrome_trace(raw.name)
            with open(raw.name, "rb") as src, gzip.open(trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return report


def matmul_peak_tflops(device: str, dtype: torch.dtype, size: int) -> float:
    """The dense ``[size, size] x [size, size]`` matmul rate of this device in ``dtype``, TFLOP/s (median of timed
    bursts, :func:`benchmarks.roofline.measure_linear_gflops`)."""
    from benchmarks.roofline import measure_linear_gflops

    return measure_linear_gflops(size, size, size, dtype, torch.get_num_threads(), seconds=1.0, device=device) / 1e3


def ours(args: argparse.Namespace, data: PackedSequences, hf_dir: Path, engine: str = "ours") -> dict[str, Any]:
    """Our engine in this (spawned) process: plan, steps, memory readings, the sync check (CUDA), the profile; then
    the device's matmul rate."""
    from afm_core.engine.distributed import destroy_distributed, training_dtype
    from afm_core.models.attention import SDPAttention
    from afm_core.models.gpt import transformer_engine_available
    from afm_core.models.local_spec import _compiled
    from benchmarks import plan_vs_gpu

    on_gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="afm-sft-gpu-") as run_dir:
        cfg = compose(args, Path(run_dir), engine)
        pred = plan_vs_gpu.predict(cfg, on_gpu=on_gpu, transformer_engine=transformer_engine_available())
        kernel = {}

        def note_kernel(module: Any, inputs: tuple[Any, ...]) -> None:  # the thd kernel of the first attention call
            if isinstance(module, SDPAttention):
                kernel["attention"] = module.thd_kernel(inputs[0])
                kernel["compiled_elementwise"] = _compiled(inputs[0])
                hook.remove()  # a global hook costs every module call: gone before the first step ends

        def checks(trainer: Any, sync: Any) -> dict[str, Any]:  # after the timed steps
            from torch._dynamo.utils import counters

            found: dict[str, Any] = {"profile": None, "syncs": None, "forward_backward_syncs": None,
                                     "dynamo_graphs": counters["stats"]["unique_graphs"]}  # fmt: skip
            if args.profile:
                trace = args.trace_dir / f"sft_gpu_trace_{engine}.json.gz" if args.trace_dir else None
                found["profile"] = profile_report(lambda: (trainer.train_step(), sync()), trace)
            if on_gpu:
                found["syncs"] = sync_report(trainer.train_step)
                found["forward_backward_syncs"] = forward_backward_sync_error(trainer)
            return found

        hook = torch.nn.modules.module.register_module_forward_pre_hook(note_kernel)
        try:
            steps = args.warmup + args.steps
            meas = plan_vs_gpu.measure(
                cfg, steps, 0, pred["hf_config"], "trainer", data, threads=args.threads, hf_dir=hf_dir, after=checks
            )
        finally:
            hook.remove()
            destroy_distributed()
        dtype = training_dtype(cfg.trainer.precision)
    layout = pred["layout"]
    tokens = layout["num_microbatches"] * layout["micro_batch_size"] * layout["seq_length"]
    memory = plan_vs_gpu.compare(pred, meas, tokens // layout["seq_length"], layout["seq_length"])["rows"]
    device = "cuda" if on_gpu else "cpu"
    return {
        "engine": engine,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "attention": kernel.get("attention"),
        "compiled_elementwise": kernel.get("compiled_elementwise"),
        "precision": str(dtype).removeprefix("torch."),
        "step_s": [s["seconds"] for s in meas["steps"][args.warmup :]],
        "losses": [s["loss"] for s in meas["steps"]],
        "peak_allocated_bytes": max(max(s["fwd_bwd_peak"], s["optimizer_peak"]) for s in meas["steps"][args.warmup :]),
        "memory_vs_plan": memory,
        "params": pred["params"],
        "profile": meas["after"]["profile"],
        "syncs": meas["after"]["syncs"],
        "forward_backward_syncs": meas["after"]["forward_backward_syncs"],
        "dynamo_graphs": meas["after"]["dynamo_graphs"],
        "matmul_peak_tflops": matmul_peak_tflops(device, torch.bfloat16 if on_gpu else dtype, args.matmul_size),
    }


def hf(args: argparse.Namespace, data: PackedSequences, hf_dir: Path, engine: str = "hf") -> dict[str, Any]:
    """HF transformers' engine in this (spawned) process (module docstring)."""
    from transformers import AutoModelForCausalLM

    from afm_core.engine.distributed import training_dtype
    from benchmarks.sft_throughput import hf_train_step

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="afm-sft-gpu-hf-") as run_dir:
        cfg = compose(args, Path(run_dir))
    torch.manual_seed(int(cfg.trainer.seed))
    bf16 = training_dtype(cfg.trainer.precision) == torch.bfloat16
    weights = torch.bfloat16 if bf16 and (args.hf_precision == "bf16" or engine != "hf") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", dtype=weights).to(device)
    autocast = torch.bfloat16 if bf16 and weights == torch.float32 else None
    steps = args.warmup + args.steps + int(args.profile)
    if engine == "hf-causal":  # one document of seq_length tokens per sequence: positions 0.. s-1, no block mask
        n, s = data.input_ids.shape
        whole = [np.array([0, s], dtype=np.int32)] * n
        positions = np.broadcast_to(np.arange(s, dtype=np.int32), (n, s)).copy()
        data = PackedSequences(data.input_ids, data.labels, positions, whole, data.stats)
    step = hf_train_step(model, cfg, data, steps, device, autocast=autocast, dense_mask=engine != "hf-causal")
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
        "engine": engine,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "attention": f"HF {model.config._attn_implementation}, "
        + ("causal over the whole sequence" if engine == "hf-causal" else "4-D block-causal bool mask"),
        "precision": "bf16 weights" if weights == torch.bfloat16 else ("autocast bf16" if autocast else "fp32"),
        "step_s": step_s,
        "losses": losses,
        "peak_allocated_bytes": peak,
        "profile": profile_report(step, args.trace_dir / f"sft_gpu_trace_{engine}.json.gz" if args.trace_dir else None)
        if args.profile
        else None,
    }


def summarize(result: dict[str, Any], args: argparse.Namespace, data: PackedSequences, peaks: dict[str, Any]) -> None:
    """Add tokens/s, TFLOP/s and MFU to an engine's ``result`` (in place)."""
    from afm_core.engine.flops import batch_attention_pairs, training_flops
    from afm_core.models.presets import load_preset

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
    parser.add_argument(
        "--hf-precision", choices=("autocast", "bf16"), default="autocast", help="engine hf's weights (hf-bf16: bf16)"
    )
    parser.add_argument(
        "--engines", nargs="+", choices=tuple(ENGINES), default=["ours", "hf"], help="module docstring; in this order"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (CPU runs)")
    parser.add_argument("--matmul-size", type=int, default=8192, help="square matmul of the measured peak")
    parser.add_argument("--profile", action="store_true", help="one more step per engine: its top kernels")
    parser.add_argument("--trace-dir", type=Path, default=None, help="with --profile: write the steps' traces here")
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
    from afm_core.engine.flops import datasheet_peak_tflops
    from afm_core.models.presets import load_preset

    args = parse_args(argv)
    failed: dict[str, str] = {}
    if args.write_lengths:
        print(json.dumps(write_lengths(), indent=1))
        return 0
    histogram = json.loads(LENGTHS_PATH.read_text())
    steps = args.warmup + args.steps + int(args.profile)
    data = packed_steps(histogram, steps, args.global_batch, args.seq_length, load_preset(args.model).arch.vocab_size)
    print(f"[sft_gpu] {args.model}: {args.global_batch} x {args.seq_length} tokens/step, "
          f"{data.stats.num_examples / len(data):.2f} documents/sequence, {args.warmup} + {args.steps} steps", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="afm-sft-gpu-weights-") as weights:
        hf_dir = write_initial_weights(args, Path(weights))
        # each engine in a process of its own, one after the other (a dry run: side by side, timings are not its point)
        workers = len(args.engines) if args.dry_run else 1
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), max_tasks_per_child=1) as pool:
            futures = {
                name: pool.submit(hf if name.startswith("hf") else ours, args, data, hf_dir, name)
                for name in args.engines
            }
            results = {}
            for name, future in futures.items():
                try:
                    results[name] = future.result()
                except Exception as error:  # one engine's failure must not lose the others' figures
                    print(f"[sft_gpu] engine {name} failed: {error!r}", flush=True)
                    failed[name] = repr(error)
    if not results:
        return 1
    first = next((r for name, r in results.items() if name.startswith("ours")), {})
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
    precision = first.get("precision", "float32")
    tolerance = LOSS_TOLERANCE["bf16" if precision == "bfloat16" else "fp32"]
    if "hf" in results:
        hf_result = results["hf"]
        ours_names = [name for name in results if name.startswith("ours")]
        for base in ("hf", "hf-bf16", "hf-causal"):
            if base in results:
                report[f"ratio_over_{base.replace('-', '_')}"] = {
                    name: results[base]["median_step_s"] / results[name]["median_step_s"] for name in ours_names
                }
        if "ours" in results:
            report["ratio_ours_over_hf"] = report["ratio_over_hf"]["ours"]
        report["first_step_loss_gap"] = {
            name: abs(results[name]["losses"][0] - hf_result["losses"][0]) for name in ours_names
        }
        report["loss_tolerance"] = tolerance
    report["failed"] = failed
    print(render(report), flush=True)
    print(details(report), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out, report)
        print(f"wrote {args.out}", flush=True)
    too_far = {name: gap for name, gap in report.get("first_step_loss_gap", {}).items() if gap > tolerance}
    if too_far:
        print(f"[sft_gpu] first-step loss differs from HF's by more than {tolerance}: {too_far}", flush=True)
    return 1 if failed or too_far else 0


def details(report: dict[str, Any]) -> str:
    """What follows the table: per engine its memory against the plan, the syncs in a step, the profile; then the
    ratios to HF and the first-step losses."""
    lines = []
    for r in report["engines"].values():
        name = r["engine"]
        for row in r.get("memory_vs_plan") or []:
            if row["name"] in ("train peak", "device peak") and row["predicted"]:
                lines.append(f"{name}: {row['name']} {row['measured'] / GIB:.2f} GiB, plan {row['predicted'] / GIB:.2f}"
                             f" GiB, ratio {row['ratio']:.3f}")  # fmt: skip
        if r.get("syncs") is not None:
            where = ", ".join(f"{s['where']} x{s['count']}" for s in r["syncs"]) or "none"
            lines.append(f"{name}: host syncs in one step: {where}")
            error = r.get("forward_backward_syncs")
            lines.append(f"{name}: forward + backward under set_sync_debug_mode('error'): {error or 'passed'}")
        if r.get("profile"):
            prof = r["profile"]
            lines.append(f"\n{name}: one profiled step: wall {prof['wall_s']:.3f} s, device busy "
                         f"{prof['device_busy_s']:.3f} s, CPU (ops' self time) {prof['cpu_s']:.3f} s, "
                         f"{prof['kernels']} kernels")  # fmt: skip
            for table in ("by_device_time", "by_cpu_time"):
                if prof.get(table):
                    lines.append(f"{name}: top ops {table.replace('_', ' ')}\n{prof[table]}")
    for name, ratio in report.get("ratio_over_hf", {}).items():
        gap = report["first_step_loss_gap"][name]
        others = [(label, report.get(f"ratio_over_{key}", {}).get(name)) for key, label in
                  (("hf_bf16", "HF bf16 weights"), ("hf_causal", "HF causal, no document mask"))]  # fmt: skip
        lines.append(f"{name} / HF tokens/s: {ratio:.2f}x"
                     + "".join(f" (/ {label}: {value:.2f}x)" for label, value in others if value)
                     + f"; first-step loss {report['engines'][name]['losses'][0]:.5f} vs HF "
                     f"{report['engines']['hf']['losses'][0]:.5f} (|gap| {gap:.2e}, tolerance "
                     f"{report['loss_tolerance']:g})")  # fmt: skip
    for name, error in report.get("failed", {}).items():
        lines.append(f"{name}: FAILED {error}")
    return "\n".join(lines)


def _params(args: argparse.Namespace) -> int:
    """All parameters of the model preset, as ``jobs.plan`` counts them (when our engine did not run)."""
    from benchmarks.plan_vs_gpu import predict

    with tempfile.TemporaryDirectory(prefix="afm-sft-gpu-") as run_dir:
        cfg = compose(args, Path(run_dir))
    return int(predict(cfg, on_gpu=torch.cuda.is_available(), transformer_engine=False)["params"])


if __name__ == "__main__":
    sys.exit(main())
