"""Our Megatron SFT step vs Hugging Face transformers, side by side in one run, plus packing efficiency.

    .venv/bin/python -m benchmarks.sft_throughput                        # SmolLM2-135M, a few minutes on 2 cores
    .venv/bin/python -m benchmarks.sft_throughput --model tiny-llama     # about a minute, mostly setup
    .venv/bin/python -m benchmarks.sft_throughput --out runs/bench/sft_throughput.json

Both engines train the same model (``ensure_hf_checkpoint``: the HF safetensors of the preset, fp32), from the
same weights, on the same global batches: two :class:`~afm_core.data.loader.TrainIterator` streams with one seed
over the real prepared CoA traces (``ensure_prepared(conf/data/coa_traces.yaml)``), tokenized with the
observation loss mask and packed first-fit-decreasing into ``--seq-length`` token sequences.

* **ours**: :meth:`afm_core.train.trainer.SFTTrainer.train_step` itself: ``get_forward_backward_func()`` over the
  micro batches of the global batch, masked per-token CE (:mod:`afm_core.train.loss`), megatron DDP grad
  buffers, megatron's optimizer (torch AdamW on CPU) with grad clipping, LR scheduler step. Attention is
  confined per document by the dense block-causal ``[b, 1, s, s]`` mask on megatron's local spec (unfused
  softmax), or by ``cu_seqlens`` (TE ``thd``) when transformer-engine is installed.
* **hf**: ``AutoModelForCausalLM`` (SDPA attention) given the same packed micro batch: position ids restarting
  per document and the same block-causal mask as a 4-D boolean mask
  (:func:`afm_core.train.deepspeed_engine.per_token_cross_entropy`); loss = the same masked token mean over the
  global batch, backward per micro batch, ``clip_grad_norm_``, ``torch.optim.AdamW`` with megatron's weight-decay
  groups and LR schedule.

Each engine runs ``--warmup`` untimed steps, then ``--steps`` timed ones; the engines alternate step by step and
swap which goes first every step (ABBA), so load drift on a shared machine hits both alike. Reported: median step
time (seconds) and throughput in input tokens/s (all ``global_batch * seq_length`` positions) and target
tokens/s (unmasked, trained tokens); the ratio ours/HF is the median over steps of the paired ratio
``hf_step_s / ours_step_s`` (same batch, adjacent in time). The losses of both engines on the first batch are
printed as a check that they computed the same thing (equal to ~1e-5 in fp32). Packing efficiency is the
non-pad share of all token slots of the train split, packed vs one trajectory per sequence
(:class:`~afm_core.data.packing.PackingStats`).

Precision is fp32 on both sides (on CUDA too); both share this process's torch threads (``--threads``). The table
title shows the machine's 1-minute load average before and after the run (this run's own threads count in it):
on a shared machine, read the ratio, not the absolute tokens/s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from afm_core.data.loader import TrainIterator, read_sft_examples
from afm_core.data.packing import PackedSequences, PackingStats, pack_examples, pad_examples
from afm_core.data.prepare import ensure_prepared
from afm_core.models.bridge import build_gpt_model, load_hf_weights, mcore_config_from_hf, transformer_engine_available
from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
from afm_core.train.deepspeed_engine import adamw_param_groups, per_token_cross_entropy
from afm_core.train.distributed import ParallelLayout, destroy_distributed, init_distributed
from afm_core.train.loss import masked_token_loss
from afm_core.train.optim import build_lr_scheduler
from afm_core.train.trainer import SFTTrainer, build_model_chunks
from afm_core.utils.atomic import atomic_write_json
from afm_core.utils.paths import repo_root

StepFn = Callable[[], dict[str, float]]


@dataclass
class EngineResult:
    """Timed steps of one engine (seconds per optimizer step, in step order) and what it computed."""

    engine: str
    attention: str
    step_s: list[float]
    input_tokens_per_step: int  # global_batch * seq_length positions
    target_tokens: list[int]  # unmasked target tokens of each timed step
    losses: list[float]  # masked token-mean loss of every step, warmup included

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def input_tokens_per_s(self) -> float:
        return self.input_tokens_per_step / self.median_step_s

    @property
    def target_tokens_per_s(self) -> float:
        return statistics.median(self.target_tokens) / self.median_step_s

    def summary(self) -> dict[str, Any]:
        return {**asdict(self), "median_step_s": self.median_step_s, "input_tokens_per_s": self.input_tokens_per_s,
                "target_tokens_per_s": self.target_tokens_per_s}


def compose_sft_config(args: argparse.Namespace, run_dir: Path) -> Any:
    """``conf/sft.yaml`` composed with the benchmark's model, shapes and threads (fp32, no progress bar)."""
    overrides = [
        f"model={args.model}", f"run_dir={run_dir}", f"trainer.seq_length={args.seq_length}",
        f"trainer.micro_batch_size={args.micro_batch}", f"trainer.global_batch_size={args.global_batch}",
        "trainer.precision=fp32", "trainer.progress=false",
        f"trainer.num_threads={'null' if args.threads is None else args.threads}",
    ]
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        return compose(config_name="sft", overrides=overrides)


