"""RL data filtering by pass rate as a Hydra app, run through submitit (conf/filter_rl.yaml).

    python -m jobs.filter_rl filter_preset=web benchmark_files=[web.parquet] filter.sft_data=[DIR]  # N=32, r_q <= 0.3
    python -m jobs.filter_rl filter_preset=code benchmark_files=[code.parquet] model.hf_path=runs/sft/X/hf
    python -m jobs.filter_rl cluster=slurm cluster.partition=gpu ...      # sbatch; resumes after preemption
    python -m jobs.filter_rl hydra.run.dir=runs/filter_rl/X              # continue X: finished samples are kept

The run dir holds ``candidates.parquet``, ``samples.jsonl`` (the resume log), the eval's ``metrics.json`` /
``report.md``, ``filter_report.json`` and ``rl_data.parquet`` (afm_core.eval.filter_rl).
"""

from __future__ import annotations

import json
from typing import Any

import hydra
from omegaconf import DictConfig

from afm_core.config.eval import FilterRLConfig
from afm_core.eval.filter_rl import report_table
from afm_core.launch.submit import run_job

LOAD_CFG = "afm_core.config.eval.filter_rl_config"  # each rank's FilterRLConfig


@hydra.main(config_path="../conf", config_name="filter_rl", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any] | None:
    # before the queue: a bad value exits with status 2 here
    summary = run_job("afm_core.eval.filter_rl.run_filter", cfg, job_name="filter_rl", schema=FilterRLConfig,
                      on_preempt="afm_core.eval.runner.request_stop", load_cfg=LOAD_CFG)  # fmt: skip
    if summary is not None:
        if summary.get("report"):
            print(report_table(summary["report"]))
        print(json.dumps({k: v for k, v in summary.items() if k != "report"}, indent=2, default=str))
    return summary


if __name__ == "__main__":
    main()
