"""Any complete training checkpoint (SFT or RL, any step) as an HF checkpoint: ``python -m jobs.export``.

Like verl's ``model_merger`` and slime's ``convert_torch_dist_to_hf``: the ``torch_dist`` checkpoint
(:mod:`afm_core.engine.checkpoint`, written at any TP/PP layout) is loaded by ``dist_checkpointing`` into one
process's TP=1, PP=1 model (the shards are merged by the load: dist_checkpointing reshards), then written by the
trainers' own HF writer (:func:`afm_core.models.hf_weights.save_hf_checkpoint`: safetensors, config, tokenizer). The
export is loaded back with ``transformers`` and its logits on a fixed prompt are compared with the Megatron
model's (the parity check); an export that fails it is removed.

A LoRA run's checkpoint holds the adapters only (:mod:`afm_core.engine.checkpoint`, ``lora.json``): its base
model (checked against the identity the checkpoint records) is loaded, the adapters applied and loaded, and two
exports are written: the merged HF checkpoint (``W + scale * B @ A``, :func:`~afm_core.models.hf_weights.
adapters_merged`) and a PEFT adapter directory for the base (:func:`afm_core.models.lora_hf.save_peft_adapter`);
both are checked against the adapted Megatron model's logits, the adapter loaded by
``peft.PeftModel.from_pretrained`` onto the HF base.

The run's model comes from its recorded config: ``RUN_DIR/tracking.json`` (written at each start), else Hydra's
``RUN_DIR/.hydra/config.yaml``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from afm_core.config.lora import LoRAConfig
from afm_core.engine.checkpoint import load_model_state, model_sharded_state_dict, read_lora_record
from afm_core.engine.checkpoint_dirs import ExportError, find_checkpoint, marker_engine, read_marker
from afm_core.engine.core import build_model
from afm_core.engine.distributed import destroy_distributed, init_distributed
from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
from afm_core.models.hf_weights import base_identity, load_hf_weights, save_hf_checkpoint
from afm_core.models.lora import apply_lora, is_adapter_name
from afm_core.models.lora_hf import save_peft_adapter
from afm_core.utils.ports import free_port

#: Max |logit difference| between the Megatron model and its HF export, by export dtype. fp32: the two
#: implementations differ only in op order; bf16: one bf16 rounding of logits of order 10.
PARITY_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}


def run_config(run_dir: str | Path) -> dict[str, Any]:
    """The recorded config of a run: ``tracking.json``'s resolved ``config``, else ``.hydra/config.yaml``.

    Raises:
        ExportError: neither file exists.
    """
    run_dir = Path(run_dir)
    tracking = run_dir / "tracking.json"
    if tracking.is_file():
        return dict(json.loads(tracking.read_text())["config"])
    hydra = run_dir / ".hydra" / "config.yaml"
    if hydra.is_file():
        return dict(OmegaConf.to_container(OmegaConf.load(hydra), resolve=False))  # type: ignore[arg-type]
    raise ExportError(f"{run_dir}: no tracking.json or .hydra/config.yaml, so the run's model is unknown")


def checkpoint_dtype(path: Path) -> torch.dtype:
    """The dtype the checkpoint's model weights were trained in (its word embedding's; a LoRA checkpoint's
    adapters', which have their base weights' dtype)."""
    metadata = dist_checkpointing.load_tensors_metadata(str(path))
    for key, tensor in metadata.items():
        if key.endswith("embedding.word_embeddings.weight") or (is_adapter_name(key) and "optimizer" not in key):
            return tensor.dtype
    raise ExportError(f"{path}: no embedding.word_embeddings.weight (nor LoRA adapters); not a GPT model checkpoint")


def adapter_dir_for(out: str | Path) -> Path:
    """Where a LoRA export's PEFT adapter goes by default: ``<out>_adapter``, beside the merged export."""
    out = Path(out)
    return out.with_name(f"{out.name}_adapter")


def _check_base(path: Path, record: dict[str, Any], base: Path) -> None:
    """Raise :class:`ExportError` when the run's base model is not the one the adapters of ``path`` were trained
    on (the identity ``lora.json`` records)."""
    ours = base_identity(base)
    for field in ("config_sha256", "weights_sha256"):
        if record["base"][field] != ours[field]:
            raise ExportError(
                f"{path}: its adapters were trained on the base model {record['base']['hf_dir']} ({field} "
                f"{record['base'][field][:16]}), but the run's model resolves to {base} ({field} {ours[field][:16]})"
            )


def _init_single_process() -> Any:
    """A world of one gloo (or NCCL) rank with TP=PP=1 on a fresh 127.0.0.1 port.

    The rendezvous variables are overwritten, not defaulted: a process started by another (a test runner, a
    pipeline stage) must not reuse its parent's ``MASTER_PORT``, which that parent may still be listening on.
    """
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    return init_distributed(OmegaConf.create({"tp": 1, "pp": 1}), seed=0)


