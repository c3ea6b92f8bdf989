"""CPU shims that let megatron-core 0.16.1 train on a CUDA-less torch build (gloo backend).

megatron-core hard-codes CUDA in a handful of places that the CPU path still runs through. Each patch below
lists the verbatim failure it prevents; all were observed with torch 2.13.0+cpu and megatron-core 0.16.1
(NVIDIA/Megatron-LM, ``megatron/core``). They are applied only when CUDA is absent, so the
GPU path runs megatron unmodified. Outside this module only :func:`afm_core.models.local_spec.local_layer_spec`
(megatron's RoPE function, an optimisation of the local spec) patches megatron.

Patches (in the order :func:`apply_cpu_shims` installs them):

1. ``torch.cuda.current_device() -> "cpu"``. Prevents ``AssertionError: Torch not compiled with CUDA enabled``
   at ``rotary_pos_embedding.py`` ``get_emb`` (first forward), ``utils.py`` ``GlobalMemoryBuffer.get_tensor``
   and ``p2p_communication.py`` ``create_tensor_recv_prev`` (pipeline receive buffers), all of which allocate
   on ``device=torch.cuda.current_device()``.
2. ``torch.cuda.synchronize()`` is a no-op. Prevents the same assertion in ``p2p_communication.py``
   ``send_forward`` (pipeline parallel only).
3. ``device="cuda"`` becomes ``"cpu"`` (and ``pin_memory=True`` becomes ``False``) in the torch tensor
   factories, ``Tensor.to``, ``Tensor.cuda`` and ``Module.cuda``. Prevents the assertion in
   ``transformer/utils.py`` ``get_default_causal_mask`` (``torch.ones(sq, sq, device="cuda")``), in the
   schedules (``total_num_tokens = torch.zeros([], device="cuda")``), in the optimizer and ``clip_grads.py``
   (``torch.tensor([...], device="cuda")``), and in ``language_module.py`` (``weight.data.cuda()`` when the
   tied output layer is set up on the last pipeline stage). Plain function wrappers, not a
   ``TorchFunctionMode``: a mode is popped while its handler runs, so activation recomputation inside
   ``backward()`` would escape it. ``torch.utils._device._device_constructors()`` is primed first, because
   that cache identifies constructors by identity and ``with torch.device("meta")`` would otherwise silently
   stop applying to the wrapped ones (observed as non-deterministic HF ``from_pretrained`` logits).
4. The CUDA RNG calls used by megatron's RNG tracker (``torch.cuda.get_rng_state / set_rng_state /
   manual_seed`` and ``tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state``) drive the CPU
   generator. Prevents ``AssertionError: Torch not compiled with CUDA enabled`` in
   ``model_parallel_cuda_manual_seed`` -> ``CudaRNGStatesTracker.add``. Side effect:
   ``model_parallel_cuda_manual_seed(seed)`` re-seeds the CPU generator, and the tracker's states are CPU
   generator states (checkpointed as such by :mod:`afm_core.engine.checkpoint`).
5. ``Tensor.type()`` without arguments reports the ``torch.cuda.*Tensor`` name for CPU float tensors.
   Prevents the bare ``AssertionError`` at ``clip_grads.py`` ``clip_grad_by_total_norm_fp32``
   (``assert param.grad.type() == 'torch.cuda.FloatTensor'``) and ``TypeError: Wrapped parameters must be
   one of torch.cuda.FloatTensor, ...`` when megatron's mixed-precision optimizer wraps bf16 parameters.

Megatron's multi-tensor fallbacks without apex (gradient clipping) are replaced on every device, not here:
:mod:`afm_core.engine.multi_tensor`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._device  # imported by torch._dynamo, which this process may not import: patch 3 uses it

_APPLIED = False

# Torch factories megatron calls with device="cuda" (and a few more that accept a device argument).
_FACTORIES = (
    "empty",
    "empty_like",
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "full",
    "full_like",
    "tensor",
    "as_tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "eye",
    "linspace",
)
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


def _cpu_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    if _is_cuda(kwargs.get("device")):
        kwargs["device"] = "cpu"
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return kwargs


def _wrap_factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        return fn(*args, **_cpu_kwargs(kwargs))

    return factory


def _wrap_tensor_to(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def to(self, *args, **kwargs):
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return fn(self, *args, **_cpu_kwargs(kwargs))

    return to


def _wrap_tensor_type(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def type_(self, *args, **kwargs):
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return fn(self, *args, **kwargs)

    return type_


def _cpu_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def apply_cpu_shims() -> bool:
    """Install the five CPU patches (module docstring) if CUDA is absent; idempotent.

    Call after importing megatron and before building models or optimizers.

    Returns:
        True if the patches are (now) installed, False on a CUDA machine (nothing is patched).
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    from megatron.core.tensor_parallel import random as tp_random

    # 1, 2
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # 3 (prime the device-constructor cache before replacing the constructors)
    torch.utils._device._device_constructors()
    for name in _FACTORIES:
        setattr(torch, name, _wrap_factory(getattr(torch, name)))
    torch.Tensor.to = _wrap_tensor_to(torch.Tensor.to)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    # 4
    torch.cuda.get_rng_state = _cpu_rng_state
    torch.cuda.set_rng_state = _set_cpu_rng_state
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    tp_random._get_cuda_rng_state = _cpu_rng_state
    tp_random._set_cuda_rng_state = _set_cpu_rng_state
    # 5
    torch.Tensor.type = _wrap_tensor_type(torch.Tensor.type)
    _APPLIED = True
    return True
