"""The pre-queue gate: every ``cluster=slurm`` submission is planned first, and one that does not fit its GPUs is
refused before ``sbatch`` (``+plan.force=true`` submits anyway)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from afm_core.config.cluster import SlurmClusterConfig
from afm_core.launch.plan import JobConfig, make_plan, suggest
from afm_core.launch.plan_render import render, write_plan


class PlanRefused(RuntimeError):
    """The job does not fit its GPUs (the message names the numbers and the overrides that would fit)."""


def check_before_submit(job: JobConfig) -> dict[str, Any] | None:
    """Run the plan of a ``cluster=slurm`` job (its checked :class:`~afm_core.config.sft.SFTConfig` or
    :class:`~afm_core.config.rl.RLConfig`; None for local jobs) and refuse one that does not fit.

    ``+plan.force=true`` submits anyway. The plan is written to ``RUN_DIR/plan.json`` and printed.

    Raises:
        PlanRefused: the plan says "does not fit"; the message has the plan table and suggested overrides.
    """
    if not isinstance(job.cluster, SlurmClusterConfig):
        return None
    force = bool(job.plan.get("force", False))
    plan = make_plan(job)
    if plan["fits"] is False:
        plan["suggestion"] = suggest(job)
    write_plan(plan, Path(job.run_dir) / "plan.json")
    print(render(plan), flush=True)
    if plan["fits"] is False and not force:
        fix = " ".join(plan["suggestion"]) if plan.get("suggestion") else "no layout of these GPUs fits"
        raise PlanRefused(
            f"does not fit on {plan['target_gpu_gb']:g} GB GPUs "
            f"({'; '.join(plan['gpus'].get(str(int(plan['target_gpu_gb'])), {}).get('why_not', []))}); "
            f"would fit: {fix}; +plan.force=true submits anyway"
        )
    return plan
