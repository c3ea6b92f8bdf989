"""Evaluate a model with tools on benchmarks, as a Hydra app run through submitit (conf/eval.yaml).

    python -m jobs.eval benchmarks=[gsm8k_test,math500,humaneval,hotpotqa500] eval.k=4 eval.limit=100
    python -m jobs.eval model.hf_path=runs/sft/X/hf                  # an SFT export
    python -m jobs.eval benchmark_files=[tasks.parquet]              # only this AFM/verl RL parquet or jsonl, as-is
    python -m jobs.eval cluster=slurm cluster.partition=gpu          # sbatch; resumes after preemption
    python -m jobs.eval hydra.run.dir=runs/eval/X                    # continue X: finished samples are skipped
    python -m jobs.eval compare runs/eval/A runs/eval/B              # per-benchmark deltas with standard errors

What will run (benchmarks, problems, samples) is printed before the job is submitted; a missing file or an
unknown preset exits with status 2 there. The run dir holds ``samples.jsonl`` (one line per problem and sample), ``metrics.json``, ``report.md`` and
``eval.png`` (afm_core.eval).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from afm_core.config.eval import EvalConfig
from afm_core.eval.report import compare_runs, markdown_table
from afm_core.launch.submit import run_job

LOAD_CFG = "afm_core.config.eval.eval_config"  # each rank's EvalConfig


@hydra.main(config_path="../conf", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any] | None:
    from afm_core.eval.runner import check_inputs  # here: the runner loads aiohttp, which `compare` does not need

    # before the queue: a bad value, a missing file or an unknown preset fails here, and the user sees what will run
    summary = run_job("afm_core.eval.runner.run_eval", cfg, job_name="eval", schema=EvalConfig, check_inputs=check_inputs,
                      on_preempt="afm_core.eval.runner.request_stop", load_cfg=LOAD_CFG)  # fmt: skip
    if summary is not None:
        print(markdown_table(summary["metrics"]))
        print(json.dumps({k: v for k, v in summary.items() if k != "metrics"}, indent=2, default=str))
    return summary


def compare(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m jobs.eval compare RUN_A RUN_B", file=sys.stderr)
        return 2
    print(compare_runs(Path(argv[0]), Path(argv[1])))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2:]))
    main()
