"""Atomic, resumable training checkpoints in megatron-core's ``dist_checkpointing`` format.

One checkpoint directory (``RUN_DIR/checkpoints`` and its stage/publish protocol:
:mod:`afm_core.engine.checkpoint_dirs`)::

    step_00000100/
        metadata.json, common.pt, __*.distcp   dist_checkpointing (torch_dist): model + optimizer shards,
                                               and common.pt with the step counters and LR scheduler state
        rank_00000.pt ...          per-rank state: python/numpy/torch/CUDA RNG + megatron RNG tracker,
                                   and the data loader state (sharded by DP rank)
        COMPLETE                   JSON {step, layout, engine: "megatron", time}; written last

Model and optimizer shards reshard across TP/PP/DP layouts (dist_checkpointing); the per-rank RNG state is
restored only when the layout is unchanged.

The optimizer's sharded state dict is built with ``is_loading=True`` when loading: only then does megatron-core
create the AdamW moments to load into (``init_state_fn`` in ``megatron/core/optimizer/optimizer.py``
``sharded_state_dict``; without it nothing is loaded). The DistributedOptimizer uses the ``fully_reshardable``
format (``megatron/core/optimizer/distrib_optimizer.py``; its default format fails to save in megatron-core
0.16.1).
"""

from __future__ import annotations

import logging
import queue
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core import dist_checkpointing
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.utils import unwrap_model

from afm_core.engine.checkpoint_dirs import (
    checkpoint_dir_name,
    on_rank0,
    publish_checkpoint,
    read_marker,
    stage_checkpoint,
    staging_dir,
)
from afm_core.engine.distributed import ParallelLayout
from afm_core.models.hf_weights import finish_param_gather
from afm_core.utils.atomic import atomic_path

log = logging.getLogger(__name__)

_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _use_in_process_write_results_queue() -> None:
    """Give megatron's checkpoint writer an in-process queue for its write results (called before every save; a
    no-op once the queue is set).

    ``FileSystemWriterAsync`` (``megatron/core/dist_checkpointing/strategies/filesystem_async.py``) passes a save's
    write results to ``retrieve_write_results`` through the module global ``_results_queue``, which
    ``_get_write_results_queue`` creates on first use as ``multiprocessing.get_context("spawn").Manager().Queue()``:
    a server process per rank, started at the first save (a synchronous one too), that imports the job's
    ``__main__`` chain again and stays alive until the job ends. The saves here are synchronous
    (``dist_checkpointing.save`` without ``async_sharded_save``): the function that puts the results runs in this
    process (its per-file writers are forked children that report through a queue of their own) and
    ``retrieve_write_results`` takes them with ``get_nowait`` right after, so a thread-safe in-process queue
    carries them; a ``multiprocessing.Queue`` would not (its ``put`` returns before a feeder thread delivers).
    Megatron-Bridge sets the same global when it resets async saving (NVIDIA-NeMo/Megatron-Bridge pull 4839). An
    async save (not used here) needs megatron's Manager queue back: it pickles the queue to a worker process.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.SimpleQueue()


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

    def save(
        self,
        step: int,
        model_chunks: list[torch.nn.Module],
        optimizer: Any,
        common: dict[str, Any],
        rank_state: dict[str, Any],
    ) -> Path:
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
        temp, started = staging_dir(self.root, step), time.time()
        # rank 0 prepares (free space checked) and every rank learns whether it could: no rank waits for a rank 0
        # that raised "no space" at a barrier
        on_rank0(self.layout.is_rank0, lambda: stage_checkpoint(self.root, step).mkdir())

        finish_param_gather(model_chunks)  # the distributed optimizer's deferred all-gather: no stale shards saved
        state = _sharded_state_dict(model_chunks, optimizer, is_loading=False)
        state["afm"] = common
        _use_in_process_write_results_queue()
        dist_checkpointing.save(state, str(temp))
        with atomic_path(temp / f"rank_{self.layout.rank:05d}.pt") as path:
            torch.save({"layout": _layout_key(self.layout), "rng": rng_state(), **rank_state}, path)
        torch.distributed.barrier()

        def publish() -> None:
            for name in ("metadata.json", "common.pt"):
                if not (temp / name).is_file():
                    raise RuntimeError(f"dist_checkpointing.save left no {name} in {temp}")
            publish_checkpoint(
                self.root,
                step,
                layout=_layout_key(self.layout),
                engine="megatron",
                keep_last=self.keep_last,
                started=started,
                nodes=self.layout.nodes,
            )

        on_rank0(self.layout.is_rank0, publish)
        return self.root / checkpoint_dir_name(step)

    def load(
        self, path: str | Path, model_chunks: list[torch.nn.Module], optimizer: Any
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
        marker = read_marker(path)
        if marker.get("engine", "megatron") != "megatron":
            raise ValueError(
                f"{path}: written by the {marker['engine']} engine; resume it with trainer.engine={marker['engine']}"
            )
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
            log.warning(
                "checkpoint %s was saved with layout %s, now %s: RNG and data-loader state not restored",
                path,
                saved_layout,
                _layout_key(self.layout),
            )
            return loaded["afm"], {}
        # Our own file (RNG states hold python tuples and numpy arrays): not weights-only.
        rank_state = torch.load(rank_file, map_location="cpu", weights_only=False)
        set_rng_state(rank_state.pop("rng"))
        rank_state.pop("layout")
        return loaded["afm"], rank_state
