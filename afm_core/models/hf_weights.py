"""HF safetensors checkpoints in and out of this rank's Megatron model chunks (:mod:`afm_core.models.gpt`): load,
export as ``(HF name, full tensor)``, and write an HF checkpoint directory.

The weight name mapping, the q/k/v and gate/up (un)fusing and the TP split/merge are mbridge's
(``mbridge.core.LLMBridge``, 0.15.1); this module adds what it lacks for our use:

- the model's own ``TransformerConfig`` (built by :func:`afm_core.models.gpt.mcore_config_from_hf`), not mbridge's;
- tied embeddings for Llama as for Qwen2 (the last pipeline stage's ``output_layer.weight`` is
  ``model.embed_tokens.weight``), without mutating mbridge's class-level mappings;
- QK-norm weights (Qwen3: HF ``self_attn.q_norm`` / ``k_norm`` <-> ``self_attention.q_layernorm`` /
  ``k_layernorm``), kept whole on every TP rank;
- HF checkpoint export that is sharded, atomic and written by rank 0 only;
- the distributed optimizer's deferred parameter gather finished before any read (:func:`finish_param_gather`);
- LoRA adapters (:mod:`afm_core.models.lora`) merged into the exported weights (``W + scale * B @ A``), and the
  identity of the base checkpoint the weights came from (:func:`base_identity`, recorded by
  :func:`load_hf_weights`: a LoRA checkpoint holds the adapters only and names the base they need).

Megatron's fused QKV layout per query group g is ``[q_g (heads/groups * head_dim rows), k_g, v_g]``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from mbridge.core import LLMBridge
from mbridge.core.parallel_states import ParallelStates
from mbridge.core.util import unwrap_model
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import get_model_config
from safetensors.torch import save_file
from transformers import AutoConfig

from afm_core.models.arch import arch_from_hf_config
from afm_core.models.lora import adapted_modules, merged_weight
from afm_core.utils.atomic import atomic_dir

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # bytes per safetensors shard on export
_FINGERPRINT_SAMPLES, _FINGERPRINT_SAMPLE_BYTES = 64, 64 << 10  # per safetensors file: 64 reads of 64 KiB


class _HFBridge(LLMBridge):
    """mbridge's Llama/Qwen2/Qwen3 mapping on a TransformerConfig built by us, for the TE and the local layer spec
    (both name the RMSNorm weights ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``).

    mbridge's LLaMABridge, Qwen2Bridge and Qwen3Bridge (``mbridge/models/qwen3.py``) share the base
    ``LLMBridge`` name mappings (which include ``q_layernorm`` / ``k_layernorm`` <-> ``q_norm`` / ``k_norm``, kept
    whole on every TP rank, and the q/k/v (un)fusing by ``head_dim``); they differ in config building (replaced
    here) and in tied embeddings (handled here for all, on the instance).
    """

    _DIRECT_MAPPING: dict[str, str]  # mbridge's class attribute (typed here: mbridge is not analysed)

    def __init__(self, hf_config: Any, transformer_config: TransformerConfig):
        self._transformer_config = transformer_config
        super().__init__(
            hf_config, dtype=transformer_config.params_dtype, parallel_states=ParallelStates.get_parallel_state()
        )

    def _build_config(self) -> TransformerConfig:
        return self._transformer_config

    def _adjust_mapping_for_shared_weights(self) -> None:
        if getattr(self.hf_config, "tie_word_embeddings", False):
            self._DIRECT_MAPPING = {**self._DIRECT_MAPPING, "output_layer.weight": "model.embed_tokens.weight"}

    def _get_actual_hf_path(self, weight_path: str) -> str:
        return str(weight_path)  # local directories only: never resolve through the hub


def _mcore_as_hf_config(model: GPTModel) -> SimpleNamespace:
    """The HF config fields mbridge's export reads, taken from the Megatron model itself."""
    config = model.config
    return SimpleNamespace(
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups,
        hidden_size=config.hidden_size,
        head_dim=config.kv_channels,
        tie_word_embeddings=model.share_embeddings_and_output_weights,
    )


