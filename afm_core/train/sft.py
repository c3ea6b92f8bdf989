"""``run_sft(config)``: observation-masked agentic SFT, the entry point every rank of the SFT job runs.

The job layer (``jobs.sft`` through submitit) exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT and, on each rank, checks the composed ``conf/sft.yaml`` into an :class:`~afm_core.config.sft.SFTConfig`
(:func:`~afm_core.config.sft.sft_config`) and calls :func:`run_sft` with it. Each part gets the group it reads:

1. the HF checkpoint of ``model`` (``ensure_hf_checkpoint``: SmolLM2-135M converted from its GGUF once)
   and the prepared CoA trajectories of ``data`` (``ensure_prepared``: train / held-out parquet);
2. tokenization with the observation loss mask and packing into ``trainer.seq_length`` sequences
   (``SFTDataModule``), done once by the first rank and cached next to the prepared parquet: the other ranks
   and a requeued or resumed job memory-map the cached arrays;
3. ``trainer.engine=megatron`` (default): megatron parallel state (TP/PP/DP, from ``parallel``), the GPTModel chunks
   of this rank with the HF weights loaded (mbridge), then :class:`~afm_core.train.trainer.SFTTrainer` on the
   loop's view of the config (:attr:`~afm_core.config.sft.SFTConfig.loop`; resume from the latest complete
   checkpoint of ``run_dir``, or of ``resume``); ``trainer.engine=deepspeed``: ZeRO-3 on the HF model
   (:mod:`afm_core.train.deepspeed_engine`), same loop and outputs;
4. the HF safetensors export to ``RUN_DIR/hf`` and a summary printed by rank 0.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from afm_core.config.data import DataConfig
from afm_core.config.sft import ContrastiveConfig, SFTConfig, TrainerConfig, sft_config
from afm_core.data.loader import SFTDataModule, full_micro_batches
from afm_core.data.pairs import PairDataModule
from afm_core.data.prepare import ensure_prepared
from afm_core.engine.checkpoint_dirs import find_resume_checkpoint
from afm_core.engine.core import build_model
from afm_core.engine.distributed import (
    ParallelLayout,
    activation_memory_overrides,
    destroy_distributed,
    init_distributed,
    training_dtype,
)
from afm_core.models import gpt
from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
from afm_core.models.hf_weights import load_hf_weights, save_hf_checkpoint
from afm_core.models.lora import apply_lora
from afm_core.models.lora_hf import save_peft_adapter
from afm_core.train.trainer import SFTTrainer
from afm_core.utils.host_memory import configure_allocator

log = logging.getLogger(__name__)


def resolve_max_steps(trainer: TrainerConfig, num_train_sequences: int) -> int:
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


def needs_dense_mask(data: DataConfig, engine: str) -> bool:
    """Whether packed micro batches (``data.pack``) must carry the dense ``[b, 1, s, s]`` block-causal mask: for
    the DeepSpeed ``engine`` (HF attention takes a 4-D mask) and for Megatron's local spec unless its core attention
    reads ``packed_seq_params`` (``cu_seqlens``); never on transformer-engine (``thd``)."""
    if not data.pack:
        return False
    if engine == "deepspeed":
        return True
    if gpt.transformer_engine_available():
        return False
    return not gpt.LOCAL_ATTENTION_READS_CU_SEQLENS


def _data_module(
    data: DataConfig, trainer: TrainerConfig, contrastive: ContrastiveConfig, hf_dir: Path
) -> SFTDataModule:
    """The tokenized, packed train and held-out splits of the prepared ``data``: trajectories, or AutoCoA stage 1's
    pairs built from them (``trainer.objective=contrastive``, with the ``contrastive`` group)."""
    data_dir = ensure_prepared(asdict(data))
    train, heldout = [data_dir / "train.parquet"], [data_dir / "heldout.parquet"]
    dense_mask = needs_dense_mask(data, trainer.engine)
    if trainer.objective == "contrastive":
        c = contrastive
        return PairDataModule(train, hf_dir, trainer.seq_length, heldout_paths=heldout, dense_mask=dense_mask,
                              max_pairs=c.max_pairs, max_heldout_pairs=c.max_heldout_pairs, seed=c.seed)  # fmt: skip
    return SFTDataModule(train, hf_dir, trainer.seq_length, heldout_paths=heldout, dense_mask=dense_mask,
                         pack=data.pack, mask_observations=data.mask_observations)  # fmt: skip


def _train_megatron(
    config: SFTConfig, layout: ParallelLayout, data: SFTDataModule, hf_dir: Path, max_steps: int
) -> dict[str, Any]:
    t, p = config.trainer, config.parallel
    overrides = activation_memory_overrides(p)
    if p.distributed_optimizer and not layout.on_gpu:
        raise ValueError(
            "parallel.distributed_optimizer needs a GPU: on CPU megatron-core 0.16.1 falls back to "
            "torch AdamW, whose state the DistributedOptimizer cannot checkpoint"
        )
    hf_config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    chunks = build_model(hf_config, layout, params_dtype=training_dtype(t.precision), **overrides)
    lora = config.model.lora
    if lora.enabled or find_resume_checkpoint(config.run_dir, config.resume) is None:
        # a resumed full fine-tune gets its weights from the checkpoint; a LoRA checkpoint holds the adapters only
        load_hf_weights(chunks, hf_dir)
    if lora.enabled:
        apply_lora(chunks, lora)  # base frozen before the trainer core wraps: DDP and AdamW see the adapters only
    mbs = t.micro_batch_size
    train = data.train_iterator(seed=t.seed, micro_batch_size=mbs, dp_rank=layout.dp_rank, dp_size=layout.dp)
    eval_batches = full_micro_batches(
        data.heldout_batches(
            micro_batch_size=mbs, dp_rank=layout.dp_rank, dp_size=layout.dp, max_sequences=t.eval_sequences
        ),
        mbs,
    )
    trainer = SFTTrainer(
        config.loop, layout, chunks, train, eval_batches, config.run_dir, max_steps, resume_from=config.resume
    )
    summary = trainer.fit()
    export = None
    if t.export_hf and not summary["stopped_early"]:
        trainer.core.release_training_state()  # saved in the last checkpoint; the export needs the weights only
        export = str(save_hf_checkpoint(trainer.model, hf_config, hf_dir, Path(config.run_dir) / "hf"))  # merged
        if lora.enabled:  # and the adapters alone, for peft / vLLM's --enable-lora on the same base
            adapter = str(save_peft_adapter(trainer.model, hf_dir, Path(config.run_dir) / "hf_adapter"))
            summary = {**summary, "adapter_dir": adapter}
    return {**summary, "hf_dir": export, "engine": "megatron"}


def run_sft(config: SFTConfig) -> dict[str, Any]:
    """Train ``config.model`` on ``config.data`` with ``trainer`` / ``optim`` / ``parallel``; every rank calls it.

    The distributed env variables must be set (see :mod:`afm_core.engine.distributed`). Resumes exactly from the
    latest complete checkpoint of ``config.run_dir`` (else of ``config.resume``); returns early with
    ``stopped_early: True`` after :func:`afm_core.engine.preemption.request_checkpoint`.

    Args:
        config: the checked ``conf/sft.yaml`` (``jobs.sft``'s ranks make it with
            :func:`~afm_core.config.sft.sft_config`).
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
    config = sft_config(config)  # as is; a job pickled before jobs.sft passed load_cfg still hands the DictConfig
    configure_allocator()  # freed activations leave the resident set (afm_core.utils.host_memory)
    t = config.trainer
    hf_dir = ensure_hf_checkpoint(asdict(config.model))
    data = _data_module(config.data, t, config.contrastive, hf_dir)
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
        # DeepSpeed (and, through transformers' set_seed, peft and the tokenizers) only for its engine: a Megatron
        # rank's start-up imports neither
        from afm_core.train.deepspeed_engine import init_deepspeed_distributed, train_deepspeed

        layout = init_deepspeed_distributed(config.parallel, num_threads=t.num_threads)
    else:
        layout = init_distributed(config.parallel, seed=t.seed, num_threads=t.num_threads)
    try:
        if layout.is_rank0:
            stats = data.train.stats
            print(
                f"[sft] {config.model.name} on {layout.device.type}: tp={layout.tp} pp={layout.pp} dp={layout.dp}, "
                f"{max_steps} steps x {t.global_batch_size} sequences of {t.seq_length} tokens; train: "
                f"{stats.num_sequences} packed sequences from {stats.num_examples} trajectories, "
                f"{stats.num_target_tokens} target tokens; run dir {config.run_dir}",
                flush=True,
            )
        if t.engine == "deepspeed":
            summary = train_deepspeed(
                config.loop, layout, data, hf_dir, data.tokenizer, config.run_dir, max_steps, resume_from=config.resume
            )
        else:
            summary = _train_megatron(config, layout, data, hf_dir, max_steps)
    finally:
        destroy_distributed()
    before, after = summary.get("eval_loss_before"), summary.get("eval_loss_after")
    summary = {
        **summary,
        "max_steps": max_steps,
        "run_dir": str(config.run_dir),
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
