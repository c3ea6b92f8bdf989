"""Atomic, resumable training checkpoints in megatron-core's ``dist_checkpointing`` format.

Layout of ``RUN_DIR/checkpoints/``::

    step_00000100/                 a complete checkpoint (it holds a COMPLETE marker)
        metadata.json, common.pt, __*.distcp   dist_checkpointing (torch_dist): model + optimizer shards,
                                               and common.pt with the step counters and LR scheduler state
        rank_00000.pt ...          per-rank state: python/numpy/torch/CUDA RNG + megatron RNG tracker,
                                   and the data loader state (sharded by DP rank)
        COMPLETE                   JSON {step, layout, engine, time}; written last
    .tmp-step_00000200/            a save in progress (or killed): ignored, removed by the next save

A save writes everything into ``.tmp-step_N``, fsyncs it, writes ``COMPLETE`` and renames the directory to
``step_N`` (rank 0, after a barrier), so a checkpoint is either complete or absent: a crash at any point
leaves the previous complete checkpoint as the latest one. The last ``keep_last`` complete checkpoints are
kept. Model and optimizer shards reshard across TP/PP/DP layouts (dist_checkpointing); the per-rank RNG
state is restored only when the layout is unchanged.

Per the megatron CPU notes, the optimizer state is only loaded if its sharded state dict is built with
``is_loading=True``; the DistributedOptimizer uses the ``fully_reshardable`` format (the default one fails to
save in megatron-core 0.16.1).
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core import dist_checkpointing
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.utils import unwrap_model

from afm_core.train.distributed import ParallelLayout
from afm_core.utils.atomic import atomic_path, atomic_write_json, fsync_dir

log = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_TMP_PREFIX = ".tmp-"
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def checkpoint_dir_name(step: int) -> str:
    """``step_{step:08d}``."""
    return f"step_{step:08d}"


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``root`` as ``(step, path)``, oldest first (partial ones ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_complete_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root``, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def rng_state() -> dict[str, Any]:
    """This rank's RNG states: python, numpy, torch CPU, CUDA (if any) and megatron's RNG tracker."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _layout_key(layout: ParallelLayout) -> dict[str, int]:
    return {"world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp}


def _sharded_state_dict(model_chunks: list[torch.nn.Module], optimizer: Any, *, is_loading: bool) -> dict:
    """Megatron-LM's layout: ``model`` (or ``model0``, ``model1``... per virtual stage) and ``optimizer``."""
    state: dict[str, Any] = {}
    if len(model_chunks) == 1:
        state["model"] = unwrap_model(model_chunks[0]).sharded_state_dict()
    else:
        for i, chunk in enumerate(model_chunks):
            state[f"model{i}"] = unwrap_model(chunk).sharded_state_dict()
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=_OPTIMIZER_METADATA)
    return state


class Checkpointer:
    """Saves and loads the complete training state of one rank into ``root`` (collective calls).

    Args:
        root: ``RUN_DIR/checkpoints``.
        keep_last: complete checkpoints kept after each save (>= 1).
        layout: this rank's parallel layout.
    Raises:
        ValueError: ``keep_last < 1``.
    """

    def __init__(self, root: str | Path, keep_last: int, layout: ParallelLayout):
        if keep_last < 1:
            raise ValueError(f"trainer.keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.layout = layout

    def save(self, step: int, model_chunks: list[torch.nn.Module], optimizer: Any,
             common: dict[str, Any], rank_state: dict[str, Any]) -> Path:
        """Write checkpoint ``step_{step}`` atomically; every rank must call it.

        Args:
            step: optimizer steps done.
            model_chunks: the (DDP-wrapped) model chunks of this rank.
            optimizer: the megatron optimizer.
            common: state identical on all ranks (step counters, LR scheduler), saved once in common.pt.
            rank_state: this rank's own state (data loader); RNG states are added here.
        Returns:
            The final checkpoint directory.
        """
        final = self.root / checkpoint_dir_name(step)
        temp = self.root / f"{_TMP_PREFIX}{final.name}"
        if self.layout.is_rank0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"{_TMP_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)
            temp.mkdir()
        torch.distributed.barrier()

        state = _sharded_state_dict(model_chunks, optimizer, is_loading=False)
        state["afm"] = common
        dist_checkpointing.save(state, str(temp))
        with atomic_path(temp / f"rank_{self.layout.rank:05d}.pt") as path:
            torch.save({"layout": _layout_key(self.layout), "rng": rng_state(), **rank_state}, path)
        torch.distributed.barrier()

        if self.layout.is_rank0:
            for name in ("metadata.json", "common.pt"):
                if not (temp / name).is_file():
                    raise RuntimeError(f"dist_checkpointing.save left no {name} in {temp}")
            atomic_write_json(temp / COMPLETE_MARKER,
                              {"step": step, "layout": _layout_key(self.layout), "engine": "megatron",
                               "time": time.time()})
            fsync_dir(temp)
            if final.exists():  # the same step saved before (e.g. a re-run of a finished job)
                shutil.rmtree(final)
            temp.rename(final)
            fsync_dir(self.root)
            for _, old in complete_checkpoints(self.root)[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        torch.distributed.barrier()
        return final

    def load(self, path: str | Path, model_chunks: list[torch.nn.Module], optimizer: Any
             ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load model + optimizer shards from ``path`` (any TP/PP/DP layout) and restore this rank's RNG.

        Returns:
            ``(common, rank_state)``: what :meth:`save` got as ``common``, and this rank's saved
            ``rank_state`` (empty when the layout changed: RNG and data-loader state are then not restored).
        Raises:
            FileNotFoundError: ``path`` is not a complete checkpoint.
            ValueError: ``path`` was written by another engine (DeepSpeed).
        """
        path = Path(path)
        if not (path / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
        marker = json.loads((path / COMPLETE_MARKER).read_text())
        if marker.get("engine", "megatron") != "megatron":
            raise ValueError(f"{path}: written by the {marker['engine']} engine; resume it with "
                             f"trainer.engine={marker['engine']}")
        state = _sharded_state_dict(model_chunks, optimizer, is_loading=True)
        loaded = dist_checkpointing.load(state, str(path))
        if len(model_chunks) == 1:
            unwrap_model(model_chunks[0]).load_state_dict(loaded["model"])
        else:
            for i, chunk in enumerate(model_chunks):
                unwrap_model(chunk).load_state_dict(loaded[f"model{i}"])
        optimizer.load_state_dict(loaded["optimizer"])

        saved_layout = marker["layout"]
        rank_file = path / f"rank_{self.layout.rank:05d}.pt"
        if saved_layout != _layout_key(self.layout) or not rank_file.is_file():
            log.warning("checkpoint %s was saved with layout %s, now %s: RNG and data-loader state not restored",
                        path, saved_layout, _layout_key(self.layout))
            return loaded["afm"], {}
        # Our own file (RNG states hold python tuples and numpy arrays): not weights-only.
        rank_state = torch.load(rank_file, map_location="cpu", weights_only=False)
        set_rng_state(rank_state.pop("rng"))
        rank_state.pop("layout")
        return loaded["afm"], rank_state
