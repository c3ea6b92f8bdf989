"""Agentic DAPO with tool rollouts as a Hydra app, run through submitit (conf/rl.yaml).

    python -m jobs.rl recipe=rl_smoke                          # a few steps of a tiny model on this machine
    python -m jobs.rl recipe=rl_demo                           # SFT-warmed SmolLM2 on GSM8K with <code>
    python -m jobs.rl parallel.tp=1 cluster.dp=2               # 2 ranks, one vLLM engine each
    python -m jobs.rl cluster=slurm recipe=afm_code_rl_32b     # sbatch; resumes after preemption
    python -m jobs.rl hydra.run.dir=runs/rl/X                  # continue X from its latest checkpoint

Each rank runs ``afm_core.rl.driver.run_rl(cfg)``; on SIGUSR2 (Slurm timeout or preemption) it checkpoints at
the next rollout-step boundary and the job is requeued (afm_core.launch.requeue).
"""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

from afm_core.launch.submit import run_training_job


@hydra.main(config_path="../conf", config_name="rl", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any] | None:
    return run_training_job("afm_core.rl.driver.run_rl", cfg, job_name="rl")


if __name__ == "__main__":
    main()
