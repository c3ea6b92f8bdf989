"""The pre-queue gate: every ``cluster=slurm`` submission is planned first, and one that does not fit its GPUs is
refused before ``sbatch`` (``+plan.force=true`` submits anyway)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from afm_core.launch.plan import make_plan, suggest
from afm_core.launch.plan_render import render, write_plan


class PlanRefused(RuntimeError):
    """The job does not fit its GPUs (the message names the numbers and the overrides that would fit)."""


def check_before_submit(cfg: Any, app: str) -> dict[str, Any] | None:
    """Run the plan for a ``cluster=slurm`` job (None for local jobs) and refuse one that does not fit.

    ``+plan.force=true`` submits anyway. The plan is written to ``RUN_DIR/plan.json`` and printed.

    Raises:
        PlanRefused: the plan says "does not fit"; the message has the plan table and suggested overrides.
    """
    from omegaconf import DictConfig, OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    if plain["cluster"]["name"] != "slurm":
        return None
    force = bool((plain.get("plan") or {}).get("force", False))
    plan = make_plan(plain, app)
    if plan["fits"] is False:
        plan["suggestion"] = suggest(plain, app)
    write_plan(plan, Path(plain["run_dir"]) / "plan.json")
    print(render(plan), flush=True)
    if plan["fits"] is False and not force:
        fix = " ".join(plan["suggestion"]) if plan.get("suggestion") else "no layout of these GPUs fits"
        raise PlanRefused(
            f"does not fit on {plan['target_gpu_gb']:g} GB GPUs "
            f"({'; '.join(plan['gpus'].get(str(int(plan['target_gpu_gb'])), {}).get('why_not', []))}); "
            f"would fit: {fix}; +plan.force=true submits anyway"
        )
    return plan
