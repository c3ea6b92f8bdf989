"""Atomic, resumable training checkpoints: the one protocol (:class:`Checkpointer`) both engines write through,
Megatron's part in megatron-core's ``dist_checkpointing`` format (:class:`MegatronShards`).

One checkpoint directory (``RUN_DIR/checkpoints`` and its stage/publish protocol:
:mod:`afm_core.engine.checkpoint_dirs`)::

    step_00000100/
        metadata.json, common.pt, __*.distcp   dist_checkpointing (torch_dist): model + optimizer shards,
                                               and common.pt with the step counters and LR scheduler state
        rank_00000.pt ...          per-rank state: python/numpy/torch/CUDA RNG + megatron RNG tracker,
                                   and the data loader state (sharded by DP rank)
        lora.json                  LoRA runs only: {lora: model.lora's rank/alpha/dropout/targets, base: the
                                   base model's identity (hf_weights.base_identity)}
        COMPLETE                   JSON {step, layout, engine: "megatron", time}; written last

With LoRA adapters on (:mod:`afm_core.models.lora`) the shards hold the adapters and their optimizer state only
(the base is frozen and comes from its HF checkpoint, loaded before a resume); ``lora.json`` names the base, and a
resume onto another base, another adapter shape, or a full-model checkpoint into a LoRA run (and back) is refused
before any shard is read. The adapters' TP split is declared to ``dist_checkpointing`` here
(:func:`adapter_sharded_state_dict`), so adapter checkpoints reshard across layouts as the weights do.

Model and optimizer shards reshard across TP/PP/DP layouts (dist_checkpointing); the per-rank RNG state is
restored only when the layout is unchanged. DeepSpeed's engine (``trainer.engine=deepspeed``) writes its ZeRO
files in place of the ``dist_checkpointing`` ones through the same protocol
(:class:`afm_core.train.deepspeed_engine.DeepSpeedFiles`: ``COMPLETE`` says ``engine: "deepspeed"``, ``rank_*.pt``
holds the same keys) and resumes on the same layout only.

One module (over 400 lines) because the protocol, Megatron's engine state and its adapters-only variant write
and check the same files.

The optimizer's sharded state dict is built with ``is_loading=True`` when loading: only then does megatron-core
create the AdamW moments to load into (``init_state_fn`` in ``megatron/core/optimizer/optimizer.py``
``sharded_state_dict``; without it nothing is loaded). The DistributedOptimizer uses the ``fully_reshardable``
format (``megatron/core/optimizer/distrib_optimizer.py``; its default format fails to save in megatron-core
0.16.1).
"""

from __future__ import annotations

import json
import logging
import queue
import random
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint, unwrap_model

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
from afm_core.models.hf_weights import base_dir_of, base_identity, finish_param_gather
from afm_core.models.lora import is_adapter_name, lora_config_of
from afm_core.utils.atomic import atomic_path, atomic_write_json

log = logging.getLogger(__name__)

