"""Our Megatron SFT step vs Hugging Face transformers, side by side in one run: speed, peak memory, packing.

    .venv/bin/python -m benchmarks.sft_throughput                          # SmolLM2-135M at 1024 tokens
    .venv/bin/python -m benchmarks.sft_throughput --seq-length 1024 2048 4096 --out runs/bench/sft_throughput.json
    .venv/bin/python -m benchmarks.sft_throughput --model tiny-llama       # about a minute, mostly setup
    .venv/bin/python -m benchmarks.sft_throughput --profile                # + both top-20 torch.profiler op tables
    .venv/bin/python -m benchmarks.sft_throughput --recompute full         # ours with activation recomputation
    .venv/bin/python -m benchmarks.sft_throughput --seq-length 2048 4096 --one-engine-at-a-time 4096

Both engines train the same model (``ensure_hf_checkpoint``: the HF safetensors of the preset, fp32), from the
same weights, on the same global batches: two :class:`~afm_core.data.loader.TrainIterator` streams with one seed
over the real prepared CoA traces (``ensure_prepared(conf/data/coa_traces.yaml)``), tokenized with the
observation loss mask and packed first-fit-decreasing into ``--seq-length`` token sequences.

* **ours**: :meth:`afm_core.train.trainer.SFTTrainer.train_step` itself: ``get_forward_backward_func()`` over the
  micro batches of the global batch, masked per-token CE (:mod:`afm_core.train.loss`), megatron DDP grad
  buffers, megatron's optimizer (torch AdamW on CPU) with grad clipping, LR scheduler step. Attention: packed
  documents by ``cu_seqlens`` (``thd``) through :class:`afm_core.models.attention.SDPAttention` on megatron's
  local spec (fused SDPA per document, no dense mask), or transformer-engine's fused attention when installed.
  ``--recompute`` sets ``parallel.recompute`` (activation recomputation: memory for compute).
* **hf**: ``AutoModelForCausalLM`` (SDPA attention) given the same packed micro batch: position ids restarting
  per document and the block-causal mask as a 4-D boolean mask
  (:func:`afm_core.train.deepspeed_engine.per_token_cross_entropy`); loss = the same masked token mean over the
  global batch, backward per micro batch, ``clip_grad_norm_``, ``torch.optim.AdamW`` with megatron's weight-decay
  groups and LR schedule.

Each engine lives in a process of its own (spawned per sequence length), so its peak memory is its own: peak
resident set size (``VmHWM``) of the process, setup included (the same packed data in both), and the rise of the
peak over the resident size before the first step (what training itself adds). The engines never run at the same
time: each runs ``--warmup`` untimed steps, then ``--steps`` timed ones, alternating step by step and swapping
which goes first every step (ABBA), so load drift on a shared machine hits both alike. Both engine processes are
alive side by side, so the machine must hold both peaks at once; ``--one-engine-at-a-time`` (for the lengths it
names, e.g. 4096) runs ours to the end and lets its process exit before HF's starts, so only one is alive. That
loses the step-by-step pairing: the speed ratio is then the ratio of the two engines' median step times, taken
minutes apart, and load drift between the two halves goes straight into it. Reported: median step
time and throughput in input tokens/s (all ``global_batch * seq_length`` positions) and target tokens/s
(unmasked, trained tokens); the speed ratio ours/HF is the median over steps of the paired ratio
``hf_step_s / ours_step_s`` (same batch, adjacent in time). The losses of both engines on the first batch must
agree within ``LOSS_TOLERANCE`` (fp32, same weights and batch): past it the script exits with status 1.
``--profile`` runs one more step per engine under ``torch.profiler`` and prints (and with ``--out`` writes) the
top-20 ops by self CPU time of each. Packing efficiency is the non-pad share of all token slots of the train
split, packed vs one trajectory per sequence (:class:`~afm_core.data.packing.PackingStats`).

Precision is fp32 on both sides (on CUDA too); each engine uses ``--threads`` torch threads. The table title
shows the machine's 1-minute load average before and after the run: on a shared machine, read the ratios, not
the absolute tokens/s.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from afm_core.data.packing import PackedSequences, PackingStats
from afm_core.utils.atomic import atomic_write_json, atomic_write_text
from afm_core.utils.paths import repo_root

StepFn = Callable[[], dict[str, float]]
LOSS_TOLERANCE = 1e-4  # |ours - hf| masked token-mean loss on the first batch (nats), fp32
PROFILE_ROWS = 20


@dataclass
class EngineResult:
    """Timed steps of one engine (seconds per optimizer step, in step order), what it computed, its memory."""

    engine: str
    attention: str
    step_s: list[float]
    cpu_s: list[float]  # CPU seconds of the process (all its threads) per timed step
    input_tokens_per_step: int  # global_batch * seq_length positions
    target_tokens: list[int]  # unmasked target tokens of each timed step
    losses: list[float]  # masked token-mean loss of every step, warmup included
    peak_rss_bytes: int  # VmHWM of the engine's process
    setup_rss_bytes: int  # VmRSS after setup, before the first step
    profile: str | None = None  # top-ops table of one profiled step

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def input_tokens_per_s(self) -> float:
        return self.input_tokens_per_step / self.median_step_s

    @property
    def target_tokens_per_s(self) -> float:
        return statistics.median(self.target_tokens) / self.median_step_s

    @property
    def training_peak_bytes(self) -> int:
        return max(0, self.peak_rss_bytes - self.setup_rss_bytes)

    def summary(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "median_step_s": self.median_step_s,
            "input_tokens_per_s": self.input_tokens_per_s,
            "target_tokens_per_s": self.target_tokens_per_s,
            "training_peak_bytes": self.training_peak_bytes,
        }


def train_stream(data: Any, trainer_cfg: Any, *, dense_mask: bool) -> Any:
    """One rank's packed training micro batches of ``data`` (seed and micro batch size from ``trainer_cfg``)."""
    from afm_core.data.loader import TrainIterator

    seed, mbs = int(trainer_cfg.seed), int(trainer_cfg.micro_batch_size)
    return TrainIterator(data, seed=seed, micro_batch_size=mbs, dp_rank=0, dp_size=1, pack=True, dense_mask=dense_mask)


