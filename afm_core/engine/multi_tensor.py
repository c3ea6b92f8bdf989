"""torch's foreach kernels in place of megatron-core's local multi-tensor fallbacks (no apex, no transformer-engine).

Without apex or transformer-engine, megatron-core 0.16.1 (``megatron/core/optimizer/clip_grads.py``) falls back to
``megatron/core/utils.py``'s ``local_multi_tensor_l2_norm`` and ``local_multi_tensor_scale`` for gradient
clipping, on CPU and GPU alike:

* ``local_multi_tensor_l2_norm`` builds ``torch.tensor([torch.norm(g) for g in grads])``: one device-to-host copy,
  a host sync on CUDA, per gradient tensor (198 per step at Qwen2.5-1.5B, measured with
  ``torch.cuda.set_sync_debug_mode("warn")``), each stalling the GPU until the CPU launches the next kernel.
  :func:`multi_tensor_l2_norm` computes the same norm with ``torch._foreach_norm`` and one ``vector_norm`` of the
  per-tensor norms, on the device (the total norm is read once, by megatron, afterwards).
* ``local_multi_tensor_scale`` computes ``dst.copy_(src * scale)``: a parameter-sized temporary and two more passes
  per gradient, for source = destination. :func:`multi_tensor_scale` multiplies in place there
  (``_foreach_mul_``, the same fp32 products, bitwise), as ``torch.nn.utils.clip_grad_norm_`` does.

:func:`use_foreach_kernels` installs both where megatron fell back to its local implementations.
"""

from __future__ import annotations

from typing import Any

import torch


def multi_tensor_l2_norm(
    chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], per_tensor: bool, *args: Any
) -> tuple[torch.Tensor, None]:
    """megatron's ``local_multi_tensor_l2_norm``: the L2 norm of all tensors of ``tensor_lists[0]`` together, as a
    ``[1]`` fp32 tensor on their device, without reading anything back to the host. ``per_tensor`` norms are not
    returned (megatron's fallback returns none either)."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def multi_tensor_scale(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], scale: float) -> None:
    """megatron's ``local_multi_tensor_scale`` (``dst = src * scale`` per tensor pair), in place when every source
    is its destination."""
    src, dst = tensor_lists
    if len(src) == len(dst) and all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
        return
    for a, b in zip(src, dst):
        b.copy_(a * scale)


def use_foreach_kernels() -> None:
    """Point megatron's gradient clipping at :func:`multi_tensor_l2_norm` and :func:`multi_tensor_scale` where it
    uses its local fallbacks (neither apex nor transformer-engine imports); idempotent. Call before the first
    optimizer step."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = multi_tensor_l2_norm
    if clip_grads.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = multi_tensor_scale
