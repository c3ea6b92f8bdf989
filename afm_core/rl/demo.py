"""The summary of the RL learning-signal chain (``make rl-demo``, ``conf/recipe/rl_demo_pipeline.yaml``).

The chain (:mod:`afm_core.launch.pipeline`) trains a warm start, selects a learnable slice of RL prompts and a
disjoint held-out slice with ``jobs.filter_rl`` (problems with 0 < pass@k < 1 under the warm start), evaluates the
warm start on the held-out slice with *another* seed than the one that selected it (selection bias: a slice chosen
for being sometimes solved regresses toward the mean when sampled again) and, in the same eval job, on the whole
held-out set; trains with DAPO on the train slice; and evaluates the trained policy with that same fresh seed.
:func:`rl_demo_report` reads the stages' outputs and writes what the README reports: the paired avg@k change on the held-out slice with its standard error and z
(:func:`afm_core.eval.report.compare_scores`), the full held-out set before and after, the RL phase's step times and
the slope of the trained reward over rollout steps (ordinary least squares, its standard error from the residuals).
"""

from __future__ import annotations

import json
import math
import resource
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: The stage names the report reads (``conf/recipe/rl_demo_pipeline.yaml``).
STAGES = ("warm", "heldout_slice", "train_slice", "before", "rl", "after")
#: The held-out slice's benchmark name in the before/after eval jobs: the stem of ``jobs.filter_rl``'s
#: ``rl_data.parquet`` (``benchmark_files``); the job's other benchmark is the whole held-out set.
SLICE = "rl_data"


def ols_slope(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares slope of ``ys`` on ``xs`` and its standard error (``nan`` with fewer than 3 points).

    SE = sqrt(sum(residual^2) / (n - 2) / sum((x - mean x)^2)) (the textbook simple-regression formula).
    """
    n = len(xs)
    if n < 3:
        return math.nan, math.nan
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return math.nan, math.nan
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
    return slope, math.sqrt(residual / (n - 2) / sxx)


def _points(value: float) -> float:
    return round(100 * value, 2) if math.isfinite(value) else value


def _avg_at_k(run_dir: Path, slice_: bool) -> tuple[float, int, int]:
    """avg@k (fraction), problems and k of the held-out slice (``slice_``) or of the other benchmark, the whole
    held-out set, in an eval run dir's ``metrics.json``."""
    metrics = json.loads((run_dir / "metrics.json").read_text(encoding="utf-8"))
    (bench,) = [m for name, m in metrics.items() if isinstance(m, dict) and (name == SLICE) == slice_]
    key = next(k for k in bench if k.startswith("avg@") and not k.endswith("_se"))
    return float(bench[key]), int(bench.get("n", 0)), int(key.removeprefix("avg@"))


def rl_demo_report(run_dir: Path, stages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The chain's headline numbers (``summary.json`` of ``make rl-demo``; avg@k in points).

    Returns:
        ``heldout_slice`` {``n_problems``, ``k``, ``before``, ``after``, ``delta``, ``se``, ``z``, ``selection``},
        ``full_heldout`` {``before``, ``after``}, ``train_slice`` {``n_problems``}, ``reward_slope`` {``per_step``,
        ``se``, ``z``}, ``median_step_s``, ``rl_wall_s``, ``total_wall_s``, ``max_rss_gib`` (the largest resident
        set of any process the chain waited for), ``curve_png``, ``machine`` (:func:`afm_core.utils.hardware.machine_summary`
        of the machine that wrote the report, and ``precision``: the RL stage's ``trainer.precision`` with ``auto``
        resolved as its trainer resolves it here).

    Raises:
        KeyError: a stage of :data:`STAGES` is missing from ``stages``.
        FileNotFoundError: a stage's output is missing.
    """
    from afm_core.engine.metrics import read_metrics
    from afm_core.eval.report import compare_scores
    from afm_core.utils.hardware import machine_summary

    by_name = {s["name"]: s for s in stages}
    missing = [name for name in STAGES if name not in by_name]
    if missing:
        raise KeyError(f"rl_demo_report: the chain has no stage(s) {missing} (expected {', '.join(STAGES)})")
    dirs = {name: Path(by_name[name]["run_dir"]) for name in STAGES}
    (paired,) = [r for r in compare_scores(dirs["before"], dirs["after"]) if r["benchmark"] == SLICE]
    _, n_slice, k = _avg_at_k(dirs["before"], slice_=True)
    selection = json.loads((dirs["heldout_slice"] / "filter_report.json").read_text(encoding="utf-8"))
    train_selection = json.loads((dirs["train_slice"] / "filter_report.json").read_text(encoding="utf-8"))
    steps = [r for r in read_metrics(dirs["rl"] / "metrics.jsonl") if r.get("split") == "train"]
    reward_key = "reward_mean_generated" if steps and "reward_mean_generated" in steps[0] else "reward_mean"
    slope, slope_se = ols_slope([r["step"] for r in steps], [r[reward_key] for r in steps])
    before_full, after_full = _avg_at_k(dirs["before"], slice_=False)[0], _avg_at_k(dirs["after"], slice_=False)[0]
    max_rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # Linux: KiB
    return {
        "heldout_slice": {
            "n_problems": n_slice,
            "k": k,
            "before": _points(paired["a"]),
            "after": _points(paired["b"]),
            "delta": _points(paired["delta"]),
            "se": _points(paired["se"]),
            "z": round(paired["z"], 2) if math.isfinite(paired["z"]) else paired["z"],
            "selection": {
                "k": selection["samples_per_prompt"],
                "rule": selection["rule"],
                "pass_rate_histogram": selection.get("pass_rate_histogram"),
            },
        },
        "full_heldout": {"before": _points(before_full), "after": _points(after_full)},
        "train_slice": {"n_problems": train_selection["counts"].get("written", 0)},
        "reward_slope": {
            "key": reward_key,
            "per_step": slope,
            "se": slope_se,
            "z": slope / slope_se if slope_se and math.isfinite(slope_se) else math.nan,
        },
        "median_step_s": round(statistics.median(r["step_s"] for r in steps), 1) if steps else None,
        "rl_wall_s": by_name["rl"].get("seconds"),
        "total_wall_s": round(sum(float(s.get("seconds") or 0.0) for s in stages), 1),
        "max_rss_gib": round(max_rss_kib / 2**20, 2),
        "curve_png": str(dirs["rl"] / "rl.png"),
        "machine": {**machine_summary(), "precision": _rl_precision(dirs["rl"])},
    }


def _rl_precision(rl_dir: Path) -> str:
    """The precision the RL stage trained in: its ``trainer.precision`` (``.hydra/config.yaml``) as its trainer
    resolves it on this machine (:func:`afm_core.engine.distributed.training_dtype`)."""
    import torch
    from omegaconf import OmegaConf

    from afm_core.engine.distributed import training_dtype

    precision = str(OmegaConf.load(rl_dir / ".hydra" / "config.yaml").trainer.precision)
    return "bf16" if training_dtype(precision, warn=False) == torch.bfloat16 else "fp32"