def _proc_status_bytes(field: str) -> int:
    """``VmHWM`` (peak resident set) or ``VmRSS`` of this process, in bytes (Linux ``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def compose_sft_config(args: argparse.Namespace, seq_length: int, run_dir: Path) -> Any:
    """``conf/sft.yaml`` composed with the benchmark's model, shapes and threads (fp32, no progress bar)."""
    from hydra import compose, initialize_config_dir

    from afm_core.config import register_schemas

    overrides = [
        f"model={args.model}",
        f"run_dir={run_dir}",
        f"trainer.seq_length={seq_length}",
        f"trainer.micro_batch_size={args.micro_batch}",
        f"trainer.global_batch_size={args.global_batch}",
        "trainer.precision=fp32",
        "trainer.progress=false",
        f"trainer.num_threads={'null' if args.threads is None else args.threads}",
        f"parallel.recompute={'null' if args.recompute == 'none' else args.recompute}",
    ]
    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        return compose(config_name="sft", overrides=overrides)


def join_single_process_group(cfg: Any, num_threads: int | None) -> Any:
    """World size 1 (TP = PP = DP = 1) on a free local port: the process group megatron's step needs."""
    from afm_core.engine.distributed import init_distributed
    from afm_core.utils.ports import free_port

    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )  # fmt: skip
    return init_distributed(cfg.parallel, seed=int(cfg.trainer.seed), num_threads=num_threads)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def megatron_step(
    cfg: Any, hf_dir: Path, data: PackedSequences, max_steps: int, threads: int | None
) -> tuple[StepFn, str]:
    """Our SFT step (``SFTTrainer.train_step``) on the GPTModel with the HF weights; and its attention kind."""
    from transformers import AutoConfig

    from afm_core.config.sft import sft_config
    from afm_core.engine.core import build_model_chunks
    from afm_core.engine.distributed import activation_memory_overrides
    from afm_core.models.gpt import build_gpt_model, mcore_config_from_hf, transformer_engine_available
    from afm_core.models.hf_weights import load_hf_weights
    from afm_core.train.trainer import SFTTrainer

    layout = join_single_process_group(cfg, threads)
    hf_config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    mcore_config = mcore_config_from_hf(
        hf_config, params_dtype=torch.float32, **activation_memory_overrides(cfg.parallel)
    )

    def provider(pre_process: bool, post_process: bool, vp_stage: int | None):
        return build_gpt_model(
            hf_config, mcore_config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
        ).to(layout.device)

    chunks = build_model_chunks(provider, layout)
    load_hf_weights(chunks, hf_dir)
    t = cfg.trainer
    stream = train_stream(data, t, dense_mask=False)
    trainer = SFTTrainer(sft_config(cfg).loop, layout, chunks, stream, [], cfg.run_dir, max_steps)
    if not trainer.thd_packing:
        raise RuntimeError("the model's attention does not read cu_seqlens: not the layer spec of models/gpt.py")
    attention = (
        "transformer-engine fused, thd (cu_seqlens)"
        if transformer_engine_available()
        else "megatron local spec + SDPAttention: fused SDPA per document (cu_seqlens, thd), no mask"
    )

    def step() -> dict[str, float]:
        out = trainer.train_step()
        synchronize(layout.device)
        return out

    return step, attention