_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
#: The LoRA checkpoint's record of its adapters and their base (module docstring).
LORA_RECORD = "lora.json"
#: The ``model.lora`` fields a resume must keep (the adapters' shapes and scale).
_LORA_FIELDS = ("rank", "alpha", "target_modules")


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
    ``common`` in its ``common.pt`` (under ``afm``); loads at any TP/PP/DP layout. A model with LoRA adapters
    saves and loads the adapters (and their optimizer state) only, with ``lora.json`` (module docstring).

    Args:
        model_chunks: the (DDP-wrapped) model chunks of this rank.
        optimizer: the megatron optimizer.
    """

    name: str = "megatron"
    same_layout_only: str | None = None

    def __init__(self, model_chunks: list[torch.nn.Module], optimizer: Any):
        self.model_chunks, self.optimizer = model_chunks, optimizer
        self.lora = lora_config_of(model_chunks)
        self._record: dict[str, Any] | None = None

    def lora_record(self) -> dict[str, Any]:
        """``lora.json``'s content for this model: the adapters' config and the base model's identity (computed
        once per process).

        Raises:
            ValueError: the base weights were not loaded from an HF checkpoint
                (:func:`~afm_core.models.hf_weights.load_hf_weights`), so the base is unknown.
        """
        if self._record is None:
            assert self.lora is not None
            base = base_dir_of(self.model_chunks)
            if base is None:
                raise ValueError(
                    "LoRA checkpoint: the base model's weights were not loaded from an HF checkpoint "
                    "(afm_core.models.hf_weights.load_hf_weights), so the base the adapters need is unknown"
                )
            lora = {"rank": self.lora.rank, "alpha": self.lora.alpha, "dropout": self.lora.dropout,
                    "target_modules": list(self.lora.target_modules)}  # fmt: skip
            self._record = {"lora": lora, "base": base_identity(base)}
        return self._record

    def save(self, staging: Path, common: dict[str, Any]) -> None:
        finish_param_gather(self.model_chunks)  # the distributed optimizer's deferred all-gather: no stale shards
        if self.lora is not None and torch.distributed.get_rank() == 0:
            atomic_write_json(staging / LORA_RECORD, self.lora_record())
        state = _sharded_state_dict(self.model_chunks, self.optimizer, is_loading=False)
        state["afm"] = common
        _use_in_process_write_results_queue()
        dist_checkpointing.save(state, str(staging))

    def check_saved(self, staging: Path) -> None:
        for name in ("metadata.json", "common.pt") + ((LORA_RECORD,) if self.lora is not None else ()):
            if not (staging / name).is_file():
                raise RuntimeError(f"dist_checkpointing.save left no {name} in {staging}")

    def check_compatible(self, path: Path) -> None:
        """Raise before anything is loaded when checkpoint ``path`` does not fit this model: adapters vs a full
        model, another ``model.lora`` shape, another base model.

        Raises:
            ValueError: names the field (``model.lora.rank``, ``model.lora.alpha``, ``model.lora.target_modules``,
                or the base model, ``model``) and both values.
        """
        saved, lora = read_lora_record(path), self.lora
        if saved is None and lora is None:
            return
        if saved is None:
            assert lora is not None
            raise ValueError(
                f"{path}: a full-model checkpoint, but this run trains LoRA adapters (model.lora.rank={lora.rank}); "
                "resume it with model.lora.rank=0, or train adapters on its HF export (jobs.export, then "
                "model.hf_path=...)"
            )
        if lora is None:
            raise ValueError(
                f"{path}: holds LoRA adapters only (model.lora.rank={saved['lora']['rank']}), but this run has no "
                f"adapters; resume it with model.lora.rank={saved['lora']['rank']}"
            )
        ours = self.lora_record()
        for field in _LORA_FIELDS:
            if saved["lora"][field] != ours["lora"][field]:
                raise ValueError(
                    f"model.lora.{field}: {path} holds adapters with {field}={saved['lora'][field]}, this run has "
                    f"{ours['lora'][field]}; resume with the same value"
                )
        for field in ("config_sha256", "weights_sha256"):
            if saved["base"][field] != ours["base"][field]:
                raise ValueError(
                    f"model: {path} holds adapters trained on the base model {saved['base']['hf_dir']} "
                    f"({field} {saved['base'][field][:16]}), but this run's base {ours['base']['hf_dir']} has "
                    f"{field} {ours['base'][field][:16]}; resume with the same base model (model.name / "
                    "model.hf_path)"
                )

    def load(self, path: Path) -> dict[str, Any]:
        self.check_compatible(path)
        state = _sharded_state_dict(self.model_chunks, self.optimizer, is_loading=True)
        loaded = dist_checkpointing.load(state, str(path))
        keys = ["model"] if len(self.model_chunks) == 1 else [f"model{i}" for i in range(len(self.model_chunks))]
        for key, chunk in zip(keys, self.model_chunks, strict=True):
            load_model_state(chunk, loaded[key])
        self.optimizer.load_state_dict(loaded["optimizer"])
        return loaded["afm"]


def read_lora_record(path: str | Path) -> dict[str, Any] | None:
    """Checkpoint ``path``'s ``lora.json`` (its adapters' ``lora`` config and ``base`` identity), or None: a
    full-model checkpoint."""
    record = Path(path) / LORA_RECORD
    return json.loads(record.read_text()) if record.is_file() else None


def adapter_sharded_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The LoRA adapters' entries of ``model``'s (wrapped or not) sharded state dict, each declared with its TP
    split: ``B`` of a column-parallel base (``linear_qkv``, ``linear_fc1``) on dim 0 like the weight's rows (fc1's
    through megatron's ``apply_swiglu_sharded_factory``, as ``transformer/mlp.py`` declares fc1's weight: its rows
    are ``[gate; up]`` per rank), ``A`` of a row-parallel base (``linear_proj``, ``linear_fc2``) on dim 1 like the
    weight's columns, the others replicated (megatron's default for a parameter its layers do not know). At TP=1
    the same global tensors, so adapter checkpoints reshard across TP sizes."""
    model = unwrap_model(model)
    modules = dict(model.named_modules())
    dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
    out: dict[str, Any] = {}
    for key, sharded in model.sharded_state_dict().items():
        if not is_adapter_name(key):
            continue
        owner, which = key.rsplit(".", 1)
        module = modules[owner]
        column = module._afm_lora.column
        if (which == "lora_B") != column:  # A of a column-parallel base, B of a row-parallel one: replicated
            out[key] = sharded
            continue
        # the layer axis megatron prepends to a stacked layer's tensors: (axis, this layer's index, layers)
        layer_axes = tuple(
            (axis, sharded.global_offset[axis], sharded.axis_fragmentations[axis])
            for axis in range(sharded.prepend_axis_num)
        )
        split = make_tp_sharded_tensor_for_checkpoint(
            sharded.data,
            sharded.key,
            tp_axis=0 if column else 1,
            prepend_offsets=layer_axes,
            tp_group=module.tp_group,
            dp_cp_group=dp_cp_group,
        )
        if owner.endswith("linear_fc1") and module.config.gated_linear_unit:
            split = apply_swiglu_sharded_factory(split, layer_axes)
        out[key] = split
    return out


