"""What the machine computes fast: the one rule the trainer, the rollout engine and ``jobs.plan`` share for bf16.

On a CPU, bf16 pays only where the cores multiply it natively (AVX512-BF16 or AMX tiles). Elsewhere (e.g. an
AVX2-only x86 CPU) torch and oneDNN convert bf16 operands in software: a ``[4096, 576] x [576, 1536]`` matmul at 2
threads runs at ~1 GFLOP/s in bf16 against ~135 in fp32 on a 2-core AVX2 EPYC, so a bf16 SFT step takes minutes
where fp32 takes seconds. ``python -m benchmarks.roofline`` measures both dtypes at a model's layer shapes.
"""

from __future__ import annotations


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (imports torch on first use, not at module import)."""
    import torch

    return torch.cuda.is_available()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively: AVX512-BF16 or AMX tiles (``torch.cpu`` capability checks,
    torch ``torch/cpu/__init__.py``)."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def bf16_is_fast(on_gpu: bool | None = None) -> bool:
    """Whether ``auto`` precision means bf16: on a GPU, or on a CPU with native bf16 (:func:`cpu_has_native_bf16`).

    Args:
        on_gpu: the device the work runs on; default this process's (:func:`cuda_available`).
    """
    return (cuda_available() if on_gpu is None else on_gpu) or cpu_has_native_bf16()
