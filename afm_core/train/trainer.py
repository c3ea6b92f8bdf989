"""The SFT training loop on megatron-core: micro batches in, optimizer steps, evals, checkpoints, metrics out.

One optimizer step consumes ``global_batch_size`` packed sequences: ``num_microbatches = global_batch_size /
(micro_batch_size * dp)`` micro batches on each DP rank, run through ``get_forward_backward_func()`` (no
pipelining for PP=1, 1F1B for PP>1, interleaved 1F1B with virtual stages), gradients accumulated in megatron
DDP's fp32 buffers, reduced over DP, scaled by 1 / (unmasked tokens of the global batch) (see
:mod:`afm_core.train.loss`), clipped, and applied by megatron's AdamW (:mod:`afm_core.train.optim`). The loss is
the ``trainer.objective``'s (:mod:`afm_core.train.objective`): observation-masked SFT by default, or AutoCoA's
contrastive pair loss (then scaled by 1 / pairs of the global batch).

A micro batch is a dict of CPU tensors (the data loader's contract):
    tokens [b, s] int64, labels [b, s] int64 (next-token targets; any value where loss_mask is 0),
    loss_mask [b, s] (1 = trained target token), position_ids [b, s] int64, and optionally
    attention_mask [b, 1, s, s] bool (True = masked out; block-causal for packed documents; absent: causal).
``b = trainer.micro_batch_size`` and ``s = trainer.seq_length`` are fixed (pipeline send/recv shapes).
When the model's attention reads ``PackedSeqParams`` (transformer-engine's on GPU, our
:class:`~afm_core.models.attention.SDPAttention` on the local spec) and the batch has ``cu_seqlens``
(``b`` int tensors ``[d_i + 1]`` of document offsets), the micro batch goes to the model in the ``thd`` format, as
Megatron-LM packs it: the ``b`` rows laid end to end as one ``[1, b * s]`` row, each document (and each row's
trailing padding) a sequence of its own with RoPE positions restarting at 0; no dense mask is needed or read.
Otherwise the ``attention_mask`` (built from ``cu_seqlens`` when absent) goes to the attention.

Exact resume: a checkpoint holds the model, optimizer, LR scheduler, step counters, data-loader and RNG
states (:mod:`afm_core.train.checkpoint`); resuming reproduces the uninterrupted run's losses and weights
bitwise on CPU, and ``metrics.jsonl`` is cut back to the checkpoint's step.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from afm_core.data.loader import StepMicroBatches
from afm_core.data.packing import block_causal_attention_mask, thd_offsets
from afm_core.models.arch import ModelArch
from afm_core.models.local_spec import set_compiled_elementwise
from afm_core.train.checkpoint import Checkpointer
from afm_core.train.checkpoint_dirs import latest_complete_checkpoint
from afm_core.train.distributed import ParallelLayout
from afm_core.train.flops import batch_attention_pairs, datasheet_peak_tflops, mfu, training_flops
from afm_core.train.metrics import plot_losses, read_metrics
from afm_core.train.objective import Objective, build_objective
from afm_core.train.optim import build_optimizer
from afm_core.utils.atomic import atomic_write_text
from afm_core.utils.host_memory import populate_for_write, zero_by_release
from afm_core.utils.profiling import StepProfiler
from afm_core.utils.tracking import Tracker

log = logging.getLogger(__name__)

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")

_checkpoint_requested = False
_stop_requested = False


def request_checkpoint(stop: bool = True) -> None:
    """Ask the running trainer to save a checkpoint at the next step boundary (and then stop if ``stop``).

    Only sets module flags, so it is safe to call from a signal handler (SIGUSR2 / preemption). The flag is
    OR-reduced over all ranks at every step boundary, so ranks save together even if only one was signalled.
    """
    global _checkpoint_requested, _stop_requested
    _checkpoint_requested = True
    _stop_requested = _stop_requested or stop


def stop_requested() -> bool:
    """Whether this rank was asked to stop (:func:`request_checkpoint`), without clearing the flag: what a phase
    that can be abandoned (an RL generation round) polls; the step boundary (:func:`boundary_flags`) clears it."""
    return _stop_requested


def boundary_flags(on_gpu: bool) -> tuple[bool, bool]:
    """``(checkpoint requested, stop requested)`` OR-ed over all ranks: the requeue check every training loop
    (SFT's and RL's) makes at each step boundary (a collective: every rank calls it).

    A flag is cleared only if it was read as set, before the all-reduce: a signal that lands during the
    collective (or between the read and the clear) stays set for the next boundary instead of being lost.
    """
    global _checkpoint_requested, _stop_requested
    checkpoint, stop = _checkpoint_requested, _stop_requested
    if checkpoint:
        _checkpoint_requested = False
    if stop:
        _stop_requested = False
    flags = torch.tensor([int(checkpoint), int(stop)], device="cuda" if on_gpu else "cpu")
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1])


class MicroBatchSource(Protocol):
    """This DP rank's endless stream of training micro batches, resumable at any point."""

    def __next__(self) -> dict[str, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Progress:
    """Step counters saved in every checkpoint (identical on all ranks)."""

    step: int = 0  # optimizer steps done
    consumed_sequences: int = 0  # packed sequences trained on (global)
    consumed_tokens: int = 0  # unmasked target tokens trained on (global)
    train_time_s: float = 0.0  # wall seconds spent in training steps, over all restarts
    run_ids: dict[str, str] = field(default_factory=dict)  # tracking backends' runs (W&B, MLflow), continued on resume


def thd_packed_seq_params(cu_seqlens: list[torch.Tensor], seq_length: int, device: torch.device) -> PackedSeqParams:
    """``thd`` parameters for ``b`` packed sequences laid end to end as one row of ``b * seq_length`` tokens
    (:func:`~afm_core.data.packing.thd_offsets`), with the offsets on ``device`` and on the host
    (:class:`~afm_core.models.attention.PackedDocuments`): built once per micro batch, read by every layer.

    Args:
        cu_seqlens: ``b`` int tensors ``[d_i + 1]`` of document offsets in tokens (the loader's ``cu_seqlens``).
        seq_length: tokens in each packed sequence.
    Raises:
        ValueError: offsets that do not rise from 0 to at most ``seq_length``.
    """
    from afm_core.models.attention import PackedDocuments

    return PackedDocuments.from_offsets(thd_offsets(cu_seqlens, seq_length), device)


def reads_packed_seq_params(chunks: list[torch.nn.Module]) -> bool:
    """Whether every attention of the model chunks reads ``thd`` ``PackedSeqParams``: transformer-engine's
    ``TEDotProductAttention`` or :class:`~afm_core.models.attention.SDPAttention` (megatron's local
    ``DotProductAttention`` rejects them)."""
    from afm_core.models.attention import SDPAttention

    kinds = [
        isinstance(m, SDPAttention) or type(m).__name__ == "TEDotProductAttention"
        for chunk in chunks
        for m in chunk.modules()
        if type(m).__name__.endswith("DotProductAttention") or isinstance(m, SDPAttention)
    ]
    return bool(kinds) and all(kinds)


def ddp_config(*, distributed_optimizer: bool, on_gpu: bool, dp: int) -> DistributedDataParallelConfig:
    """Megatron DDP settings of the trainer (and of :mod:`afm_core.train.memory`'s plan, which must size the same
    buffers): fp32 gradient buffers; on GPU with DP > 1 the gradient reduce overlapped with backward, and with the
    distributed optimizer the parameter all-gather with the next forward (Megatron-LM's ``--overlap-grad-reduce``
    / ``--overlap-param-gather``; overlapping also buckets the buffers, which changes their padding). CPU (gloo):
    synchronous, and no NaN scan of the grad buffer (the grad norm, computed for clipping anyway, is checked
    instead in ``train_step``)."""
    overlap = on_gpu and dp > 1
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap and distributed_optimizer,
        use_distributed_optimizer=distributed_optimizer,
        check_for_nan_in_grad=on_gpu,
    )