def model_sharded_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """What a checkpoint holds of ``model`` (wrapped or not): its sharded state dict, or with LoRA adapters the
    adapters' only (:func:`adapter_sharded_state_dict`)."""
    if lora_config_of([model]) is not None:
        return adapter_sharded_state_dict(model)
    return unwrap_model(model).sharded_state_dict()


def load_model_state(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Copy a loaded :func:`model_sharded_state_dict` into ``model`` (wrapped or not): every key, or with LoRA
    adapters every adapter (the frozen base keeps its weights).

    Raises:
        RuntimeError: an adapter (or, without adapters, any parameter) is missing from ``state``.
    """
    adapters = lora_config_of([model]) is not None
    result = unwrap_model(model).load_state_dict(state, strict=not adapters)
    missing = [k for k in result.missing_keys if is_adapter_name(k)]
    if adapters and (missing or result.unexpected_keys):
        raise RuntimeError(f"LoRA checkpoint: adapters missing {missing[:4]}, unexpected {result.unexpected_keys[:4]}")


def _sharded_state_dict(model_chunks: list[torch.nn.Module], optimizer: Any, *, is_loading: bool) -> dict:
    """Megatron-LM's layout: ``model`` (or ``model0``, ``model1``... per virtual stage) and ``optimizer``."""
    state: dict[str, Any] = {}
    if len(model_chunks) == 1:
        state["model"] = model_sharded_state_dict(model_chunks[0])
    else:
        for i, chunk in enumerate(model_chunks):
            state[f"model{i}"] = model_sharded_state_dict(chunk)
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