def hf_step(cfg: Any, hf_dir: Path, data: PackedSequences, max_steps: int, threads: int | None) -> tuple[StepFn, str]:
    """HF forward + backward + AdamW on the same batches and loss; and its attention kind."""
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(int(cfg.trainer.seed))
    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    ).to(device)
    step = hf_train_step(model, cfg, data, max_steps, device)
    return step, f"HF {model.config._attn_implementation}, 4-D block-causal bool mask [b,1,s,s]"


def hf_train_step(
    model: Any,
    cfg: Any,
    data: PackedSequences,
    max_steps: int,
    device: torch.device,
    autocast: torch.dtype | None = None,
    dense_mask: bool = True,
) -> StepFn:
    """One optimizer step of the HF causal LM ``model`` (on ``device``) over the next global batch of ``data``
    (:func:`train_stream`, with the dense block-causal mask): the masked token-mean loss over the global batch,
    backward per micro batch, ``clip_grad_norm_``, fused ``torch.optim.AdamW`` with megatron's weight-decay groups
    and LR schedule. ``autocast``: the forward under ``torch.autocast`` in that dtype (HF Trainer's ``bf16=True``:
    fp32 weights and optimizer, bf16 matrix products). ``dense_mask=False``: no block-causal mask, each sequence
    one causal attention over its packed documents."""
    from afm_core.engine.optim import build_lr_scheduler
    from afm_core.train.deepspeed_engine import adamw_param_groups, per_token_cross_entropy
    from afm_core.train.loss import masked_token_loss

    t = cfg.trainer
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(  # fused: HF Trainer's default optimizer (adamw_torch_fused), as ours runs it
        adamw_param_groups(model, cfg.optim.weight_decay),
        lr=cfg.optim.lr,
        betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2),
        eps=cfg.optim.adam_eps,
        fused=True,
    )
    scheduler = build_lr_scheduler(optimizer, cfg.optim, max_steps)
    stream = train_stream(data, t, dense_mask=dense_mask)
    num_microbatches = int(t.global_batch_size) // int(t.micro_batch_size)

    def step() -> dict[str, float]:
        micro_batches = [next(stream) for _ in range(num_microbatches)]
        num_tokens = int(sum(int(b["loss_mask"].sum()) for b in micro_batches))
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for batch in micro_batches:  # HF reads packed documents from the 4-D mask (if there is one)
            with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
                per_token = per_token_cross_entropy(model, batch, device)
            micro_loss_sum, _, _ = masked_token_loss(batch["loss_mask"].to(device), per_token)
            (micro_loss_sum / num_tokens).backward()
            loss_sum += micro_loss_sum.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float(t.grad_clip))
        optimizer.step()
        scheduler.step(increment=1)
        synchronize(device)
        return {"loss": float(loss_sum) / num_tokens, "tokens": num_tokens, "grad_norm": float(grad_norm)}

    return step


