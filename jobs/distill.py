"""Multi-agent distillation into CoA trajectories, then the paper's SFT filters (conf/distill.yaml).

    python -m jobs.distill                                            # the embedded model as teacher, vLLM here
    python -m jobs.distill benchmarks=[gsm8k_train,hotpotqa500] distill.limit=20
    python -m jobs.distill teachers.main.backend=chat teachers.main.url=http://host:8000/v1 \\
        teachers.main.model=Qwen2.5-72B-Instruct                      # a `vllm serve` (or any OpenAI-compatible) URL
    python -m jobs.distill hydra.run.dir=runs/distill/X               # continue X: finished runs are not redone

The run dir holds ``runs.jsonl`` (every MAS run, every role message and tool call), ``sample_settings.json`` (the
settings its runs were drawn under: a resume under other teachers, roles, sampling or MAS limits exits with status
2 before the job is submitted, naming each field), ``trajectories.jsonl`` (the runs as CoA trajectories),
``sft_data/`` (the filtered SFT parquet, the ``jobs.prepare_data`` layout), ``report.json`` and ``filters.png``
(afm_core.distill).
"""

from __future__ import annotations

import json
from typing import Any

import hydra
from omegaconf import DictConfig

from afm_core.config.eval import DistillConfig
from afm_core.distill.runner import check_resume
from afm_core.launch.submit import run_job

LOAD_CFG = "afm_core.config.eval.distill_config"  # each rank's DistillConfig


@hydra.main(config_path="../conf", config_name="distill", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any] | None:
    # before the queue: a bad value fails here, and runs drawn under other settings are not mixed with new ones
    report = run_job("afm_core.distill.runner.run_distill", cfg, job_name="distill", schema=DistillConfig,
                     check_inputs=check_resume, on_preempt="afm_core.distill.runner.request_stop", load_cfg=LOAD_CFG)  # fmt: skip
    if report is not None:
        shown = {k: report[k] for k in ("runs", "total", "converted", "not_converted", "graded_correct",
                                         "filters", "split", "seconds_this_job", "sft_data", "sft_command")}  # fmt: skip
        print(json.dumps(shown, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()
