"""The weight sync of a LoRA policy: the adapters alone go to vLLM, as a PEFT adapter the engine loads through its
LoRA support, instead of every weight of the model.

With ``model.lora`` the base weights never change in training, so the engine keeps the base it started with and
serves the trained adapters on top (vLLM ``enable_lora``: ``B @ A`` applied per request by its punica kernels,
``vllm/lora/punica_wrapper/``; vLLM-CPU's ``PunicaWrapperCPU`` has torch kernels). One sync (:func:`sync_adapter`):

1. :func:`afm_core.models.lora_hf.save_peft_adapter` gathers the adapters to whole HF-named tensors (TP
   all-gather, PP exchange; Megatron's fused ``linear_qkv`` / ``linear_fc1`` un-fused into ``q/k/v_proj`` and
   ``gate/up_proj``) and global rank 0 writes them as a PEFT adapter directory (``adapter_config.json`` +
   ``adapter_model.safetensors``), atomically, under the engine's ``lora_dir`` (the run dir's, seen by every
   rank of the job); every rank returns once it is complete (a barrier).
2. Each rank's engine swaps its served adapter for the new one
   (:meth:`~afm_core.rollout.vllm_inproc.InprocVLLMEngine.load_adapter`: ``remove_lora`` of the old, ``add_lora`` of
   a new ``LoRARequest`` with the next int id); every request from then on carries it. Its prefix cache is reset.
3. Rank 0 removes the directories of earlier syncs (every rank loaded them before the barrier of this one).

verl does the same for its LoRA rollouts (``docs/advance/ppo_lora.rst``: "only the LoRA weights are synced"; its
``verl/workers/rollout/vllm_rollout/`` removes and re-adds a ``LoRARequest`` each sync, from tensors through a
patched loader, ``verl/utils/vllm/utils.py`` ``TensorLoRARequest``); here vLLM's own loader reads a directory.

The bytes moved are the adapter file's: at rank 16 on SmolLM2-135M 3.6% of the full sync's (measured by
``tests/rl/test_lora_rl.py``); ``jobs.plan`` states the ratio for a model it plans. An engine started without
LoRA gets the merged weights through the full sync instead (``W + scale * B @ A``: the export merges,
:func:`afm_core.models.hf_weights.export_hf_weights`). :func:`afm_core.rl.weight_sync.sync_weights_async` picks
the path, and its ``WeightSyncStats.path`` says which ran.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

#: ``WeightSyncStats.path`` of each sync: every weight (no adapters), the adapters alone, the merged weights.
PATHS = ("full", "lora_adapter", "merged_full")
_VERSION_PREFIX = "policy-"  # <lora_dir>/policy-<LoRA int id>


class AdapterReceiver(Protocol):
    """An engine that serves the policy's LoRA adapter (:class:`~afm_core.rollout.vllm_inproc.InprocVLLMEngine`,
    :class:`~afm_core.rollout.vllm_engine.VLLMEngine` started with ``max_lora_rank`` > 0)."""

    @property
    def serves_adapters(self) -> bool: ...

    @property
    def adapter_dir(self) -> str | None: ...

    @property
    def next_adapter_id(self) -> int: ...

    @property
    def model_dir(self) -> str: ...

    async def load_adapter(self, path: str) -> int: ...

    async def reset_prefix_cache(self) -> None: ...


def serves_adapters(engine: object) -> bool:
    """Whether ``engine`` takes LoRA adapters (an :class:`AdapterReceiver` started with LoRA)."""
    return bool(getattr(engine, "serves_adapters", False))


async def sync_adapter(engine: AdapterReceiver, model_chunks: Sequence[torch.nn.Module]) -> tuple[float, int]:
    """Send this rank's policy adapters to ``engine`` (the module docstring's three steps).

    Collective over the job's ranks (the gather, rank 0's write, a barrier): every rank calls it at the same
    sync, each with its engine.

    Args:
        engine: this rank's engine, started with LoRA (:func:`serves_adapters`) and a ``lora_dir``; its
            ``model_dir`` (the HF base it serves) is the adapter's ``base_model_name_or_path``.
        model_chunks: this rank's policy chunks with LoRA adapters (wrapped or not).
    Returns:
        ``(gather_s, bytes)``: seconds of the gather and write (with the barrier), the adapter file's size.
    Raises:
        RuntimeError: the engine has no ``lora_dir``, or vLLM refused the adapter (e.g. a rank above the engine's
            ``max_lora_rank``).
    """
    from afm_core.models.lora_hf import ADAPTER_WEIGHTS, save_peft_adapter  # megatron, peft: trainer side only

    start = time.perf_counter()
    if not engine.adapter_dir:
        raise RuntimeError("sync_adapter: the engine has no lora_dir (VLLMConfig.lora_dir) to read adapters from")
    root = Path(engine.adapter_dir)
    out = root / f"{_VERSION_PREFIX}{engine.next_adapter_id}"  # the same name on every rank (ids count alike)
    save_peft_adapter(model_chunks, engine.model_dir, out)  # collective; rank 0 writes; all return once it is complete
    gather_s = time.perf_counter() - start
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        for old in root.glob(f"{_VERSION_PREFIX}*"):  # every rank loaded those before this sync's barrier
            if old != out:
                shutil.rmtree(old, ignore_errors=True)
    await engine.load_adapter(str(out))
    await engine.reset_prefix_cache()
    return gather_s, (out / ADAPTER_WEIGHTS).stat().st_size
