"""The engine-independent SFT loop (:class:`SFTLoop`): batch sizes, resume, the step loop, evals, metrics, the
checkpoint cadence and the run's summary, over an engine that takes the steps (Megatron's
:class:`afm_core.train.trainer.SFTTrainer`, DeepSpeed's :class:`afm_core.train.deepspeed_engine.DeepSpeedSFTTrainer`).

Exact resume: a checkpoint holds the model, optimizer, LR scheduler, step counters, data-loader and RNG
states (:mod:`afm_core.engine.checkpoint`); resuming reproduces the uninterrupted run's losses and weights
bitwise on CPU, and ``metrics.jsonl`` is cut back to the checkpoint's step. A stop is asked for through the
:class:`~afm_core.engine.preemption.Preemption` the loop is handed: at the next step boundary it checkpoints and
returns with ``stopped_early``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from afm_core.config.sft import LoopConfig, ModelConfig, TrainerConfig
from afm_core.engine.checkpoint_dirs import find_resume_checkpoint
from afm_core.engine.distributed import ParallelLayout
from afm_core.engine.flops import batch_attention_pairs, datasheet_peak_tflops, mfu, training_flops
from afm_core.engine.metrics import plot_losses, read_metrics
from afm_core.engine.preemption import JOB_PREEMPTION, Preemption
from afm_core.models.arch import ModelArch
from afm_core.models.presets import PresetError, load_preset
from afm_core.utils.atomic import atomic_write_text
from afm_core.utils.profiling import StepProfiler
from afm_core.utils.tracking import Tracker

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def micro_batches_per_step(trainer: TrainerConfig, dp: int) -> int:
    """Micro batches each DP rank runs per optimizer step: ``global_batch_size / (micro_batch_size * dp)``.

    Raises:
        ValueError: ``trainer.global_batch_size`` is not divisible by ``trainer.micro_batch_size * dp``.
    """
    per_pass = trainer.micro_batch_size * dp
    if trainer.global_batch_size % per_pass:
        raise ValueError(
            f"trainer.global_batch_size={trainer.global_batch_size} is not divisible by trainer.micro_batch_size"
            f" * dp = {trainer.micro_batch_size} * {dp}"
        )
    return trainer.global_batch_size // per_pass


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


class SFTLoop(ABC):
    """The engine-independent SFT loop: batch sizes, resume, step loop, evals, metrics, checkpoint cadence, summary.

    An engine subclass builds its model and optimizer (``self.optimizer``: its ``param_groups[0]["lr"]`` is logged)
    and sets ``self.report_groups`` (the process groups :func:`~afm_core.train.loss.reduce_reports` sums over);
    it implements :meth:`train_step`, :meth:`evaluate`, :meth:`save_checkpoint` and :meth:`_resume`.

    Args:
        config: the loop's view of the run's config (:attr:`afm_core.config.sft.SFTConfig.loop`): ``trainer`` here,
            ``model`` for the FLOPs, ``logger`` / ``tracking`` / ``profile`` / ``logged`` for the metrics;
            an engine reads its ``optim`` and ``parallel`` too.
        layout: this rank's parallel layout.
        train_data: this DP rank's training micro batches.
        eval_batches: this DP rank's share of the held-out micro batches (the same at every eval).
        run_dir: ``RUN_DIR`` (metrics.jsonl, loss.png, checkpoints/).
        max_steps: optimizer steps of the whole run.
        resume_from: another run's RUN_DIR to resume from when ``run_dir`` has no complete checkpoint.
        preemption: where a stop is asked for (:mod:`afm_core.engine.preemption`); None: the job's
            (:data:`~afm_core.engine.preemption.JOB_PREEMPTION`, what its SIGUSR2 sets).
    Raises:
        ValueError: ``trainer.global_batch_size`` is not divisible by ``trainer.micro_batch_size * dp``.
    """

    optimizer: Any
    report_groups: list[Any]

    def __init__(
        self,
        config: LoopConfig,
        layout: ParallelLayout,
        train_data: MicroBatchSource,
        eval_batches: list[dict[str, torch.Tensor]],
        run_dir: str | Path,
        max_steps: int,
        resume_from: str | Path | None = None,
        preemption: Preemption | None = None,
    ):
        self.config, self.layout, self.max_steps = config, layout, max_steps
        self.preemption = JOB_PREEMPTION if preemption is None else preemption
        self.run_dir = Path(run_dir)
        self.resume_from = Path(resume_from) if resume_from else None
        self.train_data, self.eval_batches = train_data, eval_batches
        t = config.trainer
        self.seq_length, self.micro_batch_size = t.seq_length, t.micro_batch_size
        self.num_microbatches = micro_batches_per_step(t, layout.dp)
        self.progress = Progress()
        self.metrics: Tracker | None = None
        self.arch = _model_arch(config.model)
        self.peak_tflops = _peak_tflops(t.peak_tflops, layout.on_gpu)
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
        """``tflops`` (model TFLOP/s per device, :mod:`afm_core.engine.flops`) and ``mfu`` (against
        ``self.peak_tflops``; None without one) of the step just taken in ``seconds``; both None without the
        model's architecture. Every data-parallel rank trains ``global_batch_size / dp`` sequences like this one's."""
        if self.arch is None or seconds <= 0:
            return {"tflops": None, "mfu": None}
        layout = self.layout
        tokens = self.config.trainer.global_batch_size * self.seq_length
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
        ids: dict[str, str] = {}
        if self.layout.is_rank0:
            c = self.config
            self.metrics = Tracker(self.run_dir, list(c.logger or ["console"]), config=c.logged or asdict(c),
                                   job_type="sft", tracking=asdict(c.tracking), run_ids=self.progress.run_ids,
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
        # the step-0 eval's point alone is not drawn unless nothing will train: matplotlib's import and first draw
        # (0.4 s of a 3.7 s rank start on an AVX512 core) stay off the way to the first step; later evals draw all
        if self.layout.is_rank0 and (self.progress.step > 0 or self.max_steps == 0):
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
        t = self.config.trainer
        resumed_from = self._resume()
        self._open_tracker()
        profiler = StepProfiler(asdict(self.config.profile), self.run_dir, self.layout.rank, self.layout.on_gpu)
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
            want_checkpoint, stop = self.preemption.boundary_flags(self.layout.on_gpu)
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


def _model_arch(model: ModelConfig | None) -> ModelArch | None:
    """The architecture of the ``model`` preset, or None without one (or with one that is not a valid preset)."""
    if model is None:
        return None
    try:
        return load_preset(asdict(model)).arch
    except PresetError:
        return None


def _peak_tflops(configured: float | None, on_gpu: bool) -> float | None:
    """``trainer.peak_tflops``, else the datasheet peak of this rank's CUDA device, else None (CPU, unknown)."""
    if configured:
        return float(configured)
    if not on_gpu:
        return None
    return datasheet_peak_tflops(torch.cuda.get_device_name())
