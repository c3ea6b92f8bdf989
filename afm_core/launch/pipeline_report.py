"""The summary of a finished chain (:mod:`afm_core.launch.pipeline`): each stage's headline metrics, read from the
files its job wrote (``metrics.jsonl``, ``metrics.json``, ``filter_report.json``), the markdown table of
``RUN_DIR/summary.md``, and the chain's ``report`` function, found by its dotted path."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def report_function(dotted: str) -> Callable[..., Any]:
    """The function at ``package.module.name``.

    Raises:
        ValueError: not importable (names the path).
    """
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"report={dotted!r}: not an importable function ({err})") from None


def stage_metrics(job: str, directory: Path) -> dict[str, Any]:
    """Headline metrics of a finished stage from its ``metrics.jsonl``.

    SFT: held-out loss at the first and the last eval (and, for the contrastive objective, held-out preference
    accuracy and margin); RL: first and last rollout step's reward, accuracy, format validity, tool calls per
    trajectory, and the simulated observations written.
    """
    from afm_core.engine.metrics import read_metrics  # the engine package's init installs megatron's import hooks

    if job == "eval" and (directory / "metrics.json").is_file():
        metrics = json.loads((directory / "metrics.json").read_text(encoding="utf-8"))
        return {bench: {key: value for key, value in m.items() if key.startswith(("avg@", "pass@")) or key == "n"}
                for bench, m in metrics.items() if isinstance(m, dict)}  # fmt: skip
    if job == "filter_rl" and (directory / "filter_report.json").is_file():
        report = json.loads((directory / "filter_report.json").read_text(encoding="utf-8"))
        return {"kept": report["counts"].get("kept", 0), "written": report["counts"].get("written", 0),
                "sampled": report["counts"].get("sampled", 0)}  # fmt: skip
    path = directory / "metrics.jsonl"
    if not path.is_file():
        return {}
    records = read_metrics(path)
    out: dict[str, Any] = {}
    if job == "sft":
        evals = [r for r in records if r.get("split") == "eval"]
        train = [r for r in records if r.get("split") == "train"]
        if evals:
            first, last = evals[0], evals[-1]
            out.update(steps=last["step"], eval_loss=[first["loss"], last["loss"]])
            if "pref_acc" in last:
                out.update(pref_acc=[first["pref_acc"], last["pref_acc"]], margin=[first["margin"], last["margin"]])
                out["eval_pairs"] = last.get("pairs")
        if train:
            out["train_s"] = round(train[-1].get("elapsed_s", 0.0), 1)
        return out
    steps = [r for r in records if r.get("split") == "train"]
    if steps:
        first, last = steps[0], steps[-1]
        out["steps"] = last["step"]
        for key in ("reward_mean_generated", "accuracy", "format_ok", "tool_calls_per_traj"):
            if key in last:
                out[key] = [first[key], last[key]]
        sim = [((r.get("tool_metrics") or {}).get("simulated") or {}).get("calls", 0) for r in steps]
        if any(sim):
            out["simulated_observations"] = sum(sim)
        out["environment"] = last.get("environment")
    return out


def summary_table(results: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table: one row per stage with its wall time, load average and headline metrics."""

    def pair(value: Any) -> str:
        if isinstance(value, list) and len(value) == 2:
            return " -> ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in value)
        return "" if value is None else str(value)

    lines = [
        "| stage | job | steps | wall (s) | load 1-min (start/end) | metrics (first -> last) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        m = dict(r.get("metrics") or {})
        steps = m.pop("steps", "")
        m.pop("train_s", None)
        shown = "; ".join(f"{k} {pair(v)}" for k, v in m.items() if v is not None)
        load = f"{r['loadavg_before'][0]:.1f} / {r['loadavg_after'][0]:.1f}" if r.get("loadavg_before") else ""
        lines.append(f"| {r['name']} | {r['job']} | {steps} | {r['seconds']:.0f} | {load} | {shown} |")
    return "\n".join(lines) + "\n"
