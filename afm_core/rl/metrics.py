"""What one rollout step reports: the metrics.jsonl record (:func:`step_record`), its rollout statistics
(:func:`rollout_metrics`), the ``rl.png`` curves and the console line (:class:`RLMetricsLog`)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from afm_core.config.rl import RLConfig
from afm_core.engine.metrics import plot_panels
from afm_core.rl.checkpoint import RLProgress
from afm_core.rl.dynamic_sampling import DynamicSamplingStats
from afm_core.rl.prompts import PromptStream
from afm_core.rl.schedule import Stage
from afm_core.utils.tracking import Tracker, flatten

if TYPE_CHECKING:  # torch: jobs.rl loads this module (the driver) where it only submits
    from afm_core.rl.grading import Sample


def rollout_metrics(samples: Sequence[Sample], all_generated: Sequence[Sample]) -> dict[str, object]:
    """Reward, accuracy, lengths, finish reasons and tool calls/errors per tool of one rollout step.

    ``samples`` are the trained ones; accuracy and tool counts are over everything generated in the step
    (:class:`~afm_core.rl.grading.Sample` s both)."""
    lengths = [len(s.response_ids) for s in samples] or [0]
    calls: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for s in all_generated:
        for name, error in s.tool_calls:
            calls[name] += 1
            errors[name] += error is not None
    finish = Counter(s.finish_reason for s in all_generated)
    gen = len(all_generated) or 1
    return {
        "reward_mean": sum(s.reward for s in samples) / max(len(samples), 1),
        "reward_mean_generated": sum(s.reward for s in all_generated) / gen,
        "accuracy": sum(s.score > 0 for s in all_generated) / gen,
        "format_ok": sum(s.format > 0 for s in all_generated) / gen,
        "response_len_mean": sum(lengths) / len(lengths),
        "response_len_max": max(lengths),
        "generated_tokens_mean": sum(sum(s.response_mask) for s in samples) / max(len(samples), 1),
        "truncated_frac": finish.get("length", 0) / gen,
        "finish_reasons": dict(finish),
        "tool_calls": dict(calls),
        "tool_errors": dict(errors),
        "tool_calls_per_traj": sum(calls.values()) / gen,
    }


def step_record(
    progress: RLProgress,
    stage: Stage,
    seq_length: int,
    max_prompt_len: int,
    samples: Sequence[Sample],
    generated: Sequence[Sample],
    sampling: DynamicSamplingStats,
    train: Mapping[str, object],
    times: Mapping[str, float],
    stream: PromptStream,
    tool_metrics: Mapping[str, object] | None,
    environment: str,
    partial: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """The metrics.jsonl record of the rollout step ``progress.rollout_step`` (``split: train``): stage and
        lengths, :func:`rollout_metrics`, the dynamic sampler's stats (``sampling``, flattened by
        :meth:`~afm_core.rl.dynamic_sampling.DynamicSamplingStats.as_dict`), the trainer's (``train``), the time split
        (seconds), the data position, the tool servers' metrics and the rollout buffer's (``partial``:
    :func:`afm_core.rl.train_batch.partial_metrics`)."""
    return {
        "step": progress.rollout_step,
        "split": "train",
        "stage": stage.index,
        "max_response_len": stage.max_response_len,
        "seq_length": seq_length,
        "stage_seq_length": max_prompt_len + stage.max_response_len,
        **rollout_metrics(samples, generated),
        **sampling.as_dict(),
        **train,
        **times,
        "elapsed_s": progress.train_time_s,
        "prompts_consumed": progress.prompts_consumed,
        "data_epoch": stream.epoch,
        "data_offset": stream.offset,
        "tool_metrics": tool_metrics,
        "environment": environment,
        **(partial or {}),
    }


#: Seconds of wall between two redraws of ``rl.png`` by :meth:`RLMetricsLog.write` (a redraw re-reads the whole
#: metrics.jsonl: ~0.4 s at 8 steps on a 2-core CPU, growing with the run); the first step's is drawn at once and the
#: last one's at :meth:`RLMetricsLog.close`.
PLOT_INTERVAL_S = 30.0


def plot_rl(metrics_path: Path, png_path: Path) -> None:
    """Reward, accuracy and mean response length against the rollout step (``rl.png``)."""
    plot_panels(
        metrics_path,
        png_path,
        [("reward_mean", "reward (trained)"), ("accuracy", "accuracy"), ("response_len_mean", "response tokens")],
        xlabel="rollout step",
    )


class RLMetricsLog:
    """Rank 0's metrics sink: the job's :class:`~afm_core.utils.tracking.Tracker` (``RUN_DIR/metrics.jsonl``, cut
    back to ``progress.rollout_step`` on a resume, and the ``logger`` backends, continuing the runs whose ids the
    resumed checkpoint's ``progress.run_ids`` holds), ``rl.png`` and the console line; a no-op on the other ranks.
    Every rank's ``progress.run_ids`` is set to rank 0's (collective), so the next checkpoint carries them."""

    def __init__(self, config: RLConfig, progress: RLProgress, enabled: bool):
        import torch.distributed  # not at the top: jobs.rl loads this module (the driver) where it only submits

        self.run_dir, self.max_steps = Path(config.run_dir), config.trainer.max_steps
        self.log: Tracker | None = None
        self._plotted_at: float | None = None  # time.monotonic() of the last rl.png
        self._unplotted = False  # records written since
        if enabled:  # the run's whole config is its hyperparameters in the backends
            self.log = Tracker(self.run_dir, list(config.logger or ["console"]), config=asdict(config), job_type="rl",
                               tracking=asdict(config.tracking), run_ids=progress.run_ids,
                               resume_step=progress.rollout_step)  # fmt: skip
        shared = [self.log.run_ids if self.log is not None else {}]
        torch.distributed.broadcast_object_list(shared, src=0)
        progress.run_ids = dict(shared[0])

    def write(self, record: Mapping[str, object]) -> None:
        if self.log is None:
            return
        self.log.write(dict(record))
        self._unplotted = True
        if self._plotted_at is None or time.monotonic() - self._plotted_at >= PLOT_INTERVAL_S:
            self._plot()
        print(
            f"[rl] step {record['step']}/{self.max_steps}: reward {record['reward_mean']:.3f} acc "
            f"{record['accuracy']:.3f} len {record['response_len_mean']:.0f} kept "
            f"{record['kept_group_ratio']:.2f} gen {record['generate_s']:.1f}s train "
            f"{record.get('train_s', 0):.1f}s sync {record['weight_sync_s']:.2f}s",
            flush=True,
        )

    def write_validation(self, step: int, results: Mapping[str, Mapping[str, object]], seconds: float) -> None:
        """One ``split: val`` record at rollout step ``step``: each benchmark's metrics as ``<benchmark>/<key>``
        (the backends show ``val/<benchmark>/avg@k``), and ``val_s``."""
        if self.log is None:
            return
        values = {f"{name}/{key}": value for name, m in results.items() for key, value in flatten(m).items()}
        self.log.write({"step": step, "split": "val", **values, "val_s": seconds})
        scores = ", ".join(f"{name} avg@{m['k']} {m.get('avg@' + str(m['k']))}" for name, m in results.items())
        print(f"[rl] validation at step {step}: {scores} ({seconds:.1f}s)", flush=True)

    def _plot(self) -> None:
        plot_rl(self.run_dir / "metrics.jsonl", self.run_dir / "rl.png")
        self._plotted_at, self._unplotted = time.monotonic(), False

    def close(self) -> None:
        """``rl.png`` with every step written (a stopped run's too), then the backends closed."""
        if self.log is not None:
            if self._unplotted:
                self._plot()
            self.log.close()
