"""``jobs.plan``'s GPU memory prediction next to a real training step of our trainer, on one GPU.

    python -m benchmarks.plan_vs_gpu --model qwen2.5-1.5b-instruct qwen2.5-3b-instruct --seq-length 4096 \
        --recompute none full --out runs/bench/plan_vs_gpu.json                        # one GPU (bf16)
    python -m benchmarks.plan_vs_gpu --model tiny-llama --seq-length 128 --steps 2   # CPU: a dry run, no memory
    python -m benchmarks.plan_vs_gpu --replan runs/bench/plan_vs_gpu.json     # stored measurements, current plan

For each model preset (``conf/model``: the published shape, random weights, nothing downloaded) and each
``parallel.recompute`` setting, at world size 1 (TP = PP = DP = 1), ``conf/sft.yaml`` is composed with the same
overrides for both sides:

* **predicted**: :func:`afm_core.launch.plan_estimates.training_plan` of that config (what ``python -m jobs.plan`` prints:
  model states built on the meta device, activations and logits from :mod:`afm_core.engine.memory`'s formula) for
  the stack measured: the layout's ``transformer_engine`` is whether transformer-engine imports here (without it
  the local layer spec and megatron's native fused cross entropy run);
* **measured**: the SFT job's own path: ``init_distributed`` (NCCL on GPU), the GPTModel chunks of
  ``mcore_config_from_hf`` + ``build_gpt_model`` (bf16 on GPU), :class:`~afm_core.train.trainer.SFTTrainer` and
  ``--steps`` calls of its ``train_step`` over synthetic packed sequences (``--docs`` documents each, random
  tokens) fed through the real :class:`~afm_core.data.loader.TrainIterator` (``thd`` packing).

Measured on CUDA, in bytes of torch's caching allocator (``torch.cuda.memory_allocated`` /
``max_memory_allocated``), as rows of the table (ratio = measured / predicted):

  params          allocated once the chunks are built
  grads + master  the rise when ``SFTTrainer`` wraps them (megatron DDP's fp32 grad buffer, the optimizer's fp32
                  main weights)
  Adam moments    the rise over the first optimizer step (allocated lazily at that step)
  model states    allocated after the first step (the three above)
  activations + logits  peak of forward + backward (steps 2 on) over what was allocated when the step began
  optimizer step  peak of ``optimizer.step()`` (clip, AdamW, copy to bf16) over the model states (the plan counts 0)
  train peak      ``max_memory_allocated`` over steps 2 on, against the plan's per-rank ``train`` bytes
  device peak     ``max_memory_reserved`` plus what the process holds beyond its allocator (``cudaMemGetInfo``:
                  CUDA context, cuBLAS/NCCL workspaces), against ``train`` + ``GPU_OVERHEAD_BYTES``

``--adamw foreach`` runs torch AdamW's default multi-tensor path instead of the fused kernel the trainer sets, to
show what :func:`afm_core.engine.optim.use_fused_adamw` saves in the optimizer step.

Step time: wall seconds of ``train_step`` with the device synchronised, median of steps 2 on (step 1 compiles the
fused kernels); tokens/s = ``global_batch * seq_length`` / step time, and the model TFLOP/s ``6 N`` per token.
Prints a table per config (GiB) and writes all figures as JSON to ``--out`` after each config. On CPU the plan and
the steps run (a dry run of this script), with no memory figures. ``--replan FILE`` compares the measurements of
an earlier ``--out`` with the plan as it is now, on any machine (a formula change checked without a GPU).

Figures (H200, torch 2.11, megatron-core 0.16.1, no transformer-engine, 4 documents per sequence, 2 micro batches
of 4096 tokens per step): every ratio measured / predicted within 0.96-1.01 for Qwen2.5-1.5B and 3B, recompute
none and full; 7215 / 6295 tokens/s (1.5B, none / full), 5726 / 5547 (3B).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from afm_core.utils.atomic import atomic_write_json

GIB = 1024**3


def synthetic_packed(n: int, seq_length: int, docs: int, vocab_size: int, seed: int = 0) -> Any:
    """``n`` packed sequences of ``docs`` documents each (random lengths filling ``seq_length``, random tokens,
    every token trained except each document's first), as :class:`~afm_core.data.packing.PackedSequences`."""
    from afm_core.data.packing import PackedSequences, PackingStats

    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, vocab_size, size=(n, seq_length), dtype=np.int32)
    labels = input_ids.copy()
    position_ids: np.ndarray = np.empty((n, seq_length), dtype=np.int32)
    cu_seqlens = []
    for row in range(n):
        cuts = np.sort(rng.choice(np.arange(1, seq_length), size=docs - 1, replace=False)) if docs > 1 else []
        offsets = np.array([0, *cuts, seq_length], dtype=np.int32)
        for a, e in itertools.pairwise(offsets):
            position_ids[row, a:e] = np.arange(e - a)
            labels[row, a] = -100
        cu_seqlens.append(offsets)
    tokens = n * seq_length
    stats = PackingStats(n * docs, n, 0, 0, tokens, int((labels != -100).sum()), tokens)
    return PackedSequences(input_ids, labels, position_ids, cu_seqlens, stats)


