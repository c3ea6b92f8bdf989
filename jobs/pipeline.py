"""A chain of training stages as a Hydra app (conf/pipeline.yaml): each stage a job of its own, in order.

    python -m jobs.pipeline recipe=autocoa_demo                              # AutoCoA, 5 stages, CPU demo
    python -m jobs.pipeline recipe=autocoa_demo hydra.run.dir=runs/pipeline/X  # continue X at its stage and step
    python -m jobs.pipeline recipe=autocoa_demo cluster=slurm cluster.partition=gpu

Every stage's config is composed first (an SFT stage's checked against its schema): a bad override exits with
status 2 before anything runs. Then :func:`afm_core.launch.pipeline.run_pipeline` runs the stages
(``python -m jobs.sft`` / ``jobs.rl`` with the stage's overrides, the cluster settings and the previous stage's HF
export as ``model.hf_path``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import hydra
from hydra import compose
from omegaconf import DictConfig, OmegaConf

from afm_core.config import ConfigError, check_config, register_schemas
from afm_core.config.sft import SFTConfig
from afm_core.launch.pipeline import PipelineError, StageSpec, run_pipeline

register_schemas()  # the schemas the stages' defaults lists name (`- sft_schema`, `- rl_schema`)


def check_stage(spec: StageSpec, overrides: list[str]) -> None:
    """Compose the stage's config as its job will (Hydra errors on unknown keys); check an SFT stage's schema.

    Raises:
        ConfigError: a bad value or key, naming the stage.
    """
    run_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")), "unset")
    composable = [o for o in overrides if not o.startswith("hydra.")] + [f"run_dir={run_dir}"]
    try:
        cfg = compose(config_name=spec.job, overrides=composable)
        if spec.job == "sft":
            check_config(cfg, SFTConfig)
    except Exception as err:  # hydra's own errors (unknown key, missing group option) and schema errors
        raise ConfigError(f"stage {spec.name!r} ({spec.job}): {err}") from None


@hydra.main(config_path="../conf", config_name="pipeline", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any] | None:
    container = OmegaConf.to_container(cfg, resolve=True)
    try:
        summary = run_pipeline(container, check=check_stage)  # type: ignore[arg-type]
    except (ConfigError, ValueError) as err:
        print(f"jobs.pipeline: bad config: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except PipelineError as err:
        print(f"jobs.pipeline: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    print(json.dumps({k: v for k, v in summary.items() if k != "stages"}, indent=2, default=str))
    return summary


if __name__ == "__main__":
    main()
