"""Host time of our model's forward + backward where the kernels cost next to nothing: what a launch-bound GPU step
waits on (Python layer code, autograd, dispatch), measured on CPU for each way of compiling the layers.

    python -m benchmarks.layer_overhead                       # 28 layers (Qwen2.5-1.5B's count), width 64, 32 tokens
    python -m benchmarks.layer_overhead --layers 2 --steps 5  # a quick look

The GPU step of Qwen2.5-1.5B (``benchmarks/sft_gpu.py``, ``--profile``) keeps the device busy for ~70% of its wall
time: the rest is the host launching ~4,600 kernels through megatron's Python layer code. Here the model is
megatron's GPTModel with our layer spec (:func:`afm_core.models.gpt.build_gpt_model`) at the tiny-llama
preset's shape with ``--layers`` layers, the width cut to 64 (4 heads, 2 groups) and the vocabulary to 1024, the
CUDA fusions that run on a CPU on (megatron's compiled bias-dropout-add), one sequence of ``--tokens`` tokens,
fp32, one thread: each operation's arithmetic is a few microseconds, so the step time is the host's work.
Variants, each in a process of its own (compiling is process-wide): ``eager`` (``trainer.compile=false``),
``elementwise`` (``trainer.compile=true``: the norm, SwiGLU and RoPE compiled alone, today's CUDA default) and
``layers`` (``trainer.compile_layers=true``: :func:`afm_core.models.local_spec.compile_transformer_layers`).
Per variant: the median milliseconds of a forward + backward after ``--warmup`` steps, the aten operations
dispatched in one (``torch.profiler``; a compiled graph's fused kernels are not aten operations), and the ratio
to ``eager``. A proxy, not the GPU's figure: a CUDA launch adds ~5 us per kernel on top, which compiling removes
too; ``benchmarks.sft_gpu --engines ours ours-layers`` measures the real step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import torch

VARIANTS = ("eager", "elementwise", "layers")


def measure(variant: str, layers: int, tokens: int, warmup: int, steps: int) -> dict[str, Any]:
    """One variant in this (spawned) process: a world of one gloo rank set up as the trainer sets it up, the model,
    the timed steps."""
    from omegaconf import OmegaConf
    from torch.profiler import profile

    from afm_core.engine.distributed import destroy_distributed
    from afm_core.models.arch import hf_config_from_arch
    from afm_core.models.gpt import build_gpt_model, mcore_config_from_hf
    from afm_core.models.local_spec import compile_transformer_layers, set_compiled_elementwise
    from afm_core.models.presets import load_preset
    from benchmarks.sft_throughput import join_single_process_group

    join_single_process_group(OmegaConf.create({"parallel": {"tp": 1, "pp": 1}, "trainer": {"seed": 0}}), 1)
    try:
        arch = dataclasses.replace(
            load_preset("tiny-llama").arch,
            num_layers=layers,
            hidden_size=64,
            ffn_hidden_size=128,
            head_dim=16,
            vocab_size=1024,
        )
        hf_config = hf_config_from_arch(arch)
        config = mcore_config_from_hf(hf_config, tp=1, params_dtype=torch.float32)
        config.bias_dropout_fusion = True  # as on CUDA (gpt.platform_fusions)
        model = build_gpt_model(hf_config, config, pre_process=True, post_process=True)
        set_compiled_elementwise(variant == "elementwise")
        if variant == "layers":
            compile_transformer_layers([model])
        ids = torch.randint(0, arch.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(tokens)[None]

        def step() -> None:
            model(ids, positions, None, labels=ids).sum().backward()

        seconds = []
        for _ in range(warmup + steps):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
        with profile() as prof:
            step()
        ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    finally:
        destroy_distributed()
    return {"variant": variant, "ms": statistics.median(seconds[warmup:]) * 1e3, "aten_ops": ops}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = parser.parse_args(argv)
    rows = []
    with mp.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        for variant in args.variants:
            rows.append(pool.apply(measure, (variant, args.layers, args.tokens, args.warmup, args.steps)))
    base = next((r["ms"] for r in rows if r["variant"] == "eager"), None)
    print(f"forward + backward, {args.layers} layers, width 64, vocabulary 1024, {args.tokens} tokens, fp32, 1 thread")
    print("| variant | ms / step (median) | aten ops / step | host time vs eager |")
    print("|---|---|---|---|")
    for r in rows:
        r["vs_eager"] = r["ms"] / base if base else None
        ratio = f"{r['vs_eager']:.2f}x" if base else "-"
        print(f"| {r['variant']} | {r['ms']:.1f} | {r['aten_ops']:,} | {ratio} |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
