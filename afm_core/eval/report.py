"""Eval outputs a person reads: ``metrics.json``, ``report.md`` (the table) and PNG plots; and run comparison."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from afm_core.eval.metrics import standard_error
from afm_core.eval.samples import read_samples
from afm_core.utils.atomic import atomic_path, atomic_write_json, atomic_write_text


def _avg_key(m: Mapping[str, Any]) -> str:
    return f"avg@{m['k']}"


def markdown_table(metrics: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per benchmark: n, k, avg@k ± SE, pass@k, maj@k, best-of-3, tool calls, format, errors."""
    rows = ["| benchmark | n | k | avg@k (± SE) | pass@1 | pass@k | maj@k | best-of-3 | tool calls/problem | valid format | grader errors | finish reasons |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, m in metrics.items():
        k = m["k"]
        best = m.get("best_of_3")
        reasons = ", ".join(f"{r} {c}" for r, c in sorted(m.get("finish_reasons", {}).items(), key=lambda x: -x[1]))
        rows.append(
            f"| {name} | {m['n']} | {k} | {100 * m[_avg_key(m)]:.1f} ± {100 * m[_avg_key(m) + '_se']:.1f} | "
            f"{100 * m['pass@1']:.1f} | {100 * m[f'pass@{k}']:.1f} | {100 * m[f'maj@{k}']:.1f} | "
            f"{'—' if best is None else f'{100 * best:.1f}'} | {m['tool_calls_per_problem']:.2f} | "
            f"{100 * m['format_valid']:.0f}% | {m['grader_errors']} | {reasons} |"
        )
    return "\n".join(rows)


def write_report(run_dir: Path, metrics: Mapping[str, Mapping[str, Any]], info: Mapping[str, Any]) -> None:
    """``metrics.json``, ``report.md`` and ``eval.png`` in ``run_dir`` (each written atomically)."""
    atomic_write_json(run_dir / "metrics.json", dict(metrics))
    lines = [f"# Evaluation: {info.get('model', '')}", ""]
    lines += [f"- {key}: {value}" for key, value in info.items()]
    lines += ["", "Scores in %. avg@k is the mean over k samples (the paper's pass@1); pass@k is the unbiased "
              "estimator; maj@k votes on final answers; best-of-3 picks by the model's own <double_check> score.", "",
              markdown_table(metrics), ""]  # fmt: skip
    for name, m in metrics.items():
        details = {key: m[key] for key in ("tool_calls", "tool_errors", "reasons", "by_level") if m.get(key)}
        if details:
            lines += [f"## {name}", "", "```json", json.dumps(details, indent=1), "```", ""]
    atomic_write_text(run_dir / "report.md", "\n".join(lines))
    plot_metrics(metrics, run_dir / "eval.png")


def plot_metrics(metrics: Mapping[str, Mapping[str, Any]], png_path: Path) -> None:
    """Two panels: avg@k / pass@k / maj@k per benchmark, and finish reasons per benchmark (stacked)."""
    import matplotlib  # here: only the plot needs it (jobs.eval imports the runner, and so this module, to submit)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(metrics)
    if not names:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(names) + 4), 4.5))
    width, top = 0.25, 5.0
    for i, (label, key) in enumerate((("avg@k", "avg"), ("pass@k", "pass"), ("maj@k", "maj"))):
        values = [100 * metrics[n][f"{key}@{metrics[n]['k']}"] for n in names]
        top = max(top, *values)
        left.bar([x + (i - 1) * width for x in range(len(names))], values, width, label=label)
    left.set_ylim(0, min(100.0, top * 1.15))
    left.set_xticks(range(len(names)), names, rotation=20)
    left.set_ylabel("score (%)")
    left.set_title("scores")
    left.legend()
    reasons = sorted({r for n in names for r in metrics[n].get("finish_reasons", {})})
    bottom = [0.0] * len(names)
    for reason in reasons:
        counts = [metrics[n].get("finish_reasons", {}).get(reason, 0) for n in names]
        right.bar(range(len(names)), counts, bottom=bottom, label=reason)
        bottom = [b + c for b, c in zip(bottom, counts)]
    right.set_xticks(range(len(names)), names, rotation=20)
    right.set_ylabel("samples")
    right.set_title("finish reasons")
    right.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(png_path) as temp:
        fig.savefig(temp, format="png", dpi=110)
    plt.close(fig)


def compare_scores(run_a: Path, run_b: Path) -> list[dict[str, Any]]:
    """Per-benchmark avg@k deltas (B − A) with standard errors, from the two runs' ``samples.jsonl``.

    Problems present in both runs are paired (SE of the per-problem differences); the rest are unpaired.

    Returns:
        One dict per benchmark: ``benchmark``, ``n_paired``, ``a``, ``b``, ``delta``, ``se``, ``z`` (fractions,
        not points; ``z`` is NaN when the SE is 0).

    Raises:
        FileNotFoundError: a run has no ``samples.jsonl``.
    """
    per: list[dict[tuple[str, str], list[float]]] = []
    for run in (run_a, run_b):
        path = Path(run) / "samples.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: not an eval run dir")
        scores: dict[tuple[str, str], list[float]] = {}
        for s in read_samples(path):
            scores.setdefault((s["benchmark"], str(s["problem_id"])), []).append(float(s["score"]))
        per.append(scores)
    out = []
    for bench in sorted({b for b, _ in per[0]} | {b for b, _ in per[1]}):
        a = {p: sum(v) / len(v) for (b, p), v in per[0].items() if b == bench}
        b = {p: sum(v) / len(v) for (bb, p), v in per[1].items() if bb == bench}
        common = sorted(set(a) & set(b))
        if common:
            diffs = [b[p] - a[p] for p in common]
            delta, se = sum(diffs) / len(diffs), standard_error(diffs)
            mean_a, mean_b = sum(a[p] for p in common) / len(common), sum(b[p] for p in common) / len(common)
        else:
            mean_a = sum(a.values()) / len(a) if a else math.nan
            mean_b = sum(b.values()) / len(b) if b else math.nan
            delta = mean_b - mean_a
            se = math.hypot(standard_error(list(a.values())), standard_error(list(b.values())))
        z = delta / se if se > 0 else math.nan
        out.append({"benchmark": bench, "n_paired": len(common), "a": mean_a, "b": mean_b, "delta": delta, "se": se,
                    "z": z})  # fmt: skip
    return out


def compare_runs(run_a: Path, run_b: Path) -> str:
    """:func:`compare_scores` as a markdown table (points).

    Raises:
        FileNotFoundError: a run has no ``samples.jsonl``.
    """
    rows = [f"A = {run_a}", f"B = {run_b}", "",
            "| benchmark | n paired | A avg | B avg | B − A | SE | z |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in compare_scores(run_a, run_b):
        rows.append(f"| {r['benchmark']} | {r['n_paired']} | {100 * r['a']:.1f} | {100 * r['b']:.1f} | "
                    f"{100 * r['delta']:+.1f} | {100 * r['se']:.1f} | {r['z']:+.2f} |")  # fmt: skip
    return "\n".join(rows)