def profile_step(step: StepFn) -> str:
    """One step under ``torch.profiler`` (CPU, plus CUDA when present): the top ops by self time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        step()
    sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=PROFILE_ROWS, max_name_column_width=60)


def engine_worker(conn: Any, engine: str, args: argparse.Namespace, seq_length: int, data: PackedSequences) -> None:
    """One engine in a process of its own: build it, then run the parent's commands ("step", "profile",
    "stop") and answer each; the last answer carries the process's memory figures."""
    try:
        from afm_core.utils.cpu_math import warm_vml
        from afm_core.utils.host_memory import configure_allocator

        configure_allocator()  # the SFT job's allocator settings, for both engines
        warm_vml()  # as every training rank does: exact unary ops from the first step on (afm_core.utils.cpu_math)
        with tempfile.TemporaryDirectory(prefix=f"afm-sft-throughput-{engine}-") as run_dir:
            cfg = compose_sft_config(args, seq_length, Path(run_dir))
            from afm_core.models.hf_checkpoint import ensure_hf_checkpoint

            hf_dir = ensure_hf_checkpoint(cfg.model)
            max_steps = args.warmup + args.steps + int(args.profile)
            build = megatron_step if engine == "ours" else hf_step
            step, attention = build(cfg, hf_dir, data, max_steps, args.threads)
            conn.send(
                {
                    "ready": attention,
                    "threads": torch.get_num_threads(),
                    "device": "cuda" if torch.cuda.is_available() else "cpu",
                }
            )
            setup_rss = _proc_status_bytes("VmRSS")
            while True:
                command = conn.recv()
                if command == "step":
                    start, cpu_start = time.perf_counter(), time.process_time()
                    out = step()
                    conn.send(
                        {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu_start, **out}
                    )
                elif command == "profile":
                    conn.send({"profile": profile_step(step)})
                else:
                    conn.send({"peak_rss_bytes": _proc_status_bytes("VmHWM"), "setup_rss_bytes": setup_rss})
                    break
    except BaseException as error:  # the parent reports it
        conn.send({"error": f"{engine}: {type(error).__name__}: {error}"})
        raise
    finally:
        from afm_core.engine.distributed import destroy_distributed

        if engine == "ours":
            destroy_distributed()


class EngineProcess:
    """The parent's handle on one :func:`engine_worker` process."""

    def __init__(self, engine: str, args: argparse.Namespace, seq_length: int, data: PackedSequences):
        context = mp.get_context("spawn")
        self.engine = engine
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=engine_worker, args=(child, engine, args, seq_length, data), name=f"sft-throughput-{engine}"
        )
        self.process.start()
        child.close()

    def ask(self, command: str | None = None) -> dict[str, Any]:
        if command is not None:
            self.conn.send(command)
        answer = self.conn.recv()
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def close(self) -> None:
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.terminate()


def run_side_by_side(engines: dict[str, EngineProcess], warmup: int, timed: int) -> dict[str, dict[str, list]]:
    """Alternate the engines step by step, swapping the order every step (ABBA); time the non-warmup steps.

    Returns per engine ``{"step_s": [timed seconds], "cpu_s": [their CPU seconds], "tokens": [timed target tokens],
    "losses": [all losses]}``.
    """
    names = list(engines)
    record: dict[str, dict[str, list]] = {
        name: {"step_s": [], "cpu_s": [], "tokens": [], "losses": []} for name in names
    }
    for index in range(warmup + timed):
        for name in names if index % 2 == 0 else reversed(names):
            out = engines[name].ask("step")
            record[name]["losses"].append(float(out["loss"]))
            if index >= warmup:
                record[name]["step_s"].append(out["seconds"])
                record[name]["cpu_s"].append(out["cpu_seconds"])
                record[name]["tokens"].append(int(out["tokens"]))
    return record