def compose_config(model: str, seq_length: int, recompute: str, micro_batch: int, global_batch: int, steps: int,
                   run_dir: Path) -> Any:  # fmt: skip
    """``conf/sft.yaml`` with the benchmark's model, shapes and recompute setting (precision ``auto``)."""
    from afm_core.launch.plan import compose

    return compose(
        "sft",
        [
            f"model={model}",
            f"run_dir={run_dir}",
            f"trainer.seq_length={seq_length}",
            f"trainer.micro_batch_size={micro_batch}",
            f"trainer.global_batch_size={global_batch}",
            f"trainer.max_steps={steps}",
            "trainer.progress=false",
            f"parallel.recompute={'null' if recompute == 'none' else recompute}",
        ],
    )


def predict(cfg: Any, *, on_gpu: bool, transformer_engine: bool) -> dict[str, Any]:
    """The plan's row for the (single) stage of ``cfg`` on the stack measured: GPU or not, with transformer-engine
    or not (its layer spec and cross entropy, :func:`afm_core.engine.memory.activations`), and the layout used."""
    from omegaconf import OmegaConf

    from afm_core.config import check_config
    from afm_core.config.sft import SFTConfig
    from afm_core.launch.plan import hf_config_of, layout_of
    from afm_core.launch.plan_estimates import GPU_OVERHEAD_BYTES, training_plan

    plain = OmegaConf.to_container(cfg, resolve=False)
    layout = layout_of(check_config(cfg, SFTConfig))  # the driver's GPU list, which a VM may not expose: set from torch
    bf16 = plain["trainer"]["precision"] == "bf16" or (plain["trainer"]["precision"] == "auto" and on_gpu)
    layout = replace(layout, on_gpu=on_gpu, bf16=bf16, transformer_engine=transformer_engine)
    hf_config = hf_config_of(plain["model"])
    (row,) = training_plan(hf_config, layout)
    return {
        "row": row,
        "layout": {**layout.__dict__},
        "params": row["params"],
        "hf_config": hf_config,
        "overhead_bytes": GPU_OVERHEAD_BYTES,
    }


class Memory:
    """CUDA allocator readings relative to a baseline (all zeros without CUDA)."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.sync()
        self.base = torch.cuda.memory_allocated() if self.cuda else 0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def allocated(self) -> int:
        self.sync()
        return torch.cuda.memory_allocated() - self.base if self.cuda else 0

    def peak(self) -> int:
        self.sync()
        return torch.cuda.max_memory_allocated() - self.base if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            self.sync()
            torch.cuda.reset_peak_memory_stats()

    def outside_allocator(self) -> int:
        """Device bytes this process uses beyond its allocator's reservation (context, workspaces, NCCL)."""
        if not self.cuda:
            return 0
        free, total = torch.cuda.mem_get_info()
        return total - free - torch.cuda.memory_reserved()


