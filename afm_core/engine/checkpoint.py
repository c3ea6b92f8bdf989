"""Atomic, resumable training checkpoints: the one protocol (:class:`Checkpointer`) both engines write through,
Megatron's part in megatron-core's ``dist_checkpointing`` format (:class:`MegatronShards`).

One checkpoint directory (``RUN_DIR/checkpoints`` and its stage/publish protocol:
:mod:`afm_core.engine.checkpoint_dirs`)::

    step_00000100/
        metadata.json, common.pt, __*.distcp   dist_checkpointing (torch_dist): model + optimizer shards,
                                               and common.pt with the step counters and LR scheduler state
        rank_00000.pt ...          per-rank state: python/numpy/torch/CUDA RNG + megatron RNG tracker,
                                   and the data loader state (sharded by DP rank)
        COMPLETE                   JSON {step, layout, engine: "megatron", time}; written last

Model and optimizer shards reshard across TP/PP/DP layouts (dist_checkpointing); the per-rank RNG state is
restored only when the layout is unchanged. DeepSpeed's engine (``trainer.engine=deepspeed``) writes its ZeRO
files in place of the ``dist_checkpointing`` ones through the same protocol
(:class:`afm_core.train.deepspeed_engine.DeepSpeedFiles`: ``COMPLETE`` says ``engine: "deepspeed"``, ``rank_*.pt``
holds the same keys) and resumes on the same layout only.

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
from typing import Any, Protocol

import numpy as np
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.utils import unwrap_model

from afm_core.engine.checkpoint_dirs import (
    checkpoint_dir_name,
    marker_engine,
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


def layout_key(layout: ParallelLayout) -> dict[str, int]:
    """The layout a checkpoint records (``COMPLETE``'s and ``rank_*.pt``'s ``layout``): world size, TP, PP, DP."""
    return {"world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp}


def rank_file(path: str | Path, rank: int) -> Path:
    """``rank_{rank:05d}.pt`` of checkpoint ``path``: that rank's layout, RNG and own state."""
    return Path(path) / f"rank_{rank:05d}.pt"


class EngineState(Protocol):
    """What an engine writes into a checkpoint and reads back, inside the :class:`Checkpointer`'s protocol:
    Megatron's ``dist_checkpointing`` shards (:class:`MegatronShards`), DeepSpeed's ZeRO files
    (``afm_core.train.deepspeed_engine.DeepSpeedFiles``)."""

    #: ``COMPLETE``'s ``engine`` field, and the ``trainer.engine`` that resumes the checkpoint.
    name: str
    #: Why a checkpoint of another layout cannot be loaded; None: it can (the shards reshard; the per-rank
    #: state is then not restored).
    same_layout_only: str | None

    def save(self, staging: Path, common: dict[str, Any]) -> None:
        """Write this rank's share of the model, optimizer and ``common`` (identical on every rank) into
        ``staging`` (collective; rank 0 created it)."""
        ...

    def check_saved(self, staging: Path) -> None:
        """Rank 0, after every rank saved: raise when ``staging`` lacks a file the engine must have written."""
        ...

    def load(self, path: Path) -> dict[str, Any]:
        """Load the model and optimizer from checkpoint ``path`` (collective); returns what ``save`` got as
        ``common``."""
        ...