def join_single_process_group(cfg: Any, num_threads: int | None) -> ParallelLayout:
    """World size 1 (TP = PP = DP = 1) on a free local port: the process group megatron's step needs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    return init_distributed(cfg.parallel, seed=int(cfg.trainer.seed), num_threads=num_threads)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def megatron_step(cfg: Any, layout: ParallelLayout, hf_dir: Path, data: PackedSequences, max_steps: int
                  ) -> tuple[StepFn, str]:
    """Our SFT step (``SFTTrainer.train_step``) on the GPTModel with the HF weights; and its attention kind."""
    hf_config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    mcore_config = mcore_config_from_hf(hf_config, params_dtype=torch.float32)

    def provider(pre_process: bool, post_process: bool, vp_stage: int | None):
        return build_gpt_model(hf_config, mcore_config, pre_process=pre_process, post_process=post_process,
                               vp_stage=vp_stage).to(layout.device)

    chunks = build_model_chunks(provider, layout)
    load_hf_weights(chunks, hf_dir)
    t = cfg.trainer
    stream = TrainIterator(data, seed=int(t.seed), micro_batch_size=int(t.micro_batch_size), dp_rank=0, dp_size=1,
                           pack=True)
    te = transformer_engine_available()
    trainer = SFTTrainer(cfg, layout, chunks, stream, [], cfg.run_dir, max_steps, thd_packing=te)
    attention = ("transformer-engine fused, thd (cu_seqlens)" if te
                 else "megatron local spec, dense block-causal mask [b,1,s,s], unfused softmax")

    def step() -> dict[str, float]:
        out = trainer.train_step()
        synchronize(layout.device)
        return out

    return step, attention


def hf_step(cfg: Any, layout: ParallelLayout, hf_dir: Path, data: PackedSequences, max_steps: int
            ) -> tuple[StepFn, str]:
    """HF forward + backward + AdamW on the same batches and loss; and its attention kind."""
    t = cfg.trainer
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                 local_files_only=True).to(layout.device)
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(adamw_param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                  betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2), eps=cfg.optim.adam_eps)
    scheduler = build_lr_scheduler(optimizer, cfg.optim, max_steps)
    stream = TrainIterator(data, seed=int(t.seed), micro_batch_size=int(t.micro_batch_size), dp_rank=0, dp_size=1,
                           pack=True)
    num_microbatches = int(t.global_batch_size) // int(t.micro_batch_size)

    def step() -> dict[str, float]:
        micro_batches = [next(stream) for _ in range(num_microbatches)]
        num_tokens = int(sum(int(b["num_target_tokens"]) for b in micro_batches))
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for batch in micro_batches:
            per_token = per_token_cross_entropy(model, batch, layout.device)
            micro_loss_sum, _, _ = masked_token_loss(batch["loss_mask"].to(layout.device), per_token)
            (micro_loss_sum / num_tokens).backward()
            loss_sum += float(micro_loss_sum.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float(t.grad_clip))
        optimizer.step()
        scheduler.step(increment=1)
        synchronize(layout.device)
        return {"loss": loss_sum / num_tokens, "tokens": num_tokens, "grad_norm": float(grad_norm)}

    return step, f"HF {model.config._attn_implementation}, 4-D block-causal bool mask [b,1,s,s]"


def run_side_by_side(steps: dict[str, StepFn], warmup: int, timed: int) -> dict[str, dict[str, list]]:
    """Alternate the engines step by step, swapping the order every step (ABBA); time the non-warmup steps.

    Returns per engine ``{"step_s": [timed seconds], "tokens": [timed target tokens], "losses": [all losses]}``.
    """
    names = list(steps)
    record: dict[str, dict[str, list]] = {name: {"step_s": [], "tokens": [], "losses": []} for name in names}
    for index in range(warmup + timed):
        for name in names if index % 2 == 0 else reversed(names):
            start = time.perf_counter()
            out = steps[name]()
            seconds = time.perf_counter() - start
            record[name]["losses"].append(float(out["loss"]))
            if index >= warmup:
                record[name]["step_s"].append(seconds)
                record[name]["tokens"].append(int(out["tokens"]))
    return record


def packing_table(stats: dict[int, tuple[PackingStats, PackingStats]], benchmark_length: int) -> Table:
    table = Table(title="Packing on the real CoA traces (train split): packed (first-fit-decreasing) vs unpacked "
                        "(one trajectory per sequence)")
    for column in ("seq_length", "mode", "sequences", "docs / seq", "truncated", "efficiency (non-pad share)",
                   "target share"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for seq_length, pair in sorted(stats.items()):
        for mode, s in zip(("packed", "unpacked"), pair):
            mark = " (benchmarked)" if seq_length == benchmark_length and mode == "packed" else ""
            docs = (s.num_examples - s.num_dropped) / s.num_sequences
            table.add_row(f"{seq_length}", mode + mark, f"{s.num_sequences:,}", f"{docs:.2f}", f"{s.num_truncated:,}",
                          f"{s.efficiency:.1%}", f"{s.target_share:.1%}")
    return table


def packing_summary(stats: PackingStats) -> dict[str, Any]:
    return {**asdict(stats), "efficiency": stats.efficiency, "target_share": stats.target_share}


def throughput_table(ours: EngineResult, hf: EngineResult, ratio: float, title: str) -> Table:
    table = Table(title=title)
    for column in ("engine", "median step (s)", "input tokens/s", "target tokens/s", "loss, batch 1"):
        table.add_column(column, justify="left" if column == "engine" else "right")
    for result in (ours, hf):
        table.add_row(result.engine, f"{result.median_step_s:.3f}", f"{result.input_tokens_per_s:,.0f}",
                      f"{result.target_tokens_per_s:,.0f}", f"{result.losses[0]:.6f}")
    table.add_row("ratio ours/HF", "", f"{ratio:.2f}x", f"{ratio:.2f}x", "", end_section=True)
    return table


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="model preset of conf/model (tiny-llama: seconds)")
    parser.add_argument("--seq-length", type=int, default=1024,
                        help="tokens per packed sequence (at 512 most CoA traces are truncated, one per sequence)")
    parser.add_argument("--micro-batch", type=int, default=1, help="packed sequences per micro batch")
    parser.add_argument("--global-batch", type=int, default=1,
                        help="packed sequences per optimizer step (a multiple of --micro-batch)")
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per engine")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps per engine first")
    parser.add_argument("--packing-lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                        help="sequence lengths of the packing-efficiency table (--seq-length is always added)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all usable cores)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if args.global_batch % args.micro_batch:
        parser.error(f"--global-batch {args.global_batch} is not a multiple of --micro-batch {args.micro_batch}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible to torch")
    if args.device == "cpu" and torch.cuda.is_available():
        parser.error("--device cpu on a machine with a GPU: hide it with CUDA_VISIBLE_DEVICES= (megatron's device "
                     "follows torch.cuda.is_available())")
    return args


def main() -> None:
    args = parse_args()
    console = Console(width=max(120, shutil.get_terminal_size().columns))
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="afm-sft-throughput-") as run_dir:
        cfg = compose_sft_config(args, Path(run_dir))
        hf_dir = ensure_hf_checkpoint(cfg.model)
        data_dir = ensure_prepared(cfg.data)
        tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
        examples = read_sft_examples([data_dir / "train.parquet"], tokenizer,
                                     mask_observations=bool(cfg.data.mask_observations))
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        packed = pack_examples(examples, args.seq_length, pad_id=pad_id)
        packing = {length: (pack_examples(examples, length, pad_id=pad_id).stats,
                            pad_examples(examples, length, pad_id=pad_id).stats)
                   for length in set(args.packing_lengths) - {args.seq_length}}
        packing[args.seq_length] = (packed.stats, pad_examples(examples, args.seq_length, pad_id=pad_id).stats)

        max_steps = args.warmup + args.steps
        layout = join_single_process_group(cfg, args.threads)
        try:
            ours_step, ours_attention = megatron_step(cfg, layout, hf_dir, packed, max_steps)
            hf_train_step, hf_attention = hf_step(cfg, layout, hf_dir, packed, max_steps)
            console.print(f"[sft_throughput] {args.model} on {layout.device.type}, {torch.get_num_threads()} "
                          f"threads: {args.warmup} warmup + {args.steps} timed steps per engine, "
                          f"{args.global_batch} x {args.seq_length} tokens per step, micro batch {args.micro_batch}",
                          markup=False)
            record = run_side_by_side({"ours": ours_step, "hf": hf_train_step}, args.warmup, args.steps)
        finally:
            destroy_distributed()
    load_after = os.getloadavg()

    input_tokens = args.global_batch * args.seq_length
    ours, hf = (EngineResult(engine=name, attention=attention, step_s=record[name]["step_s"],
                             input_tokens_per_step=input_tokens, target_tokens=record[name]["tokens"],
                             losses=record[name]["losses"])
                for name, attention in (("ours", ours_attention), ("hf", hf_attention)))
    ratio = statistics.median(h / o for h, o in zip(hf.step_s, ours.step_s))
    title = (f"SFT step throughput: {args.model}, fp32 on {layout.device.type}, {torch.get_num_threads()} threads, "
             f"median of {args.steps} steps (1-min load avg {load_before[0]:.1f} -> {load_after[0]:.1f})")
    console.print(throughput_table(ours, hf, ratio, title))
    console.print(f"attention  ours: {ours.attention}\n           hf:   {hf.attention}\n"
                  f"loss |ours - hf| on batch 1: {abs(ours.losses[0] - hf.losses[0]):.2e} (same weights, batch, masks)",
                  markup=False)
    console.print(packing_table(packing, args.seq_length))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out, {
            "model": args.model, "device": layout.device.type, "precision": "fp32",
            "threads": torch.get_num_threads(), "seq_length": args.seq_length, "micro_batch": args.micro_batch,
            "global_batch": args.global_batch, "warmup": args.warmup, "steps": args.steps,
            "load_avg_1min": {"before": load_before[0], "after": load_after[0]},
            "engines": {"ours": ours.summary(), "hf": hf.summary()}, "ratio_ours_over_hf": ratio,
            "packing": {str(length): {"packed": packing_summary(p), "unpacked": packing_summary(u)}
                        for length, (p, u) in sorted(packing.items())},
        })
        console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
