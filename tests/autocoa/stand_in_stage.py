"""A stand-in for ``python -m jobs.sft|rl`` in pipeline tests: reads the Hydra overrides the pipeline passes,
records them, writes ``metrics.jsonl``, a ``checkpoints/`` dir and the ``hf/`` export into ``hydra.run.dir``;
fails once (exit 3, before the export) when ``AFM_TEST_FAIL_STAGE`` names its run dir's stage."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> int:
    job, overrides = sys.argv[1], sys.argv[2:]
    values = dict(o.split("=", 1) for o in overrides)
    run_dir = Path(values["hydra.run.dir"])
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    with (run_dir / "calls.jsonl").open("a") as f:
        f.write(json.dumps({"job": job, "overrides": overrides}) + "\n")
    marker = run_dir / "failed_once"
    failing = os.environ.get("AFM_TEST_FAIL_STAGE")
    if failing and run_dir.name.endswith(failing) and not marker.exists():
        marker.write_text("x")
        return 3
    if job == "sft":
        records = [{"step": 0, "split": "eval", "loss": 2.0}, {"step": 4, "split": "eval", "loss": 1.5}]
    else:
        records = [
            {"step": 1, "split": "train", "reward_mean_generated": 0.1, "accuracy": 0.0, "format_ok": 0.5},
            {"step": 2, "split": "train", "reward_mean_generated": 0.3, "accuracy": 0.25, "format_ok": 0.75},
        ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "hf").mkdir(exist_ok=True)
    (run_dir / "hf" / "config.json").write_text(json.dumps({"from": values.get("model.hf_path")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