def load_hf_weights(models: Sequence[torch.nn.Module], hf_dir: str | os.PathLike) -> None:
    """Copy an HF safetensors checkpoint into this rank's model chunks (one per virtual pipeline stage).

    Collective over the tensor parallel group: TP rank 0 reads the tensors of its pipeline stage from disk,
    fuses q/k/v and gate/up, and scatters the TP shards. Weights are cast to the models' ``params_dtype``.
    ``torch.distributed`` and megatron ``parallel_state`` must be initialised (a 1-rank gloo group for TP=1).

    Raises:
        ValueError: a tensor the model needs is missing from the checkpoint.
        NotImplementedError: the HF config describes an unsupported variant.
    """
    hf_config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    arch_from_hf_config(hf_config)  # rejects unsupported variants before touching weights
    models = unwrap_model(list(models))
    _HFBridge(hf_config, models[0].config).load_weights(models, str(hf_dir))
    for model in models:
        model.afm_base_dir = str(hf_dir)  # what base_dir_of reads (a LoRA checkpoint records the base's identity)


def base_dir_of(models: Sequence[torch.nn.Module]) -> Path | None:
    """The HF checkpoint directory :func:`load_hf_weights` last loaded into ``models`` (wrapped or not), or None
    (weights not loaded from an HF checkpoint)."""
    found = getattr(unwrap_model(list(models))[0], "afm_base_dir", None)
    return None if found is None else Path(found)