class _DistributedDataParallel(DistributedDataParallel):
    """Megatron's DDP without the gradient collective when the data-parallel group has one rank, and with its
    grad buffers zeroed by page release on CPU.

    At DP = 1, ``finish_grad_sync`` would still scan the fp32 grad buffer for NaNs and all-reduce it over a
    one-rank group: passes over the whole buffer that change nothing. Gradient scaling by the token count
    (``finalize_model_grads``) and the embedding/layernorm syncs over PP/TP are unaffected.

    On CPU, :meth:`zero_grad_buffer` zeroes the fp32 grad buffers with
    :func:`~afm_core.utils.host_memory.zero_by_release` instead of a write pass, so the buffer (4 bytes/param)
    is not resident during the forward pass, when the activations peak (see :mod:`afm_core.utils.host_memory`).
    The backward hook that adds an autograd gradient into ``main_grad`` first maps that slice of the released
    buffer writable (:func:`~afm_core.utils.host_memory.populate_for_write`), so the add does not fault on every
    page twice.
    """

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        hook = super()._make_backward_post_hook(param)
        if torch.cuda.is_available():
            return hook

        def populate_then_hook(*args: Any) -> None:
            if param.grad is not None and getattr(param, "main_grad", None) is not None:
                populate_for_write(param.main_grad)
            hook(*args)

        return populate_then_hook

    def zero_grad_buffer(self) -> None:
        if torch.cuda.is_available() or getattr(self.config, "cuda_graph_impl", "none") == "transformer_engine":
            super().zero_grad_buffer()
            return
        # megatron-core 0.16.1 distributed_data_parallel.py zero_grad_buffer, with buffer.reset()'s
        # grad_data.zero_() done by page release
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False
        for buffer in self.buffers + self.expert_parallel_buffers:
            zero_by_release(buffer.grad_data)
        for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:
            bucket_group.reset()

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        if (
            self.ddp_config.use_distributed_optimizer
            or self.dp_cp_group.size() > 1
            or self.expert_parallel_bucket_groups
        ):
            super().finish_grad_sync(force_all_reduce=force_all_reduce)