def _run_engines(
    names: tuple[str, ...], args: argparse.Namespace, seq_length: int, data: PackedSequences, console: Console
) -> tuple[dict[str, dict], dict[str, dict[str, list]], dict[str, str | None], dict[str, dict]]:
    """Start the engines ``names`` side by side, run their steps alternated (:func:`run_side_by_side`), the
    profiled step if asked, and stop them: ``(ready, record, profiles, memory)`` per engine."""
    engines = {name: EngineProcess(name, args, seq_length, data) for name in names}
    try:
        ready = {name: engine.ask() for name, engine in engines.items()}
        first = ready[names[0]]
        console.print(
            f"[sft_throughput] {args.model} on {first['device']}, {first['threads']} threads per engine"
            f" ({' + '.join(names)} alive): {args.warmup} warmup + {args.steps} timed steps each, "
            f"{args.global_batch} x {seq_length} tokens per step, micro batch {args.micro_batch}",
            markup=False,
        )
        record = run_side_by_side(engines, args.warmup, args.steps)
        profiles = {
            name: engine.ask("profile")["profile"] if args.profile else None for name, engine in engines.items()
        }
        memory = {name: engine.ask("stop") for name, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.close()
    return ready, record, profiles, memory


def measure(
    args: argparse.Namespace, seq_length: int, data: PackedSequences, console: Console
) -> tuple[EngineResult, EngineResult, float, dict[str, Any]]:
    """Both engines at one sequence length: results, speed ratio ours/HF, and the run's facts.

    Side by side (default): the ratio is the median of the paired per-step ratios. With
    ``--one-engine-at-a-time`` at this length, ours runs all its steps and exits before HF starts: the ratio is
    that of the two medians (no step pairing, so load drift between the two halves is not cancelled)."""
    alone = seq_length in args.one_engine_at_a_time
    ready, record, profiles, memory = {}, {}, {}, {}
    for names in (("ours",), ("hf",)) if alone else (("ours", "hf"),):
        parts = _run_engines(names, args, seq_length, data, console)
        for whole, part in zip((ready, record, profiles, memory), parts):
            whole.update(part)
    facts = {"threads": ready["ours"]["threads"], "device": ready["ours"]["device"], "one_engine_at_a_time": alone}
    ours, hf = (
        EngineResult(
            engine=name,
            attention=ready[name]["ready"],
            step_s=record[name]["step_s"],
            cpu_s=record[name]["cpu_s"],
            input_tokens_per_step=args.global_batch * seq_length,
            target_tokens=record[name]["tokens"],
            losses=record[name]["losses"],
            profile=profiles[name],
            **memory[name],
        )
        for name in ("ours", "hf")
    )
    if alone:
        ratio = hf.median_step_s / ours.median_step_s
    else:
        ratio = statistics.median(h / o for h, o in zip(hf.step_s, ours.step_s))
    return ours, hf, ratio, facts


def cpu_time_ratio(ours: EngineResult, hf: EngineResult, paired: bool = True) -> float:
    """Median over steps of the paired ratio of CPU seconds ``hf / ours`` (all threads of each process): less
    sensitive than wall time to other load on a shared machine, which delays a process without charging it CPU.
    Not ``paired`` (the engines ran one after the other): the ratio of the two medians."""
    if not paired:
        return statistics.median(hf.cpu_s) / statistics.median(ours.cpu_s)
    return statistics.median(h / o for h, o in zip(hf.cpu_s, ours.cpu_s))


def packing_table(stats: dict[int, tuple[PackingStats, PackingStats]], benchmark_lengths: list[int]) -> Table:
    table = Table(
        title="Packing on the real CoA traces (train split): packed (first-fit-decreasing) vs unpacked "
        "(one trajectory per sequence)"
    )
    for column in (
        "seq_length",
        "mode",
        "sequences",
        "docs / seq",
        "truncated",
        "efficiency (non-pad share)",
        "target share",
    ):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for seq_length, pair in sorted(stats.items()):
        for mode, s in zip(("packed", "unpacked"), pair):
            mark = " (benchmarked)" if seq_length in benchmark_lengths and mode == "packed" else ""
            docs = (s.num_examples - s.num_dropped) / s.num_sequences
            table.add_row(
                f"{seq_length}",
                mode + mark,
                f"{s.num_sequences:,}",
                f"{docs:.2f}",
                f"{s.num_truncated:,}",
                f"{s.efficiency:.1%}",
                f"{s.target_share:.1%}",
            )
    return table


def packing_summary(stats: PackingStats) -> dict[str, Any]:
    return {**asdict(stats), "efficiency": stats.efficiency, "target_share": stats.target_share}


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f}"


