"""The Megatron policy (or reference) model of an RL run: this rank's GPTModel chunks with the HF weights loaded.

The same build as the SFT engine (``afm_core.train.sft``): ``mcore_config_from_hf`` -> ``build_gpt_model`` per
virtual stage (``afm_core.engine.core.build_model_chunks``) -> ``afm_core.models.hf_weights.load_hf_weights``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

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
