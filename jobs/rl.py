"""Agentic DAPO with tool rollouts as a Hydra app, run through submitit (conf/rl.yaml).

    python -m jobs.rl recipe=rl_smoke                          # a few steps of a tiny model on this machine
    python -m jobs.rl recipe=rl_demo                           # SFT-warmed SmolLM2 on GSM8K with <code>
    python -m jobs.rl parallel.tp=1 cluster.dp=2               # 2 ranks, one vLLM engine each
    python -m jobs.rl cluster=slurm recipe=afm_code_rl_32b     # sbatch; resumes after preemption
    python -m jobs.rl hydra.run.dir=runs/rl/X                  # continue X from its latest checkpoint

The composed config is checked against its typed schema (:mod:`afm_core.config.rl`) before anything starts: an
unknown key or a bad value exits with status 2 in seconds, naming the key; so do an absent prompt or validation
benchmark file, an unknown preset and a plug-in (``reward_fn``, a tool's ``_target_``) that does not import
(:func:`afm_core.rl.driver.check_inputs`). A ``cluster=slurm`` job is planned first
(:mod:`afm_core.launch.plan_gate`): one that does not fit its GPUs exits with status 3 before ``sbatch``
(``+plan.force=true`` submits anyway). The job carries the resolved config as plain containers; each rank checks
it into an ``RLConfig`` (:func:`afm_core.config.rl.rl_config`) and runs ``afm_core.rl.driver.run_rl`` on it; on
SIGUSR2 (Slurm timeout or preemption) it checkpoints at the next rollout-step boundary and the job is requeued
(afm_core.launch.requeue).
"""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

from afm_core.config import register_schemas
from afm_core.config.rl import RLConfig
from afm_core.config.timeouts import collective_timeout_min, rollout_wait_s
from afm_core.launch.submit import run_training_job
from afm_core.rl.driver import check_inputs

register_schemas()  # `- rl_schema` in conf/rl.yaml's defaults list: before @hydra.main composes


@hydra.main(config_path="../conf", config_name="rl", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any] | None:
    if cfg.parallel.get("collective_timeout_min") is None:  # outlast the longest rollout wait (not a fixed 30 min)
        wait = rollout_wait_s(cfg.rollout, cfg.algorithm.gen_batch_size)
        cfg.parallel.collective_timeout_min = collective_timeout_min(wait)
    return run_training_job(
        "afm_core.rl.driver.run_rl",
        cfg,
        job_name="rl",
        schema=RLConfig,
        check_inputs=check_inputs,
        load_cfg="afm_core.config.rl.rl_config",
    )


if __name__ == "__main__":
    main()
