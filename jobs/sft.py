"""Observation-masked agentic SFT as a Hydra app, run through submitit (conf/sft.yaml).

    python -m jobs.sft                                        # this machine, rank-0 output streamed
    python -m jobs.sft parallel.tp=2 trainer.max_steps=5      # 2 local ranks
    python -m jobs.sft cluster=slurm cluster.partition=gpu    # sbatch; prints the job id and returns
    python -m jobs.sft cluster=slurm -m optim.lr=1e-5,2e-5    # one Slurm job array, one run dir per member
    python -m jobs.sft hydra.run.dir=runs/sft/X               # continue runs/sft/X from its latest checkpoint
    python -m jobs.sft resume=runs/sft/X                      # start a new run dir from X's latest checkpoint

The composed config is checked against its typed schema (:mod:`afm_core.config`) before anything is built or
submitted: a bad value exits with status 2 and one line naming the key and the valid values. A ``cluster=slurm``
job is planned first (:mod:`afm_core.launch.plan_gate`, ``RUN_DIR/plan.json``): one that does not fit its GPUs exits
with status 3 before ``sbatch``, naming the numbers and the overrides that would fit (``+plan.force=true``
submits anyway). The job carries the resolved config as plain containers; each rank checks it into an
``SFTConfig`` (:func:`afm_core.config.sft.sft_config`) and runs ``afm_core.train.sft.run_sft`` on it; on SIGUSR2
(Slurm timeout or preemption) the trainer checkpoints at the next step boundary and the job is requeued
(afm_core.launch.requeue).
"""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

from afm_core.config import register_schemas
from afm_core.config.sft import SFTConfig
from afm_core.launch.submit import run_training_job

register_schemas()  # `- sft_schema` in conf/sft.yaml's defaults list: before @hydra.main composes


@hydra.main(config_path="../conf", config_name="sft", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any] | None:
    return run_training_job(
        "afm_core.train.sft.run_sft", cfg, job_name="sft", schema=SFTConfig, load_cfg="afm_core.config.sft.sft_config"
    )


if __name__ == "__main__":
    main()