def find_resume_checkpoint(run_dir: str | Path, resume_from: str | Path | None) -> Path | None:
    """The checkpoint a run resumes from: the latest complete one in ``run_dir/checkpoints`` (a requeued or
    restarted run), else the latest complete one of the ``resume_from`` run dir, else None (a fresh run).

    Raises:
        FileNotFoundError: ``resume_from`` is set but holds no complete checkpoint.
    """
    own = latest_complete_checkpoint(Path(run_dir) / "checkpoints")
    if own is not None or resume_from is None:
        return own
    other = latest_complete_checkpoint(Path(resume_from) / "checkpoints")
    if other is None:
        raise FileNotFoundError(f"resume={resume_from}: no complete checkpoint in {Path(resume_from) / 'checkpoints'}")
    return other


def build_model_chunks(model_provider: Any, layout: ParallelLayout) -> list[torch.nn.Module]:
    """Build this rank's model chunk(s) (one per virtual pipeline stage) like Megatron-LM's ``get_model``.

    Args:
        model_provider: ``(pre_process, post_process, vp_stage) -> GPTModel``.
        layout: this rank's parallel layout (``vpp`` stages per rank, or None).
    """
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        stage = vp_stage if layout.vpp else None
        chunks.append(
            model_provider(
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                vp_stage=stage,
            )
        )
    return chunks


def build_model(
    hf_config: Any, layout: ParallelLayout, *, params_dtype: torch.dtype, **config_overrides: Any
) -> list[torch.nn.Module]:
    """This rank's randomly initialised ``GPTModel`` chunks shaped like ``hf_config`` (a transformers Llama/Qwen2
    config), on ``layout.device``: :func:`afm_core.models.bridge.mcore_config_from_hf` with this rank's TP/PP/VPP
    and ``config_overrides`` (recompute, sequence parallel...), then :func:`build_model_chunks`. Every floating
    parameter is in ``params_dtype``: megatron's norms (the final layernorm among them) are built in fp32 whatever
    ``params_dtype`` says, and Megatron-LM's ``Float16Module`` casts them only in training
    (``megatron/core/transformer/module.py``), so an unwrapped bf16 model (the export, a reference policy) would
    otherwise carry one fp32 tensor. Megatron's parallel state must be initialised."""
    from afm_core.models.bridge import build_gpt_model, mcore_config_from_hf

    config = mcore_config_from_hf(
        hf_config,
        tp=layout.tp,
        pp=layout.pp,
        params_dtype=params_dtype,
        virtual_pipeline_model_parallel_size=layout.vpp,
        **config_overrides,
    )

    def provider(pre_process: bool, post_process: bool, vp_stage: int | None):
        return build_gpt_model(
            hf_config, config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
        ).to(device=layout.device, dtype=params_dtype)

    return build_model_chunks(provider, layout)


