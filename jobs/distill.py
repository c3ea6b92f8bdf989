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
import sys
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from afm_core.config import ConfigError, check_config
from afm_core.config.eval import DistillConfig
from afm_core.launch.submit import submit


@hydra.main(config_path="../conf", config_name="distill", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any] | None:
    try:
        check_config(cfg, DistillConfig)
    except ConfigError as err:
        print(f"jobs.distill: bad config: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    from afm_core.distill.runner import check_resume

    try:  # before the queue: runs drawn under other settings are not mixed with new ones in one run dir
        check_resume(OmegaConf.to_container(cfg, resolve=True))
    except ValueError as err:
        print(f"jobs.distill: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    report = submit(
        "afm_core.distill.runner.run_distill",
        cfg,
        on_preempt="afm_core.distill.runner.request_stop",
        job_name="distill",
    )
    if report is not None:
        shown = {k: report[k] for k in ("runs", "total", "converted", "not_converted", "graded_correct",
                                         "filters", "split", "seconds_this_job", "sft_data", "sft_command")}  # fmt: skip
        print(json.dumps(shown, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()
