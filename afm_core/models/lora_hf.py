"""LoRA adapters of Megatron model chunks (:mod:`afm_core.models.lora`) as a PEFT adapter directory:
``adapter_config.json`` + ``adapter_model.safetensors`` that ``peft.PeftModel.from_pretrained(hf_base, dir)`` loads
onto the HF base model.

PEFT's names (``peft/utils/save_and_load.py`` ``get_peft_model_state_dict``, adapter name removed):
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
``[out, r]``; PEFT adds ``(lora_alpha / r) * B @ A x`` to each targeted ``nn.Linear``
(``peft/tuners/lora/layer.py`` ``Linear.forward``), the same scale as ours (``model.lora.alpha / rank``).

One fused Megatron linear is several HF modules, each with the same input, so the conversion is exact:

* ``linear_qkv`` -> ``q_proj``, ``k_proj``, ``v_proj``: ``B`` has the fused weight's row layout (per query group g:
  ``[q_g; k_g; v_g]``, TP ranks holding whole groups), so its rows un-fuse as the weight's do (mbridge's
  ``LLMBridge._weight_to_hf_format``, ``mbridge/core/bridge.py``, on a tensor of ``r`` columns); each of the three
  gets a copy of the shared ``A``: PEFT's ``B_q A x`` is the q rows of our ``B A x``.
* ``linear_fc1`` -> ``gate_proj``, ``up_proj``: ``B``'s rows are ``[gate; up]`` per TP rank (gathered as mbridge's
  ``_weight_merge_across_tp`` gathers the weight), then halved; ``A`` copied.
* ``linear_proj`` -> ``o_proj``, ``linear_fc2`` -> ``down_proj``: ``A`` is split over TP by input columns (gathered
  on dim 1, as the weight), ``B`` is whole.

Shapes: ``r`` the rank; ``p`` the TP size.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import unwrap_model
from safetensors.torch import save_file

from afm_core.models.lora import LoRAConfig, lora_config_of
from afm_core.utils.atomic import atomic_dir

#: PEFT's adapter file names (``peft/utils/constants.py``).
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
#: The HF Llama/Qwen modules (under ``model.layers.{i}.``) of each Megatron LoRA target.
HF_MODULES = {
    "linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "linear_proj": ("self_attn.o_proj",),
    "linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "linear_fc2": ("mlp.down_proj",),
}
_PREFIX = "base_model.model.model.layers"


def hf_target_modules(lora: LoRAConfig) -> list[str]:
    """PEFT's ``target_modules`` (HF module names, e.g. ``q_proj``) of ``lora.target_modules`` (Megatron's)."""
    return [hf.rsplit(".", 1)[-1] for name in lora.target_modules for hf in HF_MODULES[name]]


def peft_config(lora: LoRAConfig, base_dir: str | os.PathLike) -> Any:
    """The ``peft.LoraConfig`` of the adapters (``r``, ``lora_alpha``, ``lora_dropout``, HF ``target_modules``,
    no bias, no rsLoRA: scale ``alpha / r``), with ``base_model_name_or_path`` the HF base directory."""
    from peft import LoraConfig  # transformers + peft: only an adapter export needs them

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=hf_target_modules(lora),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(base_dir),
    )


def _tp_gather(tensor: torch.Tensor, dim: int, *, gated: bool = False) -> torch.Tensor:
    """The whole tensor of a TP-split adapter parameter: this rank's shard all-gathered over the TP group and
    concatenated on ``dim``; ``gated``: each shard is ``[gate_p; up_p]`` (fc1's ``B``), the whole is
    ``[gate_0 .. gate_p-1; up_0 .. up_p-1]`` (mbridge's ``_weight_merge_across_tp``)."""
    size = ps.get_tensor_model_parallel_world_size()
    if size == 1:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(shards, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
    if gated:
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=dim)


def _split_qkv_rows(b: torch.Tensor, config: Any) -> list[torch.Tensor]:
    """q, k, v rows of a fused ``linear_qkv`` tensor ``[groups * (q_per_group + 2) * head_dim, c]`` (any ``c``:
    the weight's ``in``, or ``B``'s ``r``), as mbridge's ``_weight_to_hf_format`` splits the weight."""
    groups, head_dim = config.num_query_groups, config.kv_channels
    q_len = head_dim * config.num_attention_heads // groups
    fused = b.reshape(groups, q_len + 2 * head_dim, b.shape[-1])
    return [part.reshape(-1, b.shape[-1]) for part in fused.split([q_len, head_dim, head_dim], dim=1)]


def _layer_tensors(layer: TransformerLayer, lora: LoRAConfig) -> dict[str, torch.Tensor]:
    """PEFT name -> whole CPU tensor of one layer's adapters (collective over TP)."""
    index, out = layer.layer_number - 1, {}
    for name, module in layer.named_modules():
        target = name.rsplit(".", 1)[-1]
        if not hasattr(module, "_afm_lora") or target not in lora.target_modules:
            continue
        a, b = module.lora_A.detach(), module.lora_B.detach()
        if target in ("linear_qkv", "linear_fc1"):  # column-parallel: B split by rows, A whole
            b = _tp_gather(b, 0, gated=target == "linear_fc1" and module.config.gated_linear_unit)
            parts = _split_qkv_rows(b, module.config) if target == "linear_qkv" else list(b.chunk(2))
            pairs = [(a, part) for part in parts]
        else:  # row-parallel: A split by columns, B whole
            pairs = [(_tp_gather(a, 1), b)]
        for hf, (a_hf, b_hf) in zip(HF_MODULES[target], pairs, strict=True):
            out[f"{_PREFIX}.{index}.{hf}.lora_A.weight"] = a_hf.cpu().contiguous().clone()
            out[f"{_PREFIX}.{index}.{hf}.lora_B.weight"] = b_hf.cpu().contiguous().clone()
    return out


def peft_state_dict(models: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The adapters of this rank's model chunks (wrapped or not) as PEFT's state dict: whole CPU tensors in the
    adapters' dtype under PEFT's names (module docstring), the same on every rank.

    Collective: every rank of the model-parallel group calls it (TP all-gathers, then the pipeline stages'
    layers exchanged over the PP group).

    Raises:
        ValueError: the models have no LoRA adapters.
    """
    models = unwrap_model(list(models))
    lora = lora_config_of(models)
    if lora is None:
        raise ValueError("peft_state_dict: the model has no LoRA adapters (model.lora.rank is 0)")
    mine: dict[str, torch.Tensor] = {}
    for model in models:
        for layer in model.modules():
            if isinstance(layer, TransformerLayer):
                mine.update(_layer_tensors(layer, lora))
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return mine
    stages: list[dict[str, torch.Tensor] | None] = [None] * ps.get_pipeline_model_parallel_world_size()
    torch.distributed.all_gather_object(stages, mine, group=ps.get_pipeline_model_parallel_group())
    return {k: v for stage in stages for k, v in (stage or {}).items()}


def save_peft_adapter(
    models: Sequence[torch.nn.Module], base_dir: str | os.PathLike, out_dir: str | os.PathLike
) -> Path:
    """Write the models' LoRA adapters as a PEFT adapter directory ``out_dir`` (``adapter_config.json``:
    :func:`peft_config`; ``adapter_model.safetensors``: :func:`peft_state_dict`) for the HF base ``base_dir``.

    Collective (see :func:`peft_state_dict`); global rank 0 writes, atomically (a temporary sibling renamed onto
    ``out_dir``, replacing an older one), and all ranks return once it is complete.

    Returns:
        ``out_dir`` as a Path.
    Raises:
        ValueError: the models have no LoRA adapters.
    """
    out = Path(out_dir)
    tensors = peft_state_dict(models)
    lora = lora_config_of(unwrap_model(list(models)))
    assert lora is not None  # peft_state_dict raised otherwise
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        with atomic_dir(out) as tmp:
            peft_config(lora, base_dir).save_pretrained(str(tmp))
            save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return out
