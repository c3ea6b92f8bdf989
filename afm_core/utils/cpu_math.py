"""CPU math that gives the same values in every process: oneMKL VML's kernel dispatch resolved before threads race.

On x86 CPU builds, ATen computes contiguous float/double unary ops (``cos``, ``sin``, ``exp``, ``log``, ``sqrt``,
``tanh``, ...) with oneMKL VML (``vms<Op>`` / ``vmd<Op>`` with ``VML_HA``, ``aten/src/ATen/cpu/vml.h``), one call per
intra-op thread on its chunk. oneMKL resolves each VML function's kernel lazily, on its first call; when that first
call runs on several threads at once (a fresh process's first sizable op), one thread can run a low-accuracy
kernel for its whole chunk of that one call (pytorch/pytorch issue 188792, fix proposed in pull request 188791;
oneMKL 2024.2 as bundled in the torch wheels; >= 2025.0 does not show it).

Measured here (torch 2.13.0 CPU wheel, 2 threads, Intel Xeon with AVX512-BF16): ``torch.cos`` of the RoPE angle
table ``[1024, 64]`` as a fresh spawned process's first op went wrong in 10 of 110 processes (0 of 70 after
:func:`warm_vml`): one thread's half of the table off by up to 1.5e-4 (``cos(1.0)`` = 0.5403335 against
0.5403023), the next call right. Our trainer computes its RoPE ``cos``/``sin`` on the first forward of each
process (:func:`afm_core.models.local_spec._cos_sin`), so a fresh or resumed process's first step sometimes
computed other values than the same step elsewhere: the SFT step's first loss moved by 1.6e-4 in 3 of ~20 runs of
``python -m benchmarks.sft_throughput``, past its 1e-4 check against HF.

:func:`warm_vml` calls each such op once on one element, in the calling thread, so every dispatch is resolved before
any concurrent use (what the upstream fix does inside ATen). Every training rank calls it
(:func:`afm_core.engine.distributed.set_num_threads`), and every vLLM process through its general-plugin entry point
(``vllm.general_plugins`` in ``pyproject.toml``), before the engine builds its RoPE cache.
"""

from __future__ import annotations

#: torch unary ops that ATen may route to oneMKL VML on CPU (``IMPLEMENT_VML_MKL`` in ``aten/src/ATen/cpu/vml.h``
#: and the float kernels of ``aten/src/ATen/native/cpu/UnaryOpsKernel.cpp``); warming one that does not is harmless.
VML_OPS = (
    "acos", "asin", "atan", "ceil", "cos", "erf", "erfc", "erfinv", "exp", "expm1", "floor", "lgamma", "log",
    "log10", "log1p", "log2", "round", "rsqrt", "sin", "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip

_WARMED = False


def warm_vml() -> None:
    """Resolve oneMKL VML's dispatch of every op of :data:`VML_OPS` in float32 and float64 (bf16/fp16 ops compute
    through the float32 ones), single-threaded: one one-element call each (~1 ms in all). Idempotent; does nothing
    without torch's MKL (e.g. ARM builds). Call before the process's first multi-threaded unary op."""
    global _WARMED
    if _WARMED:
        return
    import torch  # utils loads no heavy package at import (the job layer imports utils without torch)

    if torch.backends.mkl.is_available():
        for dtype in (torch.float32, torch.float64):
            x = torch.full((1,), 0.5, dtype=dtype)
            for name in VML_OPS:
                getattr(torch, name)(x)
    _WARMED = True
