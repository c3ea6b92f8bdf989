"""``jobs/sft.py`` with the stand-in trainer: the same Hydra config and job layer, seconds instead of minutes."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from afm_core.launch.submit import submit


@hydra.main(config_path="../../conf", config_name="sft", version_base="1.3")
def main(cfg: DictConfig) -> None:
    summary = submit(
        "tests.slurm.stand_in_trainer.run",
        cfg,
        on_preempt="tests.slurm.stand_in_trainer.request_checkpoint",
        job_name="stand-in",
    )
    if summary is not None:
        print("SUMMARY", summary)


if __name__ == "__main__":
    main()