def throughput_table(
    rows: list[tuple[int, EngineResult, EngineResult, float]], title: str, alone: frozenset[int] = frozenset()
) -> Table:
    """The results table; a length in ``alone`` ran one engine at a time: its ratios are of medians, marked."""
    table = Table(title=title)
    for column in (
        "seq",
        "engine",
        "median step (s)",
        "input tok/s",
        "target tok/s",
        "speed ours/HF",
        "CPU-time ours/HF",
        "peak RSS (GiB)",
        "training peak (GiB)",
        "peak ours/HF",
        "loss, batch 1",
    ):
        table.add_column(column, justify="left" if column == "engine" else "right")
    for seq_length, ours, hf, ratio in rows:
        paired = seq_length not in alone
        mark = "" if paired else " (medians, alone)"
        memory_ratio = ours.peak_rss_bytes / hf.peak_rss_bytes
        for result in (ours, hf):
            is_ours = result is ours
            table.add_row(
                f"{seq_length}" if is_ours else "",
                result.engine,
                f"{result.median_step_s:.3f}",
                f"{result.input_tokens_per_s:,.0f}",
                f"{result.target_tokens_per_s:,.0f}",
                f"{ratio:.2f}x{mark}" if is_ours else "",
                f"{cpu_time_ratio(ours, hf, paired):.2f}x{mark}" if is_ours else "",
                _gib(result.peak_rss_bytes),
                _gib(result.training_peak_bytes),
                f"{memory_ratio:.2f}x" if is_ours else "",
                f"{result.losses[0]:.6f}",
                end_section=not is_ours,
            )
    return table


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="model preset of conf/model (tiny-llama: seconds)")
    parser.add_argument(
        "--seq-length",
        type=int,
        nargs="+",
        default=[1024],
        help="tokens per packed sequence, one measurement (and pair of processes) per value",
    )
    parser.add_argument("--micro-batch", type=int, default=1, help="packed sequences per micro batch")
    parser.add_argument(
        "--global-batch", type=int, default=1, help="packed sequences per optimizer step (a multiple of --micro-batch)"
    )
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per engine")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps per engine first")
    parser.add_argument(
        "--packing-lengths",
        type=int,
        nargs="+",
        default=[512, 1024, 2048, 4096],
        help="sequence lengths of the packing-efficiency table (--seq-length is always added)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all usable cores)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--recompute",
        choices=("none", "selective", "full"),
        default="none",
        help="our engine's activation recomputation (parallel.recompute)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help=f"profile one more step per engine: top-{PROFILE_ROWS} op tables (with --out: files)",
    )
    parser.add_argument(
        "--one-engine-at-a-time",
        type=int,
        nargs="*",
        default=None,
        metavar="SEQ",
        help="at these --seq-length values (all, if none given) ours runs all its steps and exits before HF "
        "starts, so only one engine's memory is alive (e.g. 4096 tokens on a small machine); the ratios are then "
        "of medians, not of paired steps",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    alone = args.one_engine_at_a_time
    if alone is not None and set(alone) - set(args.seq_length):
        parser.error(f"--one-engine-at-a-time {sorted(set(alone) - set(args.seq_length))}: not in --seq-length")
    args.one_engine_at_a_time = frozenset(() if alone is None else alone or args.seq_length)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if args.global_batch % args.micro_batch:
        parser.error(f"--global-batch {args.global_batch} is not a multiple of --micro-batch {args.micro_batch}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible to torch")
    if args.device == "cpu" and torch.cuda.is_available():
        parser.error(
            "--device cpu on a machine with a GPU: hide it with CUDA_VISIBLE_DEVICES= (megatron's device "
            "follows torch.cuda.is_available())"
        )
    return args


def main() -> int:
    from transformers import AutoTokenizer

    from afm_core.data.loader import read_sft_examples
    from afm_core.data.packing import pack_examples, pad_examples
    from afm_core.data.prepare import ensure_prepared
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint

    args = parse_args()
    console = Console(width=max(140, shutil.get_terminal_size().columns))
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="afm-sft-throughput-") as run_dir:
        cfg = compose_sft_config(args, args.seq_length[0], Path(run_dir))
    hf_dir = ensure_hf_checkpoint(cfg.model)
    data_dir = ensure_prepared(cfg.data)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    examples = read_sft_examples(
        [data_dir / "train.parquet"], tokenizer, mask_observations=bool(cfg.data.mask_observations)
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    packing = {
        length: (
            pack_examples(examples, length, pad_id=pad_id).stats,
            pad_examples(examples, length, pad_id=pad_id).stats,
        )
        for length in set(args.packing_lengths) | set(args.seq_length)
    }

    rows, facts = [], {}
    for seq_length in args.seq_length:
        ours, hf, ratio, facts = measure(args, seq_length, pack_examples(examples, seq_length, pad_id=pad_id), console)
        rows.append((seq_length, ours, hf, ratio))
    load_after = os.getloadavg()

    title = (
        f"SFT step: {args.model}, fp32 on {facts['device']}, {facts['threads']} threads per engine, "
        f"ours with recompute={args.recompute}, "
        f"{args.global_batch} x seq tokens per step, median of {args.steps} steps, each engine in its own "
        f"process (1-min load avg {load_before[0]:.1f} -> {load_after[0]:.1f})"
    )
    console.print(throughput_table(rows, title, args.one_engine_at_a_time))
    ours0, hf0 = rows[0][1], rows[0][2]
    console.print(f"attention  ours: {ours0.attention}\n           hf:   {hf0.attention}", markup=False)
    disagreements = []
    for seq_length, ours, hf, _ in rows:
        gap = abs(ours.losses[0] - hf.losses[0])
        console.print(
            f"seq {seq_length}: loss |ours - hf| on batch 1: {gap:.2e} (tolerance {LOSS_TOLERANCE:.0e})", markup=False
        )
        if not gap <= LOSS_TOLERANCE:
            disagreements.append(seq_length)
    console.print(packing_table(packing, args.seq_length))
    for seq_length, ours, hf, _ in rows:
        for result in (ours, hf) if args.profile else ():
            header = f"top-{PROFILE_ROWS} ops of one {result.engine} step at {seq_length} tokens"
            console.print(f"\n{header}\n{result.profile}", markup=False, soft_wrap=True)
            if args.out is not None:
                path = args.out.with_name(f"{args.out.stem}_profile_{result.engine}_{seq_length}.txt")
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(path, f"{header}\n{result.profile}\n")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            args.out,
            {
                "model": args.model,
                "device": facts["device"],
                "precision": "fp32",
                "threads": facts["threads"],
                "micro_batch": args.micro_batch,
                "global_batch": args.global_batch,
                "warmup": args.warmup,
                "steps": args.steps,
                "recompute": args.recompute,
                "load_avg_1min": {"before": load_before[0], "after": load_after[0]},
                "loss_tolerance": LOSS_TOLERANCE,
                "runs": [
                    {
                        "seq_length": seq_length,
                        "ratio_ours_over_hf": ratio,
                        "one_engine_at_a_time": seq_length in args.one_engine_at_a_time,
                        "cpu_time_ratio_ours_over_hf": cpu_time_ratio(
                            ours, hf, seq_length not in args.one_engine_at_a_time
                        ),
                        "peak_ratio_ours_over_hf": ours.peak_rss_bytes / hf.peak_rss_bytes,
                        "engines": {"ours": ours.summary(), "hf": hf.summary()},
                    }
                    for seq_length, ours, hf, ratio in rows
                ],
                "packing": {
                    str(length): {"packed": packing_summary(p), "unpacked": packing_summary(u)}
                    for length, (p, u) in sorted(packing.items())
                },
            },
        )
        console.print(f"wrote {args.out}")
    if disagreements:
        console.print(
            f"FAIL: the engines' first-batch losses differ by more than {LOSS_TOLERANCE:.0e} at seq "
            f"{disagreements}: they did not compute the same thing",
            markup=False,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
