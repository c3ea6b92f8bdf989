"""Sizes for CPU kernels whose row count changes every step.

In bf16/fp16 on CPU, torch keeps a kernel per new shape and does not give its memory back: ATen's flash attention
(``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``) runs oneDNN brgemm micro-kernels cached per shape and
thread without bound (``KernelCache`` in ``aten/src/ATen/native/CPUBlas.cpp``), and the bf16 matmuls of the
output layer (oneDNN through ``mkldnn_matmul``) keep per-shape primitives and their buffers. Packed documents of
new lengths, and a new count of labelled rows, every step: measured a few MB per new shape (~1.2 GiB over 300
attention lengths; ~0.8 GiB over 100 output-layer row counts), and the SFT demo growing ~0.04 GiB a step in bf16.
Running those kernels at a few bucketed sizes (:func:`cpu_kernel_length`, zero rows appended, the extra rows'
results dropped) bounds that memory. fp32 takes other kernels (no per-shape cache measured) and runs unpadded.
``python -m benchmarks.cpu_attention_lengths`` measures both ways side by side.
"""

from __future__ import annotations

import torch

#: The dtypes whose CPU kernels are run at bucketed sizes.
BUCKETED_DTYPES = (torch.bfloat16, torch.float16)


def cpu_kernel_length(tokens: int, dtype: torch.dtype) -> int:
    """The size at which a CPU kernel is run on ``tokens`` rows: ``tokens`` itself in fp32; in bf16/fp16 rounded up
    to a multiple of 64 and of 1/16 of the power of two at or above it (64, 128, ..., 1024, 1152, ..., 2048,
    2304, ...): at most 8 sizes per doubling, < 12.5% more rows above 512. Callers append zero rows."""
    if dtype not in BUCKETED_DTYPES:
        return tokens
    step = max(64, 1 << max((tokens - 1).bit_length() - 4, 0))
    return -(-tokens // step) * step


def zero_padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x [d, ...]`` with zero rows appended along dim 0 up to ``rows`` (``x`` itself when ``d == rows``)."""
    if x.shape[0] == rows:
        return x
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out
