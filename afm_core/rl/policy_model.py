"""The Megatron policy (or reference) model of an RL run: this rank's GPTModel chunks with the HF weights loaded.

The same build as the SFT engine (``afm_core.train.sft``): ``mcore_config_from_hf`` -> ``build_gpt_model`` per
virtual stage (``afm_core.engine.core.build_model_chunks``) -> ``afm_core.models.hf_weights.load_hf_weights``,
then, with ``model.lora``, the adapters (:func:`build_lora_policy_model`: the base frozen).

The KL reference policy is the initial model: with LoRA it is the policy's own chunks with the adapters
disabled (:func:`reference_chunks`, :func:`reference_logprobs`; no second copy of the weights: verl's
``ref_in_actor`` in ``verl/trainer/ppo/ray_trainer.py``, "the reference policy will be actor without lora applied",
and its ``docs/advance/ppo_lora.rst``), else a frozen copy (:func:`build_reference_model`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from transformers import PretrainedConfig

    from afm_core.config.lora import LoRAConfig
    from afm_core.engine.distributed import ParallelLayout


def build_policy_model(
    hf_dir: str | os.PathLike,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    load_weights: bool = True,
    **config_overrides: object,
) -> tuple[list[torch.nn.Module], PretrainedConfig]:
    """This rank's model chunks of the HF checkpoint ``hf_dir``, on ``layout.device``.

    ``torch.distributed`` and megatron's parallel state must be initialised
    (:func:`afm_core.engine.distributed.init_distributed`). Collective when ``load_weights`` (TP rank 0 reads
    and scatters).

    Args:
        hf_dir: an HF checkpoint directory (``afm_core.models.hf_checkpoint.ensure_hf_checkpoint``).
        layout: :class:`afm_core.engine.distributed.ParallelLayout` of this rank.
        params_dtype: parameter dtype (fp32 for logprob checks on CPU, bf16 on GPU).
        load_weights: load the HF weights (False: random init, e.g. before a checkpoint load).
        config_overrides: extra ``TransformerConfig`` fields (recompute, sequence parallel...).
    Returns:
        ``(chunks, hf_config)``: unwrapped ``GPTModel`` chunks (one per virtual stage) and the HF config.
    """
    # transformers, megatron, mbridge: not loaded where the RL modules are imported without a model being built
    from transformers import AutoConfig

    from afm_core.engine.core import build_model
    from afm_core.models.hf_weights import load_hf_weights

    hf_config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    chunks = build_model(hf_config, layout, params_dtype=params_dtype, **config_overrides)
    if load_weights:
        load_hf_weights(chunks, hf_dir)
    return chunks, hf_config


def build_lora_policy_model(
    hf_dir: str | os.PathLike,
    layout: ParallelLayout,
    lora: LoRAConfig,
    *,
    params_dtype: torch.dtype = torch.float32,
    load_weights: bool = True,
    **config_overrides: object,
) -> tuple[list[torch.nn.Module], PretrainedConfig]:
    """:func:`build_policy_model`, then with ``lora`` enabled (``model.lora.rank`` > 0) the adapters on every
    targeted linear and every base parameter frozen (:func:`afm_core.models.lora.apply_lora`, after the base
    weights are loaded and before the trainer core wraps the chunks, so that its optimizer holds the adapters
    only). With LoRA the HF base weights are loaded even when ``load_weights`` is False: a LoRA checkpoint holds
    the adapters only (:mod:`afm_core.engine.checkpoint`), so a resume needs the base beneath them, as SFT's
    (``afm_core.train.sft``). Same arguments and returns."""
    chunks, hf_config = build_policy_model(
        hf_dir, layout, params_dtype=params_dtype, load_weights=load_weights or lora.enabled, **config_overrides
    )
    if lora.enabled:
        from afm_core.models.lora import apply_lora  # megatron: only a LoRA run loads it

        apply_lora(chunks, lora)
    return chunks, hf_config


def build_reference_model(
    hf_dir: str | os.PathLike, layout: ParallelLayout, *, params_dtype: torch.dtype, **config_overrides: object
) -> list[torch.nn.Module]:
    """The frozen reference policy for the KL loss: the policy build (``config_overrides`` as the policy's) on the
    HF weights, in eval mode, no grads."""
    chunks, _ = build_policy_model(hf_dir, layout, params_dtype=params_dtype, load_weights=True, **config_overrides)
    for chunk in chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    return chunks


def reference_chunks(
    policy: Sequence[torch.nn.Module],
    hf_dir: str | os.PathLike,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype,
    **config_overrides: object,
) -> list[torch.nn.Module]:
    """The chunks the KL reference policy runs on: ``policy`` itself when it carries LoRA adapters (the base model
    is the initial policy; :func:`reference_logprobs` disables the adapters around the forward, as verl's actor
    computes ``ref_log_prob`` under PEFT's ``disable_adapter()``), else a frozen copy (:func:`build_reference_model`)."""
    from afm_core.models.lora import lora_config_of  # megatron: only a KL run loads it

    if lora_config_of(policy) is not None:
        return list(policy)
    return build_reference_model(hf_dir, layout, params_dtype=params_dtype, **config_overrides)


def reference_logprobs(
    reference: Sequence[torch.nn.Module],
    batches: Sequence[dict[str, torch.Tensor]],
    *,
    temperature: float,
    remove_padding: bool = True,
) -> list[dict[str, torch.Tensor]]:
    """The reference policy's logprobs of ``batches`` (:func:`afm_core.rl.logprobs.compute_logprobs`):
    ``reference`` run with its LoRA adapters disabled (the policy's own chunks, :func:`reference_chunks`; a frozen
    copy has none, and runs as is).

    Returns:
        one ``{"logprobs": [b, s] fp32}`` per micro batch, as ``compute_logprobs``.
    """
    from afm_core.models.lora import adapters_disabled  # megatron: only a KL run loads it
    from afm_core.rl.logprobs import compute_logprobs

    with adapters_disabled(reference):
        return compute_logprobs(reference, batches, temperature=temperature, remove_padding=remove_padding)