class MegatronShards:
    """Megatron's part of a checkpoint: model and optimizer as ``dist_checkpointing`` (``torch_dist``) shards, and
    ``common`` in its ``common.pt`` (under ``afm``); loads at any TP/PP/DP layout.

    Args:
        model_chunks: the (DDP-wrapped) model chunks of this rank.
        optimizer: the megatron optimizer.
    """

    name: str = "megatron"
    same_layout_only: str | None = None

    def __init__(self, model_chunks: list[torch.nn.Module], optimizer: Any):
        self.model_chunks, self.optimizer = model_chunks, optimizer

    def save(self, staging: Path, common: dict[str, Any]) -> None:
        finish_param_gather(self.model_chunks)  # the distributed optimizer's deferred all-gather: no stale shards
        state = _sharded_state_dict(self.model_chunks, self.optimizer, is_loading=False)
        state["afm"] = common
        _use_in_process_write_results_queue()
        dist_checkpointing.save(state, str(staging))

    def check_saved(self, staging: Path) -> None:
        for name in ("metadata.json", "common.pt"):
            if not (staging / name).is_file():
                raise RuntimeError(f"dist_checkpointing.save left no {name} in {staging}")

    def load(self, path: Path) -> dict[str, Any]:
        state = _sharded_state_dict(self.model_chunks, self.optimizer, is_loading=True)
        loaded = dist_checkpointing.load(state, str(path))
        if len(self.model_chunks) == 1:
            unwrap_model(self.model_chunks[0]).load_state_dict(loaded["model"])
        else:
            for i, chunk in enumerate(self.model_chunks):
                unwrap_model(chunk).load_state_dict(loaded[f"model{i}"])
        self.optimizer.load_state_dict(loaded["optimizer"])
        return loaded["afm"]


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
    """The one checkpoint protocol of both SFT engines and the RL trainers: saves and loads the complete training
    state of one rank into ``root`` (collective calls), the engine's own files through an :class:`EngineState`.

    A save: rank 0 stages ``.tmp-step_N`` (:func:`~afm_core.engine.checkpoint_dirs.stage_checkpoint`: stale
    staging dirs removed, free space checked; its failure raised on every rank), every rank writes its engine
    files and ``rank_*.pt`` (layout, RNG, its own state; atomically), a barrier, then rank 0 checks the engine's
    files and publishes ``step_N`` (``COMPLETE`` with layout and engine, ``keep_last`` applied). A load: the
    ``COMPLETE`` marker, the engine it names, the layout, the engine's files, then this rank's RNG and state.

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

    def save(self, step: int, engine: EngineState, common: dict[str, Any], rank_state: dict[str, Any]) -> Path:
        """Write checkpoint ``step_{step}`` atomically; every rank must call it.

        Args:
            step: optimizer steps done.
            engine: what writes the model and optimizer (and ``common``).
            common: state identical on all ranks (step counters, LR scheduler).
            rank_state: this rank's own state (data loader); RNG states are added here.
        Returns:
            The final checkpoint directory.
        Raises:
            OSError: ``errno.ENOSPC`` on every rank when rank 0 finds too little free space (nothing written).
        """
        temp, started = staging_dir(self.root, step), time.time()
        # rank 0 prepares (free space checked) and every rank learns whether it could: no rank waits for a rank 0
        # that raised "no space" at a barrier
        on_rank0(self.layout.is_rank0, lambda: stage_checkpoint(self.root, step).mkdir())
        engine.save(temp, common)
        with atomic_path(rank_file(temp, self.layout.rank)) as path:
            torch.save({"layout": layout_key(self.layout), "rng": rng_state(), **rank_state}, path)
        torch.distributed.barrier()

        def publish() -> None:
            engine.check_saved(temp)
            publish_checkpoint(
                self.root,
                step,
                layout=layout_key(self.layout),
                engine=engine.name,
                keep_last=self.keep_last,
                started=started,
                nodes=self.layout.nodes,
            )

        on_rank0(self.layout.is_rank0, publish)
        return self.root / checkpoint_dir_name(step)

    def load(self, path: str | Path, engine: EngineState) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load the engine's state from ``path`` and restore this rank's RNG.

        Returns:
            ``(common, rank_state)``: what :meth:`save` got as ``common``, and this rank's saved ``rank_state``
            (empty when the layout changed: RNG and data-loader state are then not restored).
        Raises:
            FileNotFoundError: ``path`` is not a complete checkpoint.
            ValueError: ``path`` was written by another engine, or with another layout by an engine whose
                checkpoints do not reshard (``engine.same_layout_only``).
        """
        path = Path(path)
        marker = read_marker(path)
        written_by = marker_engine(marker)
        if written_by != engine.name:
            raise ValueError(f"{path}: written by the {written_by} engine; resume it with trainer.engine={written_by}")
        saved_layout, layout = marker["layout"], layout_key(self.layout)
        if saved_layout != layout and engine.same_layout_only is not None:
            raise ValueError(
                f"{path}: saved with layout {saved_layout}, this run has {layout}; {engine.same_layout_only}"
            )
        common = engine.load(path)
        own = rank_file(path, self.layout.rank)
        if saved_layout != layout or not own.is_file():
            log.warning(
                "checkpoint %s was saved with layout %s, now %s: RNG and data-loader state not restored",
                path,
                saved_layout,
                layout,
            )
            return common, {}
        # Our own file (RNG states hold python tuples and numpy arrays): not weights-only.
        rank_state = torch.load(own, map_location="cpu", weights_only=False)
        set_rng_state(rank_state.pop("rng"))
        rank_state.pop("layout")
        return common, rank_state
