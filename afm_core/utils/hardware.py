"""What the machine computes fast: the one rule the trainer, the rollout engine and ``jobs.plan`` share for bf16.

On a CPU, bf16 pays only where the cores multiply it natively (AVX512-BF16 or AMX tiles). Elsewhere (e.g. an
AVX2-only x86 CPU) torch and oneDNN convert bf16 operands in software: a ``[4096, 576] x [576, 1536]`` matmul at 2
threads runs at ~1 GFLOP/s in bf16 against ~135 in fp32 on a 2-core AVX2 EPYC, so a bf16 SFT step takes minutes
where fp32 takes seconds. ``python -m benchmarks.roofline`` measures both dtypes at a model's layer shapes.

The CPU decision can be forced either way with the environment variable ``AFM_CPU_BF16`` (:data:`CPU_BF16_ENV`):
``1`` treats this CPU as bf16-fast (``trainer.precision=auto`` and the engine's ``dtype: auto`` pick bf16), ``0``
as not (they pick fp32); unset or empty, the CPU flags decide. It is read at each call, so it reaches every rank
and every job a submission starts (local and Slurm jobs inherit the submitter's environment).
"""

from __future__ import annotations

import itertools
import os
import platform
import socket

#: The environment variable that overrides the CPU's bf16 decision: ``1`` (bf16), ``0`` (fp32), unset (detect).
CPU_BF16_ENV = "AFM_CPU_BF16"


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (imports torch on first use, not at module import)."""
    import torch  # utils loads no heavy package at import: the job layer uses this module without torch

    return torch.cuda.is_available()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively: AVX512-BF16 or AMX tiles (``torch.cpu`` capability checks,
    torch ``torch/cpu/__init__.py``)."""
    import torch  # as in cuda_available

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def cpu_bf16_forced() -> bool | None:
    """``AFM_CPU_BF16`` as a decision: True (``1``), False (``0``), None (unset or empty: detect).

    Raises:
        ValueError: any other value; the message names the variable and the accepted values.
    """
    value = os.environ.get(CPU_BF16_ENV, "").strip()
    if value == "":
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{CPU_BF16_ENV}={value!r}: expected 1 (bf16 on this CPU), 0 (fp32) or unset (detect)")
    return value == "1"


def bf16_is_fast(on_gpu: bool | None = None) -> bool:
    """Whether ``auto`` precision means bf16: on a GPU; on a CPU, as ``AFM_CPU_BF16`` forces it
    (:func:`cpu_bf16_forced`), else where the CPU has native bf16 (:func:`cpu_has_native_bf16`).

    Args:
        on_gpu: the device the work runs on; default this process's (:func:`cuda_available`).
    Raises:
        ValueError: ``AFM_CPU_BF16`` is set to something other than 0 or 1.
    """
    if cuda_available() if on_gpu is None else on_gpu:
        return True
    forced = cpu_bf16_forced()
    return cpu_has_native_bf16() if forced is None else forced


#: The CPU flags that decide the speed of our CPU paths (fp32 SIMD width, native bf16), as ``/proc/cpuinfo`` spells them.
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def machine_summary() -> dict[str, object]:
    """What ran a measurement, for reports: ``cpu`` (the model name in ``/proc/cpuinfo``, or ``platform.processor()``
    elsewhere), ``flags`` (those of :data:`SPEED_FLAGS` it has), ``threads`` (the CPUs this process may run on),
    ``cpu_precision`` (what ``trainer.precision=auto`` picks on this CPU: ``bf16`` or ``fp32``, after
    ``AFM_CPU_BF16``), ``gpu`` (the CUDA device name, or None).

    Raises:
        ValueError: ``AFM_CPU_BF16`` is set to something other than 0 or 1.
    """
    import torch  # as in cuda_available

    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:  # Linux: the first CPU's lines
            for line in itertools.takewhile(str.strip, f):
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    cpu = info.get("model name") or platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    return {
        "cpu": cpu,
        "flags": [f for f in SPEED_FLAGS if f in flags],
        "threads": len(os.sched_getaffinity(0)),
        "cpu_precision": "bf16" if bf16_is_fast(on_gpu=False) else "fp32",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def this_node() -> str:
    """The node this process runs on: Slurm's name for it (``SLURMD_NODENAME``), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()