class SFTLoop(ABC):
    """The engine-independent SFT loop: batch sizes, resume, step loop, evals, metrics, checkpoint cadence, summary.

    An engine subclass builds its model and optimizer (``self.optimizer``: its ``param_groups[0]["lr"]`` is logged)
    and sets ``self.report_groups`` (the process groups :func:`~afm_core.train.loss.reduce_reports` sums over);
    it implements :meth:`train_step`, :meth:`evaluate`, :meth:`save_checkpoint` and :meth:`_resume`.

    Args:
        cfg: the composed SFT config (``trainer``, ``optim``, ``parallel`` groups are read).
        layout: this rank's parallel layout.
        train_data: this DP rank's training micro batches.
        eval_batches: this DP rank's share of the held-out micro batches (the same at every eval).
        run_dir: ``RUN_DIR`` (metrics.jsonl, loss.png, checkpoints/).
        max_steps: optimizer steps of the whole run.
        resume_from: another run's RUN_DIR to resume from when ``run_dir`` has no complete checkpoint.
    Raises:
        ValueError: ``trainer.global_batch_size`` is not divisible by ``trainer.micro_batch_size * dp``.
    """

    optimizer: Any
    report_groups: list[Any]

    def __init__(
        self,
        cfg: Any,
        layout: ParallelLayout,
        train_data: MicroBatchSource,
        eval_batches: list[dict[str, torch.Tensor]],
        run_dir: str | Path,
        max_steps: int,
        resume_from: str | Path | None = None,
    ):
        self.cfg, self.layout, self.max_steps = cfg, layout, max_steps
        self.run_dir = Path(run_dir)
        self.resume_from = Path(resume_from) if resume_from else None
        self.train_data, self.eval_batches = train_data, eval_batches
        t = cfg.trainer
        self.seq_length, self.micro_batch_size = int(t.seq_length), int(t.micro_batch_size)
        per_pass = self.micro_batch_size * layout.dp
        if t.global_batch_size % per_pass:
            raise ValueError(
                f"trainer.global_batch_size={t.global_batch_size} is not divisible by trainer.micro_batch_size"
                f" * dp = {self.micro_batch_size} * {layout.dp}"
            )
        self.num_microbatches = t.global_batch_size // per_pass
        self.progress = Progress()
        self.metrics: Tracker | None = None
        self.arch = _model_arch(cfg)
        self.peak_tflops = _peak_tflops(t.get("peak_tflops"), layout.on_gpu)
        self._attention_pairs = 0  # of this rank's micro batches in the current step (_check_batch)

    # -- what an engine implements ---------------------------------------------------------------------
    @abstractmethod
    def train_step(self) -> dict[str, float]:
        """One optimizer step over the next global batch; returns loss, tokens, lr and grad_norm."""

    @abstractmethod
    def evaluate(self) -> dict[str, float]:
        """The held-out metrics over the micro batches of all DP ranks: ``loss`` (masked token mean for SFT),
        ``tokens`` (unmasked target tokens) and whatever else the objective reports."""

    @abstractmethod
    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_N`` for ``self.progress.step`` (every rank calls it); returns its path."""

    @abstractmethod
    def _resume(self) -> Path | None:
        """Load the checkpoint :meth:`_find_checkpoint` names, if any, into the model, optimizer, scheduler,
        ``self.progress`` and the data stream; returns its path."""

    # -- shared by the engines -------------------------------------------------------------------------
    def _check_batch(self, batch: dict[str, torch.Tensor]) -> None:
        """Check a train micro batch's shapes, and count its attention work into the step's model FLOPs."""
        shape = (self.micro_batch_size, self.seq_length)
        for key in BATCH_KEYS:
            if key not in batch:
                raise KeyError(f"micro batch has no {key!r} (keys: {sorted(batch)})")
            if tuple(batch[key].shape) != shape:
                raise ValueError(
                    f"micro batch {key!r} has shape {tuple(batch[key].shape)}, expected "
                    f"[trainer.micro_batch_size, trainer.seq_length] = {list(shape)}"
                )
        self._attention_pairs += batch_attention_pairs(batch, self.seq_length)

    def _throughput(self, seconds: float) -> dict[str, float | None]:
        """``tflops`` (model TFLOP/s per device, :mod:`afm_core.train.flops`) and ``mfu`` (against
        ``self.peak_tflops``; None without one) of the step just taken in ``seconds``; both None without the
        model's architecture. Every data-parallel rank trains ``global_batch_size / dp`` sequences like this one's."""
        if self.arch is None or seconds <= 0:
            return {"tflops": None, "mfu": None}
        layout = self.layout
        tokens = int(self.cfg.trainer.global_batch_size) * self.seq_length
        flops = training_flops(self.arch, tokens, self._attention_pairs * layout.dp)
        per_device = (flops["linear"] + flops["attention"]) / (layout.dp * layout.tp * layout.pp)
        return {"tflops": per_device / seconds / 1e12, "mfu": mfu(per_device, seconds, self.peak_tflops)}

    def _find_checkpoint(self) -> Path | None:
        return find_resume_checkpoint(self.run_dir, self.resume_from)

    def _seed_metrics_from(self, source: Path) -> None:
        """Resuming another run's checkpoint: start this run's metrics.jsonl with that run's history."""
        target = self.run_dir / "metrics.jsonl"
        if not target.exists() and source.is_file():
            atomic_write_text(target, source.read_text(encoding="utf-8"))

    # -- the loop --------------------------------------------------------------------------------------
    def _open_tracker(self) -> None:
        """Rank 0 opens ``metrics.jsonl`` and the ``logger`` backends, continuing the runs whose ids the resumed
        checkpoint holds (:mod:`afm_core.utils.tracking`); every rank then holds the run ids, saved with the next
        checkpoint."""
        from omegaconf import DictConfig, OmegaConf

        ids: dict[str, str] = {}
        if self.layout.is_rank0:
            cfg = self.cfg
            config = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
            self.metrics = Tracker(self.run_dir, list(cfg.get("logger") or ["console"]), config=config,
                                   job_type="sft", tracking=cfg.get("tracking"), run_ids=self.progress.run_ids,
                                   resume_step=self.progress.step)  # fmt: skip
            ids = self.metrics.run_ids
        shared = [ids]
        torch.distributed.broadcast_object_list(shared, src=0)
        self.progress.run_ids = dict(shared[0])

    def _log(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(record)

    def _eval_and_log(self) -> float:
        start = time.perf_counter()
        metrics = self.evaluate()
        seconds = time.perf_counter() - start
        loss, tokens = metrics["loss"], metrics["tokens"]
        self._log(
            {
                "step": self.progress.step,
                "split": "eval",
                **metrics,
                "lr": self._lr(),
                "tokens_per_s": tokens / seconds,
                "eval_s": seconds,
                "elapsed_s": self.progress.train_time_s,
            }
        )
        if self.layout.is_rank0:
            plot_losses(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png")
        return loss

    def _lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def fit(self) -> dict[str, Any]:
        """Resume if a complete checkpoint exists, train to ``max_steps``, evaluate, checkpoint.

        Returns:
            ``{"resumed_from", "step", "eval_loss_before", "eval_loss_after", "eval_step_after", "tokens_per_s"
            (unmasked target tokens/s), "input_tokens_per_s" (all sequence positions/s), "train_time_s",
            "checkpoint", "stopped_early"}`` (identical on every rank; throughput over this process's steps).
        """
        t = self.cfg.trainer
        resumed_from = self._resume()
        self._open_tracker()
        profiler = StepProfiler(self.cfg.get("profile"), self.run_dir, self.layout.rank, self.layout.on_gpu)
        if resumed_from is None:
            self._eval_and_log()
        bar = tqdm(
            total=self.max_steps,
            initial=self.progress.step,
            desc="sft",
            unit="step",
            dynamic_ncols=True,
            disable=not (self.layout.is_rank0 and t.progress),
        )
        last_checkpoint = resumed_from
        run_steps, run_tokens, run_time, stopped_early = 0, 0, 0.0, False
        while self.progress.step < self.max_steps:
            start = time.perf_counter()
            self._attention_pairs = 0
            with profiler.step(self.progress.step + 1):
                out = self.train_step()
            seconds = time.perf_counter() - start
            self.progress.step += 1
            self.progress.consumed_sequences += t.global_batch_size
            self.progress.consumed_tokens += int(out["tokens"])
            self.progress.train_time_s += seconds
            run_steps, run_tokens, run_time = run_steps + 1, run_tokens + int(out["tokens"]), run_time + seconds
            step = self.progress.step
            if step % t.log_interval == 0 or step == self.max_steps:
                self._log(
                    {
                        "step": step,
                        "split": "train",
                        **out,
                        "tokens_per_s": out["tokens"] / seconds,
                        "input_tokens_per_s": t.global_batch_size * self.seq_length / seconds,
                        **self._throughput(seconds),
                        "step_s": seconds,
                        "elapsed_s": self.progress.train_time_s,
                    }
                )
            bar.update(1)
            bar.set_postfix(loss=f"{out['loss']:.4f}", lr=f"{out['lr']:.2e}")
            if step % t.eval_interval == 0 or step == self.max_steps:
                self._eval_and_log()
            want_checkpoint, stop = boundary_flags(self.layout.on_gpu)
            if want_checkpoint or step % t.save_interval == 0 or step == self.max_steps:
                last_checkpoint = self.save_checkpoint()
            if stop and step < self.max_steps:
                stopped_early = True
                break
        bar.close()
        profiler.stop()
        summary = {
            "resumed_from": str(resumed_from) if resumed_from else None,
            "step": self.progress.step,
            **self._eval_summary(),
            "tokens_per_s": run_tokens / run_time if run_time else None,
            "input_tokens_per_s": run_steps * t.global_batch_size * self.seq_length / run_time if run_time else None,
            "train_time_s": self.progress.train_time_s,
            "checkpoint": str(last_checkpoint) if last_checkpoint else None,
            "stopped_early": stopped_early,
        }
        if self.metrics is not None:
            self.metrics.close()
        shared = [summary]
        torch.distributed.broadcast_object_list(shared, src=0)
        return shared[0]

    def _eval_summary(self) -> dict[str, Any]:
        """Held-out loss (and the contrastive objective's preference accuracy) at step 0 and at the last eval, from
        metrics.jsonl (rank 0; others get None)."""
        if not self.layout.is_rank0:
            return {}
        evals = [r for r in read_metrics(self.run_dir / "metrics.jsonl") if r["split"] == "eval"]
        first = next((r for r in evals if r["step"] == 0), {})
        after = evals[-1] if evals else {}
        summary = {
            "eval_loss_before": first.get("loss"),
            "eval_loss_after": after.get("loss"),
            "eval_step_after": after.get("step"),
        }
        if "pref_acc" in after:
            summary.update(eval_pref_acc_before=first.get("pref_acc"), eval_pref_acc_after=after["pref_acc"])
        return summary


def _model_arch(cfg: Any) -> ModelArch | None:
    """The architecture of ``cfg.model`` (a preset's fields), or None when the config has no valid model group."""
    from afm_core.models.presets import PresetError, load_preset

    model = cfg.get("model")
    if model is None:
        return None
    try:
        return load_preset(model).arch
    except PresetError:
        return None


def _peak_tflops(configured: float | None, on_gpu: bool) -> float | None:
    """``trainer.peak_tflops``, else the datasheet peak of this rank's CUDA device, else None (CPU, unknown)."""
    if configured:
        return float(configured)
    if not on_gpu:
        return None
    return datasheet_peak_tflops(torch.cuda.get_device_name())


class MegatronTrainer:
    """The one Megatron trainer core that SFT (:class:`SFTTrainer`), the RL policy
    (:mod:`afm_core.rl.policy_trainer`) and the PPO critic (:mod:`afm_core.rl.critic`) share: this rank's model
    chunks wrapped as Megatron-LM wraps them (Float16Module for bf16, DDP with fp32 grad buffers and per-token
    loss), AdamW and its LR schedule (:mod:`afm_core.train.optim`), one optimizer step over micro batches with a
    caller's loss (:meth:`step`), and checkpoints (:meth:`save` / :meth:`load`, :mod:`afm_core.train.checkpoint`).
    The requeue check is :func:`boundary_flags`.

    Args:
        layout: this rank's parallel layout.
        model_chunks: unwrapped GPTModel chunk(s) of this rank (:func:`build_model_chunks`), on ``layout.device``,
            in their training dtype (bf16 or fp32).
        optim: the ``optim`` config (lr, schedule, weight decay, Adam betas/eps, warmup_ratio, min_lr).
        max_steps: optimizer steps of the whole run (the LR schedule's length).
        grad_clip: global gradient-norm clip.
        distributed_optimizer: megatron's distributed optimizer (GPU only).
        checkpoint_dir: where ``step_N`` checkpoints go.
        keep_last: complete checkpoints kept.
    Raises:
        ValueError: a bad ``optim`` value (names the field).
    """

    optimizer: Any
    report_groups: list[Any]

    def __init__(
        self,
        layout: ParallelLayout,
        model_chunks: list[torch.nn.Module],
        *,
        optim: Any,
        max_steps: int,
        grad_clip: float,
        distributed_optimizer: bool,
        checkpoint_dir: str | Path,
        keep_last: int,
    ):
        self.layout = layout
        self.model = self._wrap(model_chunks, bool(distributed_optimizer))
        self.optimizer, self.scheduler = build_optimizer(
            self.model,
            optim if isinstance(optim, DictConfig) else OmegaConf.create(dict(optim)),
            max_steps=max_steps,
            grad_clip=grad_clip,
            params_dtype=get_model_config(self.model[0]).params_dtype,
            distributed_optimizer=bool(distributed_optimizer),
        )
        config = get_model_config(self.model[0])
        config.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        if self.ddp_config.overlap_grad_reduce:  # Megatron-LM's training.py: reduce each chunk as its grads are done
            syncs = [m.start_grad_sync for m in self.model]
            config.grad_sync_func = syncs if len(syncs) > 1 else syncs[0]
        if self.ddp_config.overlap_param_gather:  # ... and gather each chunk's updated weights before its forward
            syncs = [m.start_param_sync for m in self.model]
            config.param_sync_func = syncs if len(syncs) > 1 else syncs[0]
        self.forward_backward = get_forward_backward_func()
        self.checkpointer = Checkpointer(checkpoint_dir, keep_last, layout)
        self.report_groups = [ps.get_data_parallel_group(), ps.get_pipeline_model_parallel_group()]

    # -- setup -----------------------------------------------------------------------------------------
    def _wrap(self, chunks: list[torch.nn.Module], distributed_optimizer: bool) -> list[torch.nn.Module]:
        """Megatron-LM's wrapping: Float16Module for bf16, then DDP with fp32 grad buffers."""
        config = get_model_config(chunks[0])
        config.calculate_per_token_loss = True  # read by DDP and the schedules: see afm_core.train.loss
        if config.pipeline_dtype is None:
            config.pipeline_dtype = config.params_dtype
        if not self.layout.on_gpu:
            # gloo pairs the batched isend/irecv of two ranks in posting order: with PP=2 and virtual stages the
            # activation and the gradient crossing between the same two ranks were swapped (wrong losses).
            # Megatron's unbatched p2p orders sends/receives by even/odd pipeline rank instead.
            config.batch_p2p_comm = False
        if config.bf16:
            chunks = [Float16Module(config, m) for m in chunks]
        self.ddp_config = ddp_config(
            distributed_optimizer=distributed_optimizer,
            on_gpu=self.layout.on_gpu,
            dp=self.layout.dp,
        )
        wrapped = [
            _DistributedDataParallel(config=config, ddp_config=self.ddp_config, module=m, disable_bucketing=i > 0)
            for i, m in enumerate(chunks)
        ]
        if not self.ddp_config.overlap_grad_reduce:  # grads reduced after backward: a loss may write main_grad
            for chunk in wrapped:
                for module in chunk.modules():
                    if hasattr(module, "grad_into_main_grad"):  # the fused loss and the local spec's linears
                        module.grad_into_main_grad = True
        return wrapped

    def sync_params(self) -> None:
        """Finish the pending parameter all-gather of the distributed optimizer (``overlap_param_gather``), so the
        weights are complete before an eval, a checkpoint or an export (Megatron-LM's ``force_param_sync``)."""
        from afm_core.models.bridge import finish_param_gather

        finish_param_gather(self.model)

    def release_training_state(self) -> None:
        """Drop the optimizer state (AdamW moments) and the gradient buffers' contents when training is over (the
        last checkpoint holds them), so what follows (the HF export) has that memory: 12 bytes/param in fp32.
        The trainer cannot take another step afterwards."""
        for chained in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(chained, "optimizer", None)
            if inner is not None:
                inner.state.clear()
        self._release_grad_buffers()

    def _release_grad_buffers(self) -> None:
        """Zero the fp32 grad buffers by page release (:func:`~afm_core.utils.host_memory.zero_by_release`): at a
        step boundary their contents are spent (the next step zeroes them first), so on CPU their pages need not
        stay resident through an eval, a checkpoint write or an export."""
        for chunk in self.model:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                zero_by_release(buffer.grad_data)

    # -- one step --------------------------------------------------------------------------------------
    def run_schedule(
        self, micro_batches: Any, forward_step: Any, *, seq_length: int, micro_batch_size: int, forward_only: bool
    ) -> list[Any]:
        """megatron-core's forward(-backward) schedule over ``micro_batches`` (a sized iterable, read once per
        model chunk) with ``forward_step`` (megatron's ``forward_step_func``: ``(data_iterator, model) ->
        (output, loss_func)``); ``seq_length`` x ``micro_batch_size`` is the activation shape sent between
        pipeline stages. Returns the loss reports of the micro batches (last pipeline stage; others get none)."""
        iterators = [iter(micro_batches) for _ in self.model]
        return self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )

    def step(
        self, micro_batches: Any, forward_step: Any, *, seq_length: int, micro_batch_size: int, what: str
    ) -> tuple[list[Any], float, float]:
        """One optimizer step over ``micro_batches`` with ``forward_step``'s loss (see :meth:`run_schedule`):
        gradients zeroed, accumulated, reduced over DP, scaled by the reported token count (per-token loss),
        clipped, applied; the LR schedule advances.

        Returns:
            ``(loss reports of the micro batches, grad norm, lr used)``.
        Raises:
            FloatingPointError: non-finite gradients (``what`` names the update).
        """
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.optimizer.param_groups[0]["lr"]
        reports = self.run_schedule(
            micro_batches, forward_step, seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=False
        )
        update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok or (grad_norm is not None and not math.isfinite(grad_norm)):
            raise FloatingPointError(f"{what}: non-finite gradients (grad norm {grad_norm})")
        self.scheduler.step(increment=1)
        return list(reports), float(grad_norm), float(lr)

    # -- checkpoints -----------------------------------------------------------------------------------
    def save(self, step: int, common: dict[str, Any], rank_state: dict[str, Any] | None = None) -> Path:
        """Write ``checkpoint_dir/step_N`` (every rank calls it): model, optimizer, the LR schedule and ``common``
        (rank 0's copy, identical on every rank as dist_checkpointing wants), and this rank's ``rank_state``.

        The spent gradients are released first: megatron's writer clones every tensor view it saves
        (``dist_checkpointing/strategies/filesystem_async.py`` ``prepare_write_data``), and the SwiGLU halves of
        ``linear_fc1``'s weight and of its AdamW moments are views (``transformer/mlp.py``
        ``apply_swiglu_sharded_factory``): 12 bytes per fc1 parameter, 0.6 GB at SmolLM2-135M, on top of
        everything else. With the 4 bytes/param of gradients still resident, the save, not training, set the
        SFT job's peak resident memory."""
        self.sync_params()
        self._release_grad_buffers()
        shared = [{**common, "scheduler": self.scheduler.state_dict()}]
        torch.distributed.broadcast_object_list(shared, src=0)  # dist_checkpointing wants identical commons
        return self.checkpointer.save(step, self.model, self.optimizer, shared[0], rank_state or {})

    def load(self, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load the checkpoint ``path`` into the model, optimizer and LR schedule (collective); returns its
        ``(common, this rank's state)``."""
        common, rank_state = self.checkpointer.load(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(common["scheduler"])
        return common, rank_state


class SFTTrainer(SFTLoop, MegatronTrainer):
    """Runs observation-masked SFT on prebuilt megatron model chunks: :class:`SFTLoop` on :class:`MegatronTrainer`.

    Args:
        cfg, layout, train_data, eval_batches, run_dir, max_steps, resume_from: as for :class:`SFTLoop`.
        model_chunks: unwrapped GPTModel chunk(s) of this rank, weights already loaded, on ``layout.device``,
            in their training dtype (bf16 or fp32).
        thd_packing: give batches with ``cu_seqlens`` to the model in the ``thd`` format (module docstring);
            None: whenever the model's attention reads ``PackedSeqParams`` (:func:`reads_packed_seq_params`).
        objective: what the loss is (:mod:`afm_core.train.objective`); None: ``cfg.trainer.objective`` (default
            ``sft``, the masked token mean).
    Raises:
        ValueError: the batch sizes do not divide (names the config fields), or ``thd_packing=True`` on a model
            whose attention ignores ``PackedSeqParams``.
    """

    def __init__(
        self,
        cfg: Any,
        layout: ParallelLayout,
        model_chunks: list[torch.nn.Module],
        train_data: MicroBatchSource,
        eval_batches: list[dict[str, torch.Tensor]],
        run_dir: str | Path,
        max_steps: int,
        resume_from: str | Path | None = None,
        thd_packing: bool | None = None,
        objective: Objective | None = None,
    ):
        SFTLoop.__init__(self, cfg, layout, train_data, eval_batches, run_dir, max_steps, resume_from)
        self.objective = objective if objective is not None else build_objective(cfg)
        reads_thd = reads_packed_seq_params(model_chunks)
        if thd_packing and not reads_thd:
            raise ValueError(
                "thd_packing=True, but the model's attention does not read PackedSeqParams (use "
                "afm_core.models.bridge.gpt_layer_spec)"
            )
        self.thd_packing = reads_thd if thd_packing is None else thd_packing
        t = cfg.trainer
        set_compiled_elementwise(t.get("compile"))  # process-wide, as megatron's own fusions are
        MegatronTrainer.__init__(
            self,
            layout,
            model_chunks,
            optim=cfg.optim,
            max_steps=max_steps,
            grad_clip=t.grad_clip,
            distributed_optimizer=bool(cfg.parallel.distributed_optimizer),
            checkpoint_dir=self.run_dir / "checkpoints",
            keep_last=t.keep_last,
        )
        # the model takes the labelled positions found on the host (bridge.OutputRows): no nonzero on the device
        self.output_rows = all("output_rows" in inspect.signature(chunk.forward).parameters for chunk in model_chunks)
        # the loss's gradient is 1 on every labelled position when the objective is a plain masked sum and the
        # optimizer scales no loss (bf16/fp32; read once here, a device sync)
        self.unit_row_grads = (
            bool(getattr(self.objective, "unit_row_grads", False)) and float(self.optimizer.get_loss_scale()) == 1.0
        )

    def model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The ``GPTModel.forward`` arguments of a micro batch, on this rank's device (module docstring).

        Returns:
            ``input_ids``, ``position_ids``, ``labels`` (-100 wherever ``loss_mask`` is 0: no loss, and the fused
            output layer + loss of :class:`~afm_core.models.bridge._GPTModel` computes no gradient there),
            ``loss_mask`` (``[b, s]``, or ``[1, b * s]`` in the ``thd`` format), ``attention_mask`` and
            ``packed_seq_params`` (one of them None), and for our ``GPTModel`` ``output_rows`` (the labelled
            positions, :class:`~afm_core.models.bridge.OutputRows`, found on the host from the CPU batch).
        """
        device = self.layout.device
        names = {"input_ids": "tokens", "labels": "labels", "loss_mask": "loss_mask", "position_ids": "position_ids"}
        inputs = {key: batch[name].to(device, non_blocking=True) for key, name in names.items()}
        inputs["labels"] = inputs["labels"].masked_fill(inputs["loss_mask"] == 0, -100)
        inputs["attention_mask"] = inputs["packed_seq_params"] = None
        if self.output_rows:
            from afm_core.models.bridge import OutputRows

            mask = batch["loss_mask"]
            labelled = (mask != 0) & (batch["labels"] >= 0)  # where the labels stay >= 0 above
            unit = self.unit_row_grads and bool(((mask == 1) | ~labelled).all())
            inputs["output_rows"] = OutputRows.of(labelled, device, unit_grads=unit)
        if self.thd_packing and batch.get("cu_seqlens") is not None:
            b, s = inputs["input_ids"].shape
            inputs.update(
                {key: inputs[key].reshape(1, b * s) for key in ("input_ids", "labels", "loss_mask", "position_ids")}
            )
            inputs["packed_seq_params"] = thd_packed_seq_params(batch["cu_seqlens"], s, device)
        elif batch.get("attention_mask") is not None:
            inputs["attention_mask"] = batch["attention_mask"].to(device, non_blocking=True)
        elif batch.get("cu_seqlens") is not None:
            inputs["attention_mask"] = torch.cat(
                [block_causal_attention_mask(c, self.seq_length) for c in batch["cu_seqlens"]]
            ).to(device)
        return inputs

    def _forward_step(self, data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
        batch = next(data_iterator)
        inputs = self.model_inputs(batch)
        loss_mask = inputs.pop("loss_mask")
        output = model(inputs.pop("input_ids"), inputs.pop("position_ids"), inputs.pop("attention_mask"), **inputs)
        return output, self.objective.loss_func(batch, loss_mask)

    def _run_schedule(self, micro_batches: Any, forward_only: bool):
        seq_length, micro_batch_size = self._shape()
        return self.run_schedule(
            micro_batches,
            self._forward_step,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )

    def _shape(self) -> tuple[int, int]:
        """The activation shape between pipeline stages: ``thd`` sends a micro batch's b rows as one row."""
        if self.thd_packing:
            return self.micro_batch_size * self.seq_length, 1
        return self.seq_length, self.micro_batch_size

    def train_step(self) -> dict[str, float]:
        """One optimizer step over the next global batch; returns loss, tokens, lr and grad_norm."""
        # Each micro batch is built when the schedule asks for it, not all of the step's up front.
        micro_batches = StepMicroBatches(self.train_data, self.num_microbatches, check=self._check_batch)
        seq_length, micro_batch_size = self._shape()
        reports, grad_norm, lr = self.step(
            micro_batches,
            self._forward_step,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            what=f"optimizer step {self.progress.step + 1}",
        )
        return {**self.objective.reduce(reports, self.report_groups), "lr": lr, "grad_norm": grad_norm}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The objective's held-out metrics (``loss``, ``tokens``, ...) over the micro batches of all DP ranks."""
        self.sync_params()
        for chunk in self.model:
            chunk.eval()
        reports = self._run_schedule(self.eval_batches, forward_only=True)
        for chunk in self.model:
            chunk.train()
        return self.objective.reduce(reports, self.report_groups)

    # -- checkpoints -----------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_N`` (every rank calls it; :meth:`MegatronTrainer.save`) with the step
        counters and this rank's data-loader position."""
        return self.save(
            self.progress.step, {"progress": asdict(self.progress)}, {"data": self.train_data.state_dict()}
        )

    def _resume(self) -> Path | None:
        path = self._find_checkpoint()
        if path is None:
            return None
        common, rank_state = self.load(path)
        self.progress = Progress(**common["progress"])
        if "data" in rank_state:
            self.train_data.load_state_dict(rank_state["data"])
        if self.layout.is_rank0 and not path.is_relative_to(self.run_dir):
            self._seed_metrics_from(path.parent.parent / "metrics.jsonl")
        return path
