"""Training metrics on rank 0: ``metrics.jsonl`` (one JSON object per logged step) and ``loss.png`` (redrawn at each
held-out eval once a step has trained: :meth:`afm_core.train.loop.SFTLoop._eval_and_log`).

Each line holds at least ``step``, ``split`` ("train" | "eval"), ``loss`` (masked token-mean CE), ``lr``,
``tokens`` (unmasked target tokens in that step) and ``tokens_per_s``; train lines add ``grad_norm``,
``input_tokens_per_s`` (all positions), ``tflops`` (model TFLOP/s per device) and ``mfu`` (against the device's
datasheet bf16 peak, ``trainer.peak_tflops``; null on CPU: :mod:`afm_core.engine.flops`), ``elapsed_s``... and
``time`` (unix seconds when the line was written, added by :class:`afm_core.utils.tracking.MetricsLog`). Lines are
appended and flushed one by one, so a crash loses at most the line being written.
On resume, lines past the checkpoint's step are dropped (atomic rewrite), so after any number of restarts
every ``(step, split)`` appears exactly once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from afm_core.utils.atomic import atomic_path
from afm_core.utils.jsonlog import read_jsonl_log


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a ``metrics.jsonl`` (see :func:`afm_core.utils.jsonlog.read_jsonl_log`)."""
    return read_jsonl_log(path)


def plot_losses(metrics_path: str | Path, png_path: str | Path) -> None:
    """Draw train and held-out loss against step from ``metrics.jsonl`` into ``png_path`` (atomic)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for split, style in (("train", dict(lw=1.0, alpha=0.8)), ("eval", dict(marker="o", lw=1.6))):
        points = [(r["step"], r["loss"]) for r in records if r["split"] == split and r.get("loss") is not None]
        if points:
            steps, losses = zip(*points)
            ax.plot(steps, losses, label="held-out" if split == "eval" else split, **style)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("masked token-mean CE (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(png_path) as temp:
        fig.savefig(temp, format="png")
    plt.close(fig)


def plot_panels(
    metrics_path: str | Path,
    png_path: str | Path,
    panels: list[tuple[str, str]],
    *,
    xlabel: str = "step",
    split: str = "train",
) -> None:
    """One panel per ``(metric key, label)`` against ``step`` from the ``split`` lines of ``metrics.jsonl``,
    side by side in ``png_path`` (atomic); missing or null values are skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in read_metrics(metrics_path) if r.get("split") == split]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), dpi=110, squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o", ms=3, lw=1.4)
        ax.set_xlabel(xlabel)
        ax.set_title(label)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(png_path) as temp:
        fig.savefig(temp, format="png")
    plt.close(fig)
