"""Run an AVX-512 machine on its AVX2 code paths, to estimate what a job costs on an AVX2-only CPU (measurement aid).

Put this folder first on ``PYTHONPATH`` with ``AFM_EMULATE_AVX2=1``; every Python process of the job (submitit's,
the vLLM engine's) then sees torch report no AVX-512/AMX, so vLLM loads its ``_C_AVX2`` kernels
(``vllm/platforms/cpu.py``, ``import_kernels``). The other libraries take environment variables of their own::

    PYTHONPATH=benchmarks/avx2_paths AFM_EMULATE_AVX2=1 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        ONEDNN_MAX_CPU_ISA=AVX2 AFM_CPU_BF16=0 .venv/bin/python -m jobs.filter_rl ...

(ATen's kernel dispatch, oneMKL, oneDNN; ``AFM_CPU_BF16=0``: fp32, as ``trainer.precision=auto`` picks on AVX2.)
The clock and the cores stay this machine's: a real AVX2 CPU may be slower still (docs/rl.md compares both).
"""

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

_REPORTED_FALSE = (
    "_is_avx512_supported",
    "_is_avx512_bf16_supported",
    "_is_avx512_vnni_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
)


class _TorchCpuPatcher(importlib.abc.MetaPathFinder):
    """Finds ``torch.cpu`` as usual and, once it has run, makes its ISA queries answer False."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            for name in _REPORTED_FALSE:
                if hasattr(module, name):
                    setattr(module, name, lambda: False)

        loader.exec_module = exec_and_patch
        return spec


if os.environ.get("AFM_EMULATE_AVX2") == "1":
    sys.meta_path.insert(0, _TorchCpuPatcher())
