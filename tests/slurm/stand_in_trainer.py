"""A stand-in for ``afm_core.train.sft.run_sft`` with the same job contract, for testing the job layer fast.

Per rank: joins the gloo world from the exported env:// variables, resumes from the latest complete checkpoint
in ``RUN_DIR/checkpoints``, runs ``trainer.max_steps`` "steps" of ``trainer.step_s`` seconds each (a
deterministic float recurrence stands for the weights), logs ``metrics.jsonl`` (rank 0), checkpoints every
``trainer.save_interval`` steps and at the end, and stops at a step boundary after :func:`request_checkpoint`
(flag OR-reduced over ranks, as the real trainer does).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_stop = False


def request_checkpoint() -> None:
    """Signal-safe: checkpoint at the next step boundary, then return."""
    global _stop
    _stop = True


def mark_loaded(cfg: Any) -> Any:
    """A stand-in ``load_cfg`` (:class:`afm_core.launch.requeue.RequeueableJob`): the ``DictConfig`` with
    ``loaded_by`` set, which :func:`run` reports."""
    cfg.loaded_by = "mark_loaded"
    return cfg


def _latest(root: Path) -> tuple[int, float]:
    done = sorted(p for p in root.glob("step_*") if (p / "COMPLETE").is_file())
    if not done:
        return 0, 1.0
    state = json.loads((done[-1] / "COMPLETE").read_text())
    return state["step"], state["weight"]


def _save(root: Path, step: int, weight: float) -> None:
    final = root / f"step_{step:08d}"
    temp = root / f".tmp-step_{step:08d}"
    temp.mkdir(parents=True, exist_ok=True)
    (temp / "COMPLETE").write_text(json.dumps({"step": step, "weight": weight}))
    if not final.exists():
        os.replace(temp, final)


def run(cfg: Any) -> dict[str, Any]:
    global _stop
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = torch.tensor([1.0])
    dist.all_reduce(ranks)
    run_dir = Path(cfg.run_dir)
    root = run_dir / "checkpoints"
    step, weight = _latest(root)
    metrics = run_dir / "metrics.jsonl"
    if rank == 0:
        kept = [
            line
            for line in (metrics.read_text().splitlines() if metrics.exists() else [])
            if step and json.loads(line)["step"] <= step
        ]
        metrics.write_text("".join(line + "\n" for line in kept))
        print(f"stand-in: rank 0 of {world}, starting at step {step}", flush=True)
    stopped = False
    while step < cfg.trainer.max_steps:
        time.sleep(cfg.trainer.step_s)
        step += 1
        weight = weight * 1.0001 + step / 7.0
        if rank == 0:
            with metrics.open("a") as out:
                out.write(json.dumps({"step": step, "split": "train", "loss": 1.0 / step}) + "\n")
        requested = _stop
        if requested:  # cleared before the collective: a signal landing during it waits for the next step
            _stop = False
        flag = torch.tensor([float(requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() or step % cfg.trainer.save_interval == 0 or step == cfg.trainer.max_steps:
            dist.barrier()
            if rank == 0:
                _save(root, step, weight)
            dist.barrier()
        if flag.item() and step < cfg.trainer.max_steps:
            stopped = True
            break
    dist.destroy_process_group()
    return {
        "step": step,
        "weight": weight,
        "world_size": world,
        "ranks_seen": int(ranks.item()),
        "rank": rank,
        "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        "stopped_early": stopped,
        "loaded_by": cfg.get("loaded_by"),
    }