def measure(
    cfg: Any,
    steps: int,
    docs: int,
    hf_config: Any,
    adamw: str,
    data: Any = None,
    threads: int | None = None,
    hf_dir: Path | None = None,
    after: Any = None,
) -> dict[str, Any]:
    """Build the model and run ``steps`` SFT steps the SFT job's way; memory readings (bytes) and step times.
    ``adamw="foreach"``: torch AdamW's default implementation instead of the fused one the trainer sets
    (:func:`afm_core.engine.optim.use_fused_adamw`), to show what that choice saves. ``data``: the packed sequences
    to train on (default: :func:`synthetic_packed`, ``docs`` documents per sequence); ``hf_dir``: an HF checkpoint
    loaded into the model (default: megatron's random initialisation); ``after(trainer, sync) -> dict``: called
    after the measured steps with the :class:`~afm_core.train.trainer.SFTTrainer` and a device sync, its result in
    ``"after"``."""
    from afm_core.config.sft import sft_config
    from afm_core.engine.core import build_model
    from afm_core.engine.distributed import activation_memory_overrides, training_dtype
    from afm_core.models.arch import arch_from_hf_config
    from afm_core.train.trainer import SFTTrainer
    from benchmarks.sft_throughput import join_single_process_group, train_stream

    t, p = cfg.trainer, cfg.parallel
    layout = join_single_process_group(cfg, threads)
    mem = Memory()
    chunks = build_model(hf_config, layout, params_dtype=training_dtype(t.precision), **activation_memory_overrides(p))
    if hf_dir is not None:
        from afm_core.models.hf_weights import load_hf_weights

        load_hf_weights(chunks, hf_dir)
    built = mem.allocated()
    if data is None:
        data = synthetic_packed(8, int(t.seq_length), docs, arch_from_hf_config(hf_config).vocab_size)
    stream = train_stream(data, t, dense_mask=False)
    trainer = SFTTrainer(sft_config(cfg).loop, layout, chunks, stream, [], cfg.run_dir, int(t.max_steps))
    wrapped = mem.allocated()
    if adamw == "foreach":
        for chained in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
            for group in chained.optimizer.param_groups:
                group["fused"], group["foreach"] = False, True

    phases: dict[str, int] = {}
    inner_step = trainer.optimizer.step

    def step_with_readings() -> Any:  # the peak of forward+backward, then of the optimizer step alone
        phases["fwd_bwd_peak"] = mem.peak()
        phases["before_optimizer"] = mem.allocated()
        mem.reset_peak()
        out = inner_step()
        phases["optimizer_peak"] = mem.peak()
        return out

    trainer.optimizer.step = step_with_readings
    records = []
    for i in range(steps):
        start_alloc = mem.allocated()
        mem.reset_peak()
        start = time.perf_counter()
        out = trainer.train_step()
        mem.sync()
        seconds = time.perf_counter() - start
        records.append(
            {
                "step": i + 1,
                "seconds": seconds,
                "loss": float(out["loss"]),
                "start_allocated": start_alloc,
                "end_allocated": mem.allocated(),
                **phases,
                "reserved_peak": torch.cuda.max_memory_reserved() if mem.cuda else 0,
                "outside_allocator": mem.outside_allocator(),
            }
        )
        print(f"  step {i + 1}: {seconds:.3f} s, loss {float(out['loss']):.4f}", flush=True)
    trainer.optimizer.step = inner_step
    extra = after(trainer, mem.sync) if after is not None else None
    thd = trainer.thd_packing
    del trainer, chunks, stream
    return {"built": built, "wrapped": wrapped, "steps": records, "thd_packing": thd, "device": str(layout.device),
            "after": extra}  # fmt: skip


def compare(pred: dict[str, Any], meas: dict[str, Any], global_batch: int, seq_length: int) -> dict[str, Any]:
    """Rows ``(name, measured bytes, predicted bytes)`` and the step timing."""
    row, steps = pred["row"], meas["steps"]
    steady = steps[1:] or steps
    states = steps[0]["end_allocated"]
    act = max(s["fwd_bwd_peak"] - s["start_allocated"] for s in steady)
    rows = [
        ("params", meas["built"], row["param_bytes"]),
        ("grads + master", meas["wrapped"] - meas["built"], row["grad_bytes"] + row["master_bytes"]),
        ("Adam moments", states - meas["wrapped"], row["optimizer_bytes"] - row["master_bytes"]),
        ("model states", states, row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"]),
        ("activations + logits", act, row["activations_bytes"] + row["logits_bytes"]),
        ("optimizer step", max(s["optimizer_peak"] - s["before_optimizer"] for s in steady), 0),
        ("train peak", max(max(s["fwd_bwd_peak"], s["optimizer_peak"]) for s in steady), row["train_bytes"]),
        (
            "device peak",
            max(s["reserved_peak"] + s["outside_allocator"] for s in steady),
            row["train_bytes"] + pred["overhead_bytes"],
        ),
    ]
    step_s = statistics.median(s["seconds"] for s in steady)
    tokens = global_batch * seq_length
    return {
        "rows": [{"name": n, "measured": m, "predicted": p, "ratio": m / p if p else None} for n, m, p in rows],
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "model_tflops": 6 * pred["params"] * tokens / step_s / 1e12,
    }


def render(title: str, result: dict[str, Any]) -> str:
    lines = [title, f"  {'':36} {'measured':>10} {'predicted':>10} {'ratio':>7}  GiB"]
    for r in result["rows"]:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"  {r['name']:36} {r['measured'] / GIB:10.2f} {r['predicted'] / GIB:10.2f} {ratio:>7}")
    lines.append(
        f"  step {result['step_s']:.3f} s (median of steps 2 on): {result['tokens_per_s']:,.0f} tokens/s, "
        f"{result['model_tflops']:.0f} model TFLOP/s (6N per token)"
    )
    return "\n".join(lines)