def logits_parity(
    chunks: list[torch.nn.Module], hf_out: Path, dtype: torch.dtype, tokens: int = 32, *, adapter: Path | None = None
) -> float:
    """Max |logit difference| between the Megatron model and the HF model loaded from ``hf_out`` (with
    ``adapter``: the PEFT adapter directory loaded onto it by ``peft.PeftModel.from_pretrained``) on the first
    ``tokens`` ids of a fixed prompt (``[1, tokens, vocab]`` logits)."""
    tokenizer = AutoTokenizer.from_pretrained(hf_out)
    text = "Question: what is 17 * 23? <think> 17 * 23 = 391 </think> <answer>391</answer> " * 4
    ids = torch.tensor([tokenizer(text)["input_ids"][:tokens]])
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    model = chunks[0].eval()
    with torch.no_grad():
        megatron = model(ids.to(next(model.parameters()).device), positions.to(ids.device), None).float().cpu()
        hf = AutoModelForCausalLM.from_pretrained(hf_out, dtype=dtype).eval()
        if adapter is not None:
            from peft import PeftModel  # a LoRA export only

            hf = PeftModel.from_pretrained(hf, str(adapter)).eval()
        reference = hf(ids).logits.float()
    return float((megatron - reference).abs().max())


def export_checkpoint(
    run_dir: str | Path, out: str | Path, step: int | None = None, adapter_out: str | Path | None = None
) -> dict[str, Any]:
    """Write checkpoint ``step`` (None: the latest complete one) of ``run_dir`` as an HF checkpoint in ``out``; a
    LoRA checkpoint also as a PEFT adapter directory in ``adapter_out`` (None: :func:`adapter_dir_for`).

    Returns:
        ``{"checkpoint", "step", "out", "dtype", "engine", "max_logit_diff", "lora", "adapter_out",
        "max_logit_diff_adapter"}`` (the last three None without adapters; ``lora``: the adapters' config).
    Raises:
        ExportError: see :func:`find_checkpoint`, :func:`run_config`; a DeepSpeed checkpoint; a LoRA checkpoint
            whose base is not the run's model; an export whose logits differ from the Megatron model's by more
            than :data:`PARITY_TOLERANCE` (then removed, with the adapter export).
    """
    path = find_checkpoint(run_dir, step)
    marker = read_marker(path)
    if marker_engine(marker) != "megatron":
        raise ExportError(f"{path}: a {marker['engine']} checkpoint; export the Megatron engine's checkpoints")
    model_cfg: Mapping[str, Any] = run_config(run_dir)["model"]
    base = ensure_hf_checkpoint(dict(model_cfg))  # architecture, tokenizer and generation config
    record = read_lora_record(path)
    lora = None if record is None else LoRAConfig(**record["lora"])
    if record is not None:
        _check_base(path, record, base)
    adapter = None if lora is None else Path(adapter_out) if adapter_out else adapter_dir_for(out)
    dtype = checkpoint_dtype(path)
    if torch.distributed.is_initialized():
        raise ExportError("export_checkpoint runs in a process of its own (it sets up a TP=PP=1 group)")
    layout = _init_single_process()
    adapter_diff = None
    try:
        hf_config = AutoConfig.from_pretrained(base, local_files_only=True)
        chunks = build_model(hf_config, layout, params_dtype=dtype)  # random init: the checkpoint's weights follow
        if lora is not None:  # the frozen base, then its adapters from the checkpoint
            load_hf_weights(chunks, base)
            apply_lora(chunks, lora)
        state = {"model": model_sharded_state_dict(chunks[0])}
        loaded = dist_checkpointing.load(state, str(path))  # TP/PP shards of any layout merged into TP=PP=1
        load_model_state(chunks[0], loaded["model"])
        out = save_hf_checkpoint(chunks, hf_config, base, out)
        diff = logits_parity(chunks, out, dtype)
        if adapter is not None:
            adapter = save_peft_adapter(chunks, base, adapter)
            adapter_diff = logits_parity(chunks, base, dtype, adapter=adapter)
        if max(diff, adapter_diff or 0.0) > PARITY_TOLERANCE[dtype]:
            for written in (out, adapter):
                if written is not None:
                    shutil.rmtree(written, ignore_errors=True)
            raise ExportError(f"{path}: the HF export's logits differ from the Megatron model's by {diff:.3g} "
                              f"(the PEFT adapter's: {adapter_diff}), over {PARITY_TOLERANCE[dtype]} ({dtype}); "
                              "nothing was kept")  # fmt: skip
    finally:
        destroy_distributed()
    return {"checkpoint": str(path), "step": marker["step"], "out": str(out), "dtype": str(dtype).split(".")[-1],
            "engine": "megatron", "max_logit_diff": diff, "lora": record and record["lora"],
            "adapter_out": adapter and str(adapter), "max_logit_diff_adapter": adapter_diff}  # fmt: skip