def base_identity(hf_dir: str | os.PathLike) -> dict[str, str]:
    """What identifies an HF checkpoint's weights, cheaply: ``{"hf_dir", "config_sha256", "weights_sha256"}``.

    ``config_sha256`` hashes ``config.json``'s fields (sorted keys; ``transformers_version`` and ``dtype``
    left out). ``weights_sha256`` hashes, per ``*.safetensors`` file in name order, its name, size, header (tensor
    names, dtypes, shapes, offsets) and 64 evenly spaced 64 KiB reads of its data (all of it below 4 MiB): another
    model or another fine-tune of the same one differs in every read, and 4 MiB are read per file whatever its
    size (a 5 GB shard of a large checkpoint too); an edit confined to bytes between the reads is not seen.
    ``hf_dir`` is informational (a copy elsewhere has the same hashes).

    Raises:
        FileNotFoundError: no ``config.json`` or no ``*.safetensors`` file in ``hf_dir``.
    """
    root = Path(hf_dir)
    config = json.loads((root / "config.json").read_text())
    for volatile in ("transformers_version", "dtype", "torch_dtype"):
        config.pop(volatile, None)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: no *.safetensors files")
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(f.read(header_len))
            start, data = 8 + header_len, size - 8 - header_len
            step = max(data // _FINGERPRINT_SAMPLES, _FINGERPRINT_SAMPLE_BYTES)
            for offset in range(start, size, step):
                f.seek(offset)
                digest.update(f.read(_FINGERPRINT_SAMPLE_BYTES))
    config_sha = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return {"hf_dir": str(root), "config_sha256": config_sha, "weights_sha256": digest.hexdigest()}


def finish_param_gather(models: Sequence[torch.nn.Module]) -> None:
    """Complete the distributed optimizer's deferred parameter all-gather of megatron-DDP-wrapped ``models``
    (``overlap_param_gather``: after ``optimizer.step()`` each rank has updated only its shard; the others arrive
    with the next forward's pre-hooks). Every reader of the weights outside a forward (the weight sync to vLLM,
    a checkpoint, an HF export) must call it first, else it reads ~(DP-1)/DP stale parameters (Megatron-LM's
    ``force_param_sync`` before a save). A no-op for unwrapped models and without ``overlap_param_gather``.
    Collective over the data-parallel group when it gathers."""
    for chunk in models:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def export_hf_weights(models: Sequence[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF tensor name, full tensor)`` for the whole model, on every rank.

    Finishes a pending distributed-optimizer parameter gather first (:func:`finish_param_gather`), gathers TP
    shards (all-gather) and pipeline stages (broadcast over the PP group), then un-fuses q/k/v and gate/up to HF
    layout. Every rank of the model-parallel group must exhaust the iterator (it runs
    collectives). Tied embeddings are yielded once, as ``model.embed_tokens.weight``. The tensors have the
    models' ``params_dtype`` and may be views of the live parameters: copy them to keep them. A model with LoRA
    adapters yields its merged weights (:func:`adapters_merged`; the adapters themselves:
    :func:`afm_core.models.lora_hf.peft_state_dict`).
    """
    finish_param_gather(models)
    models = unwrap_model(list(models))
    bridge = _HFBridge(_mcore_as_hf_config(models[0]), models[0].config)
    seen: set[str] = set()
    with adapters_merged(models):
        for name, tensor in bridge.export_weights(models):
            if name in seen:  # the last stage's tied output layer, already yielded from the embedding
                continue
            seen.add(name)
            yield name, tensor.detach()


@contextlib.contextmanager
def adapters_merged(models: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Inside, every LoRA-adapted linear of ``models`` (:mod:`afm_core.models.lora`) holds its merged weight
    ``W + scale * B @ A`` (this rank's shard, :func:`~afm_core.models.lora.merged_weight`) and its adapter
    parameters are unregistered, so mbridge's name mapping (which knows base weights only) sees a plain model;
    on exit the weight's own storage and the adapters are back. A no-op without adapters. Costs one merged copy of
    every adapted weight while inside; no forward may run inside (the adapters' hooks would read no adapter)."""
    saved = []
    try:
        for _, module in adapted_modules(models):
            merged = merged_weight(module)
            saved.append((module, module.weight.data, {n: module._parameters.pop(n) for n in ("lora_A", "lora_B")}))
            module.weight.data = merged
        yield
    finally:
        for module, weight, adapters in saved:
            module.weight.data = weight
            module._parameters.update(adapters)


def save_hf_checkpoint(
    models: Sequence[torch.nn.Module],
    hf_config: Any,
    tokenizer_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write the models as an HF checkpoint: safetensors (sharded above ``max_shard_bytes`` bytes, with
    ``model.safetensors.index.json``), ``config.json`` (``dtype`` = the params dtype), the tokenizer and
    ``generation_config.json`` copied from ``tokenizer_dir``.

    Collective: every rank calls it (see :func:`export_hf_weights`); global rank 0 writes, atomically
    (a temporary sibling directory renamed onto ``out_dir``, replacing an older export), and all ranks
    return after the directory is complete.

    Returns:
        ``out_dir`` as a Path.
    """
    out = Path(out_dir)
    is_writer = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    tensors = export_hf_weights(models)
    if not is_writer:
        for _ in tensors:
            pass
    else:
        with atomic_dir(out) as tmp:
            _write_safetensors(tensors, tmp, max_shard_bytes)
            _write_config_and_tokenizer(hf_config, get_model_config(models[0]).params_dtype, Path(tokenizer_dir), tmp)
        log.info("saved HF checkpoint to %s", out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return out


def _write_safetensors(tensors: Iterator[tuple[str, torch.Tensor]], out: Path, max_shard_bytes: int) -> None:
    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    total_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        save_file(pending, out / f"shard-{len(shards):05d}.safetensors", metadata={"format": "pt"})
        shards.append(list(pending))
        pending, pending_bytes = {}, 0

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
        pending[name] = tensor.to("cpu").contiguous().clone()
        pending_bytes += size
        total_bytes += size
    flush()
    if len(shards) == 1:
        os.rename(out / "shard-00000.safetensors", out / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.rename(out / f"shard-{i:05d}.safetensors", out / filename)
        weight_map.update(dict.fromkeys(names, filename))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_config_and_tokenizer(hf_config: Any, dtype: torch.dtype, tokenizer_dir: Path, out: Path) -> None:
    config = type(hf_config).from_dict(hf_config.to_dict())
    config.dtype = dtype
    config.save_pretrained(out)
    from transformers import AutoTokenizer, GenerationConfig  # an export only: a rank's start needs neither

    AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True).save_pretrained(out)
    if (tokenizer_dir / "generation_config.json").is_file():
        GenerationConfig.from_pretrained(tokenizer_dir, local_files_only=True).save_pretrained(out)