def title_of(model: str, recompute: str, adamw: str, layout: dict[str, Any], params: int, device: str) -> str:
    return (
        f"{model}, seq {layout['seq_length']} x micro batch {layout['micro_batch_size']}, "
        f"{layout['num_microbatches']} micro batches/step, recompute {recompute}, "
        f"{'bf16' if layout['bf16'] else 'fp32'} on {device}, {params / 1e9:.2f}B params, "
        f"transformer-engine {layout['transformer_engine']}" + (", torch AdamW foreach" if adamw == "foreach" else "")
    )


def report(model: str, recompute: str, adamw: str, pred: dict[str, Any], meas: dict[str, Any]) -> dict[str, Any]:
    """Compare, print the table, and return the JSON record of one config."""
    layout = pred["layout"]
    result = compare(pred, meas, layout["num_microbatches"] * layout["micro_batch_size"], layout["seq_length"])
    title = title_of(model, recompute, adamw, layout, pred["params"], meas["device"])
    print(render(title, result), flush=True)
    plan_row = {k: v for k, v in pred["row"].items() if k != "gib"}
    return {"model": model, "recompute": recompute, "adamw": adamw, "title": title, **result, "plan": plan_row,
            "layout": layout, "measured": meas}  # fmt: skip


def run_one(args: argparse.Namespace, model: str, recompute: str) -> dict[str, Any]:
    from afm_core.engine.distributed import destroy_distributed
    from afm_core.models.gpt import transformer_engine_available

    with tempfile.TemporaryDirectory(prefix="afm-plan-vs-gpu-") as run_dir:
        cfg = compose_config(
            model, args.seq_length, recompute, args.micro_batch, args.global_batch, args.steps, Path(run_dir)
        )
        pred = predict(cfg, on_gpu=torch.cuda.is_available(), transformer_engine=transformer_engine_available())
        try:
            meas = measure(cfg, args.steps, args.docs, pred["hf_config"], args.adamw)
        finally:
            destroy_distributed()
    return report(model, recompute, args.adamw, pred, meas)


def _shape_of(record: dict[str, Any]) -> tuple[int, int, int, bool]:
    """``(seq_length, micro_batch_size, num_microbatches, transformer_engine)`` of a stored record (from its
    layout, or from the title of a record written before the layout was stored)."""
    if "layout" in record:
        lay = record["layout"]
        return lay["seq_length"], lay["micro_batch_size"], lay["num_microbatches"], lay["transformer_engine"]
    parts = record["title"].split(", ")  # "<model>, seq S x micro batch B, M micro batches/step, ..., TE False, ..."
    seq, micro = parts[1].removeprefix("seq ").split(" x micro batch ")
    return int(seq), int(micro), int(parts[2].split()[0]), "TE True" in record["title"]


def replan(path: Path) -> list[dict[str, Any]]:
    """The measurements stored in ``path`` (this script's ``--out``) against the current plan (no GPU needed)."""
    results = []
    for old in json.loads(path.read_text()):
        if "measured" not in old:
            continue
        meas = old["measured"]
        seq_length, micro_batch, mbs, te = _shape_of(old)
        with tempfile.TemporaryDirectory(prefix="afm-plan-vs-gpu-") as run_dir:
            cfg = compose_config(old["model"], seq_length, old["recompute"], micro_batch, mbs * micro_batch,
                                 len(meas["steps"]), Path(run_dir))  # fmt: skip
            pred = predict(cfg, on_gpu=meas["device"].startswith("cuda"), transformer_engine=te)
        results.append(report(old["model"], old["recompute"], old.get("adamw", "trainer"), pred, meas))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", default=["qwen2.5-1.5b-instruct", "qwen2.5-3b-instruct"])
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--recompute", nargs="+", default=["none", "full"], choices=["none", "selective", "full"])
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="train steps per config (the first is not timed)")
    parser.add_argument("--docs", type=int, default=4, help="documents per packed sequence")
    parser.add_argument(
        "--adamw", choices=["trainer", "foreach"], default="trainer", help="foreach: torch's default AdamW path"
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON of every figure, rewritten after each config")
    parser.add_argument(
        "--replan", type=Path, default=None, help="an --out JSON: its measurements against the current plan (CPU)"
    )
    args = parser.parse_args()
    if args.replan:
        results = replan(args.replan)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(args.out, results)
        return 0
    if torch.cuda.is_available():
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    results, failed = [], 0
    for model in args.model:
        for recompute in args.recompute:
            try:
                results.append(run_one(args, model, recompute))
            except Exception:  # one config's failure (an OOM, say) must not lose the others' figures
                failed += 1
                results.append({"model": model, "recompute": recompute, "error": traceback.format_exc()})
                traceback.print_exc()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(args.out, results)
    print("\nsummary (measured / predicted, GiB)", flush=True)
    for r in results:
        print(render(r["title"], r) if "rows" in r else f"{r['model']}, recompute {r['recompute']}: FAILED", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
