"""``run_sft(cfg)``: observation-masked agentic SFT, the entry point every rank of the SFT job runs.

The job layer (``jobs.sft`` through submitit) exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT and calls :func:`run_sft` on each rank with the composed ``conf/sft.yaml``. Steps:

1. the HF checkpoint of ``cfg.model`` (``ensure_hf_checkpoint``: SmolLM2-135M converted from its GGUF once)
   and the prepared CoA trajectories of ``cfg.data`` (``ensure_prepared``: train / held-out parquet);
2. tokenization with the observation loss mask and packing into ``trainer.seq_length`` sequences
   (``SFTDataModule``), done once by the first rank and cached next to the prepared parquet: the other ranks
   and a requeued or resumed job memory-map the cached arrays;
3. ``trainer.engine=megatron`` (default): megatron parallel state (TP/PP/DP), the GPTModel chunks of this
   rank with the HF weights loaded (mbridge), then :class:`~afm_core.train.trainer.SFTTrainer` (resume from
   the latest complete checkpoint of ``run_dir``, or of ``resume``); ``trainer.engine=deepspeed``: ZeRO-3 on the
   HF model (:mod:`afm_core.train.deepspeed_engine`), same loop and outputs;
4. the HF safetensors export to ``RUN_DIR/hf`` and a summary printed by rank 0.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from afm_core.config.sft import ENGINES
from afm_core.data.loader import full_micro_batches

log = logging.getLogger(__name__)


def resolve_max_steps(trainer: Any, num_train_sequences: int) -> int:
    """``trainer.max_steps``, else ``trainer.epochs * (train sequences // global_batch_size)``.

    Raises:
        ValueError: both are null, or the result is below 1.
    """
    if trainer.max_steps is not None:
        steps = int(trainer.max_steps)
    elif trainer.epochs is not None:
        steps = int(trainer.epochs * (num_train_sequences // trainer.global_batch_size))
    else:
        raise ValueError("set trainer.max_steps or trainer.epochs")
    if steps < 1:
        raise ValueError(
            f"the run has {steps} optimizer steps (trainer.max_steps={trainer.max_steps}, "
            f"trainer.epochs={trainer.epochs}, {num_train_sequences} train sequences, "
            f"trainer.global_batch_size={trainer.global_batch_size})"
        )
    return steps


def needs_dense_mask(cfg: DictConfig) -> bool:
    """Whether packed micro batches must carry the dense ``[b, 1, s, s]`` block-causal mask: for the DeepSpeed
    engine (HF attention takes a 4-D mask) and for Megatron's local spec unless its core attention reads
    ``packed_seq_params`` (``cu_seqlens``); never on transformer-engine (``thd``)."""
    if not cfg.data.pack:
        return False
    if cfg.trainer.engine == "deepspeed":
        return True
    from afm_core.models import gpt

    if gpt.transformer_engine_available():
        return False
    return not getattr(gpt, "LOCAL_ATTENTION_READS_CU_SEQLENS", False)


def _data_module(cfg: DictConfig, hf_dir: Path):
    from afm_core.data.loader import SFTDataModule
    from afm_core.data.prepare import ensure_prepared

    data_dir = ensure_prepared(cfg.data)
    if cfg.trainer.get("objective", "sft") == "contrastive":  # AutoCoA stage 1: pairs built from the trajectories
        from afm_core.data.pairs import PairDataModule

        c = cfg.contrastive
        return PairDataModule(
            [data_dir / "train.parquet"],
            hf_dir,
            int(cfg.trainer.seq_length),
            heldout_paths=[data_dir / "heldout.parquet"],
            max_pairs=c.max_pairs,
            max_heldout_pairs=c.max_heldout_pairs,
            seed=int(c.seed),
            dense_mask=needs_dense_mask(cfg),
        )
    return SFTDataModule(
        [data_dir / "train.parquet"],
        hf_dir,
        int(cfg.trainer.seq_length),
        heldout_paths=[data_dir / "heldout.parquet"],
        pack=bool(cfg.data.pack),
        mask_observations=bool(cfg.data.mask_observations),
        dense_mask=needs_dense_mask(cfg),
    )


def _train_megatron(cfg: DictConfig, layout: Any, data: Any, hf_dir: Path, max_steps: int) -> dict[str, Any]:
    from transformers import AutoConfig

    from afm_core.engine.checkpoint_dirs import find_resume_checkpoint
    from afm_core.engine.core import build_model
    from afm_core.engine.distributed import activation_memory_overrides, training_dtype
    from afm_core.models.hf_weights import load_hf_weights, save_hf_checkpoint
    from afm_core.train.trainer import SFTTrainer

    t, p = cfg.trainer, cfg.parallel
    overrides = activation_memory_overrides(p)
    if p.distributed_optimizer and not layout.on_gpu:
        raise ValueError(
            "parallel.distributed_optimizer needs a GPU: on CPU megatron-core 0.16.1 falls back to "
            "torch AdamW, whose state the DistributedOptimizer cannot checkpoint"
        )
    hf_config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    chunks = build_model(hf_config, layout, params_dtype=training_dtype(t.precision), **overrides)
    resume_from = cfg.get("resume")
    if find_resume_checkpoint(cfg.run_dir, resume_from) is None:
        load_hf_weights(chunks, hf_dir)  # a resumed run gets its weights from the checkpoint instead
    mbs = int(t.micro_batch_size)
    train = data.train_iterator(seed=int(t.seed), micro_batch_size=mbs, dp_rank=layout.dp_rank, dp_size=layout.dp)
    eval_batches = full_micro_batches(
        data.heldout_batches(
            micro_batch_size=mbs, dp_rank=layout.dp_rank, dp_size=layout.dp, max_sequences=int(t.eval_sequences)
        ),
        mbs,
    )
    trainer = SFTTrainer(cfg, layout, chunks, train, eval_batches, cfg.run_dir, max_steps, resume_from=resume_from)
    summary = trainer.fit()
    export = None
    if t.export_hf and not summary["stopped_early"]:
        trainer.core.release_training_state()  # saved in the last checkpoint; the export needs the weights only
        export = str(save_hf_checkpoint(trainer.model, hf_config, hf_dir, Path(cfg.run_dir) / "hf"))
    return {**summary, "hf_dir": export, "engine": "megatron"}


def run_sft(cfg: DictConfig) -> dict[str, Any]:
    """Train ``cfg.model`` on ``cfg.data`` with ``cfg.trainer`` / ``cfg.optim`` / ``cfg.parallel``; every rank calls it.

    The distributed env variables must be set (see :mod:`afm_core.engine.distributed`). Resumes exactly from the
    latest complete checkpoint of ``cfg.run_dir`` (else of ``cfg.resume``); returns early with
    ``stopped_early: True`` after :func:`afm_core.engine.preemption.request_checkpoint`.

    Returns:
        The summary (identical on every rank): ``eval_loss_before`` / ``eval_loss_after`` (held-out masked
        token-mean CE at step 0 and at the last eval), ``eval_loss_drop`` (fraction), ``tokens_per_s``
        (unmasked target tokens per second of training in this process; ``input_tokens_per_s``: all positions),
        ``train_time_s`` (over all restarts),
        ``checkpoint`` (the last complete checkpoint), ``hf_dir`` (the HF export, or None), ``step``,
        ``data_open_s`` (seconds to tokenize and pack the data, or to map the cached arrays: a restart's share),
        ``max_steps``, ``resumed_from``, ``stopped_early``, ``engine``, ``run_dir``.
    Raises:
        ValueError: a bad config value (the message names the field).
    """
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.utils.host_memory import configure_allocator

    configure_allocator()  # freed activations leave the resident set (afm_core.utils.host_memory)
    t = cfg.trainer
    if t.engine not in ENGINES:
        raise ValueError(f"trainer.engine={t.engine!r}: expected one of {ENGINES}")
    hf_dir = ensure_hf_checkpoint(cfg.model)
    data = _data_module(cfg, hf_dir)
    start = time.perf_counter()
    num_train, _ = len(data.train), data.heldout  # open both splits (tokenize once, or map the cache)
    data_open_s = time.perf_counter() - start
    if int(os.environ.get("RANK", "0")) == 0:
        how = "tokenized and packed" if data.built["train"] else "mapped the token cache"
        print(f"[sft] data: {how} in {data_open_s:.2f} s", flush=True)
        for split, report in getattr(data, "reports", {}).items():
            print(f"[sft] contrastive pairs ({split}): {report}", flush=True)
    max_steps = resolve_max_steps(t, num_train)
    if t.engine == "deepspeed":
        from afm_core.train.deepspeed_engine import init_deepspeed_distributed, train_deepspeed

        layout = init_deepspeed_distributed(cfg.parallel, num_threads=t.num_threads)
    else:
        layout = init_distributed(cfg.parallel, seed=int(t.seed), num_threads=t.num_threads)
    try:
        if layout.is_rank0:
            stats = data.train.stats
            print(
                f"[sft] {cfg.model.name} on {layout.device.type}: tp={layout.tp} pp={layout.pp} dp={layout.dp}, "
                f"{max_steps} steps x {t.global_batch_size} sequences of {t.seq_length} tokens; train: "
                f"{stats.num_sequences} packed sequences from {stats.num_examples} trajectories, "
                f"{stats.num_target_tokens} target tokens; run dir {cfg.run_dir}",
                flush=True,
            )
        if t.engine == "deepspeed":
            summary = train_deepspeed(
                cfg, layout, data, hf_dir, data.tokenizer, cfg.run_dir, max_steps, resume_from=cfg.get("resume")
            )
        else:
            summary = _train_megatron(cfg, layout, data, hf_dir, max_steps)
    finally:
        destroy_distributed()
    before, after = summary.get("eval_loss_before"), summary.get("eval_loss_after")
    summary = {
        **summary,
        "max_steps": max_steps,
        "run_dir": str(cfg.run_dir),
        "data_open_s": data_open_s,
        "eval_loss_drop": 1.0 - after / before if before and after is not None else None,
    }
    if layout.is_rank0:
        print_summary(summary)
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    """One human-readable block on stdout."""

    def fmt(value: Any, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    state = "stopped early (checkpointed for a requeue)" if summary["stopped_early"] else "done"
    preference = (
        f"  held-out preference accuracy: {fmt(summary['eval_pref_acc_before'], '.3f')} -> "
        f"{fmt(summary['eval_pref_acc_after'], '.3f')} (chosen branch scored above the rejected one)\n"
        if "eval_pref_acc_after" in summary
        else ""
    )
    print(
        f"[sft] {state} at step {summary['step']}/{summary['max_steps']} ({summary['engine']})\n"
        f"  held-out masked loss: {fmt(summary['eval_loss_before'], '.4f')} -> "
        f"{fmt(summary['eval_loss_after'], '.4f')} (drop {fmt(summary['eval_loss_drop'], '.1%')})\n"
        f"{preference}"
        f"  throughput: {fmt(summary['tokens_per_s'], ',.0f')} target tokens/s "
        f"({fmt(summary['input_tokens_per_s'], ',.0f')} input tokens/s); "
        f"train time {summary['train_time_s']:.0f} s\n"
        f"  checkpoint: {summary['checkpoint']}\n"
        f"  hf export:  {summary['hf_dir']}\n"
        f"  run dir:    {summary['run_dir']}",
        flush=True,
    )
