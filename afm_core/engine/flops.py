"""Model FLOPs of a training step and model FLOPs utilisation (MFU), as torchtitan and Megatron-LM report them.

A training step over ``T`` token positions of a decoder costs (multiply-add = 2 FLOP, backward = 2x forward):

* ``6 N T`` in the linear layers, ``N`` the parameters multiplied per token (:func:`matmul_params`: the q/k/v, output,
  gate/up and down projections of every layer and the output layer; the embedding lookup, norms and biases are
  not matrix products) (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1);
* ``12 L n_q d P`` in attention, ``P`` the query-key pairs attended per layer and head: ``l (l + 1) / 2`` for a
  causal document of ``l`` tokens (``q k^T`` and ``p v``, 2 x 2 FLOP per pair forward). torchtitan's per-token
  ``12 L n_q d s`` (``torchtitan/models/utils.py`` ``get_dense_model_nparams_and_flops``) is this with every pair
  of an ``s``-token sequence counted; Megatron-LM halves it for causal masks as here
  (``megatron/training/training.py`` ``num_floating_point_operations``).

MFU is the model FLOPs per second of one device over its peak: the datasheet's dense bf16 tensor-core rate
(:func:`datasheet_peak_tflops`, or one given in the config), never a measured one.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from afm_core.models.arch import ModelArch

# Dense (not 2:4 sparse) bf16 tensor-core TFLOP/s per device, NVIDIA's datasheets; the first name contained in the
# CUDA device name wins (the figures of torchtitan's ``torchtitan/tools/utils.py`` ``get_peak_flops``).
DATASHEET_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM
    ("H200", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("B200", 2250.0),
)


def datasheet_peak_tflops(device_name: str) -> float | None:
    """The datasheet dense bf16 peak of a CUDA device (``torch.cuda.get_device_name()``) in TFLOP/s, or None for
    a device not in :data:`DATASHEET_BF16_TFLOPS`."""
    return next((peak for name, peak in DATASHEET_BF16_TFLOPS if name in device_name), None)


def matmul_params(arch: ModelArch) -> int:
    """Parameters multiplied per token: every layer's q/k/v (``h (n_q + 2 n_kv) d``), output (``n_q d h``) and
    SwiGLU (``3 h f``) projections, and the output layer (``h V``, tied or not)."""
    h, d = arch.hidden_size, arch.head_dim
    layer = h * (arch.num_attention_heads + 2 * arch.num_query_groups) * d
    layer += arch.num_attention_heads * d * h + 3 * h * arch.ffn_hidden_size
    return arch.num_layers * layer + h * arch.vocab_size


def causal_pairs(lengths: Sequence[int] | np.ndarray) -> int:
    """Query-key pairs of causal attention over documents of ``lengths`` tokens: ``sum l (l + 1) / 2``."""
    values = np.asarray(lengths, dtype=np.int64)
    return int((values * (values + 1) // 2).sum())


def batch_attention_pairs(batch: Mapping[str, Any], seq_length: int) -> int:
    """:func:`causal_pairs` of a data-loader micro batch: its documents (``cu_seqlens``) and each row's trailing
    padding as one more (what the ``thd`` format attends), or whole rows without ``cu_seqlens``."""
    rows = batch["tokens"].shape[0]
    if batch.get("cu_seqlens") is None:
        return rows * causal_pairs([seq_length])
    from afm_core.data.packing import thd_offsets

    offsets = thd_offsets(batch["cu_seqlens"], seq_length)
    return causal_pairs([e - a for a, e in itertools.pairwise(offsets)])


def training_flops(arch: ModelArch, tokens: int, attention_pairs: int) -> dict[str, float]:
    """Model FLOPs of forward + backward over ``tokens`` positions whose attention covers ``attention_pairs``
    query-key pairs per layer and head (module docstring): ``{"linear": 6 N T, "attention": 12 L n_q d P}``."""
    attention = 12.0 * arch.num_layers * arch.num_attention_heads * arch.head_dim * attention_pairs
    return {"linear": 6.0 * matmul_params(arch) * tokens, "attention": attention}


def mfu(flops_per_device: float, seconds: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1]: ``flops_per_device / seconds`` over ``peak_tflops`` (TFLOP/s), or None
    without a peak (a CPU, an unknown device)."""
    if not peak_tflops or seconds <= 0:
        return None
    return flops_per_device / seconds / (peak_tflops * 1e12)
