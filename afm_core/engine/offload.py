"""The trainer's GPU memory handed to the rollout engine while it generates, and taken back before training.

A colocated RL rank holds the trainer's parameters (2 bytes/param in bf16), fp32 gradient buffers (4) and the
optimizer's fp32 master weights and Adam moments (12, sharded over DP by the distributed optimizer) while vLLM
generates; at 32B with TP=8 that is ~30 GB of an 80 GB GPU the engine's KV cache cannot use. As verl does
(``verl/utils/megatron_utils.py`` ``offload_megatron_model_to_cpu`` / ``offload_megatron_optimizer`` and their
``load_*`` twins), :func:`offload_training_state` copies the parameters and optimizer state to host memory and
frees their device storage (``untyped_storage().resize_(0)``: every view into a megatron DDP buffer stays valid),
drops the gradient buffers' contents (they are spent at a step boundary: the next step zeroes them first), and
empties the CUDA caching allocator; :meth:`Offloaded.reload` gives each storage its size back, copies the host
copies in and zeroes the gradient buffers.

The RL step calls it around generation (:class:`afm_core.rl.colocation.Handover`). On CPU there is nothing to
free for another user of the same memory (the engine's KV cache is fixed at start), so the trainer's ranks skip it
unless ``colocation.offload_trainer=true``, which the tests set to run the real path on CPU: there the "host copy"
is a second CPU tensor and the freed storage goes back to the allocator, so memory moves but no device is left.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


def _optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """The optimizer's own tensors: Adam state and fp32 master weights (megatron's mixed-precision optimizers)."""
    for wrapped in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(wrapped, "optimizer", None)
        if inner is not None:
            for state in inner.state.values():
                yield from (t for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        for attr in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups", "shard_fp32_groups"):
            for group in getattr(wrapped, attr, None) or []:
                yield from (p for p in group if isinstance(p, torch.Tensor))


@dataclass
class Offloaded:
    """The trainer state moved to host memory by :func:`offload_training_state`."""

    kept: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (device tensor, host copy)
    dropped: list[torch.Tensor] = field(default_factory=list)  # gradient buffers, zeroed on reload
    bytes: int = 0  # device bytes freed

    def reload(self) -> None:
        """Give every freed storage its size back and fill it: host copies copied in, gradient buffers zeroed."""
        for tensor, host in self.kept:
            tensor.untyped_storage().resize_(host.untyped_storage().nbytes())
            tensor.copy_(host, non_blocking=False)
        for tensor in self.dropped:
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
            tensor.zero_()
        self.kept, self.dropped = [], []


def offload_training_state(trainer: Any, *, enabled: bool) -> Offloaded:
    """Free the device memory of ``trainer``'s (:class:`~afm_core.train.trainer.SFTTrainer`) parameters, gradient
    buffers and optimizer state (module docstring); ``enabled=False`` returns an empty handle (CPU ranks).

    Call at a step boundary only (no pending gradient reduce or parameter gather: see ``SFTTrainer.sync_params``).
    Returns:
        The handle whose :meth:`Offloaded.reload` restores the state before the next training step.
    """
    out = Offloaded()
    if not enabled:
        return out
    seen: set[int] = set()

    def storage_of(tensor: torch.Tensor) -> int:
        return tensor.untyped_storage().data_ptr()

    def keep(tensor: torch.Tensor) -> None:
        base = tensor if tensor._base is None else tensor._base
        if storage_of(base) in seen or base.untyped_storage().nbytes() == 0:
            return
        seen.add(storage_of(base))
        host = base.detach().to("cpu", copy=True)
        if base.is_cuda:
            host = host.pin_memory()
        out.kept.append((base, host))
        out.bytes += base.untyped_storage().nbytes()

    for chunk in trainer.model:
        buffers = list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", []))
        for buffer in buffers:
            if buffer.param_data is not None:  # distributed optimizer: the parameters live in this buffer
                keep(buffer.param_data)
            seen.add(storage_of(buffer.grad_data))
            out.dropped.append(buffer.grad_data)
            out.bytes += buffer.grad_data.untyped_storage().nbytes()
        for param in chunk.parameters():
            keep(param.data)
    for tensor in _optimizer_tensors(trainer.optimizer):
        keep(tensor.data)
    for tensor, _ in out.kept:
        tensor.untyped_storage().resize_(0)
    for tensor in out.dropped:
        tensor.untyped_storage().resize_(0)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out
