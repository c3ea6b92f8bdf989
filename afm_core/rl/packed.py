"""A padded rollout micro batch through the model without its padding: the trajectories laid end to end (``thd``).

:func:`afm_core.rl.batch.rollout_micro_batch` right-pads ``b`` trajectories to ``S`` tokens, and every per-token
tensor the losses read stays in that ``[b, S]`` layout. The model need not see the padding: here the real tokens
of each row (``prompt + response``, ``L_i`` of them) are packed into one ``[1, T]`` row (``T = sum L_i``) with
megatron's ``thd`` ``PackedSeqParams`` (one causal document per trajectory, RoPE restarting at each, as
:class:`~afm_core.models.attention.PackedDocuments` carries them), so the transformer computes ``T`` tokens
instead of ``b * S`` (verl's ``use_remove_padding``, which packs with flash-attention's ``unpad_input``). Each row's
causal attention over its own tokens is what it was padded, so the outputs equal the padded path's.

What comes back is in the padded layout again: the full outputs (the critic's values ``[b, S, 1]``) are scattered
back, zeros on the padding; the selected rows' logits (``loss_mask``: the policy's response rows) come out in the
same order as the padded batch's selection (row by row, position by position), which is the order
:func:`afm_core.rl.logprobs.response_logprobs` reads them in.

Packing needs an attention that reads ``thd`` params (:func:`afm_core.engine.core.reads_packed_seq_params`), no
pipeline stages (their activations are sent with one fixed ``[S, b]`` shape) and no sequence parallelism; elsewhere
the padded batch runs (:func:`packs`).
"""

from __future__ import annotations

import itertools

import torch


def batch_to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``batch`` with every tensor moved to ``device`` (non-blocking); other values as they are."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def packs(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a chunk, wrapped or not) can take packed micro batches: every attention reads ``thd``
    params, there is one pipeline stage and no sequence parallelism (which splits the tokens over TP ranks).
    Read once per model object."""
    known = getattr(model, "_afm_packs", None)
    if known is None:  # megatron: not loaded where the RL modules are imported without a model
        from megatron.core import parallel_state as ps
        from megatron.core.utils import get_model_config

        from afm_core.engine.core import reads_packed_seq_params

        known = (
            reads_packed_seq_params([model])
            and ps.get_pipeline_model_parallel_world_size() == 1
            and not get_model_config(model).sequence_parallel
        )
        model._afm_packs = known
    return known


def rollout_forward(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    rows_key: str | None = None,
    remove_padding: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's output for a padded rollout micro batch, and the batch on the model's device.

    Args:
        model: a policy / reference / value chunk (wrapped or not).
        batch: :func:`~afm_core.rl.batch.rollout_micro_batch`'s dict on the host: ``tokens``, ``position_ids``
            ``[b, S]``, ``prompt_lengths`` and ``response_lengths`` ``[b]`` (the real tokens of each row), and
            ``rows_key``'s ``[b, S]`` mask when given.
        rows_key: compute the output of the rows where this mask is nonzero only (``loss_mask``).
        remove_padding: pack the rows (module docstring) where :func:`packs`; False: the padded ``[b, S]`` batch.
    Returns:
        ``(output, batch on the device)``: with ``rows_key``, the selected rows' output ``[1, n, ...]`` in the
        padded batch's row-major order (or the full ``[b, S, ...]`` where the model computes every row); without,
        ``[b, S, ...]`` (zeros on the padding when packed).
    """
    device = next(model.parameters()).device
    on_device = batch_to_device(batch, device)
    rows = on_device.get(rows_key) if rows_key else None
    kwargs: dict[str, object] = {} if rows is None else {"loss_mask": rows}
    if not (remove_padding and packs(model)):
        return model(on_device["tokens"], on_device["position_ids"], None, **kwargs), on_device

    from afm_core.models.attention import PackedDocuments  # megatron: as in packs()

    b, s = batch["tokens"].shape
    lengths = (batch["prompt_lengths"] + batch["response_lengths"]).clamp(max=s).tolist()  # host values
    index = torch.cat([torch.arange(i * s, i * s + n) for i, n in enumerate(lengths)]).to(device, non_blocking=True)

    def pack(x: torch.Tensor) -> torch.Tensor:  # [b, S, ...] -> [1, T, ...]
        return x.reshape(b * s, *x.shape[2:]).index_select(0, index).unsqueeze(0)

    kwargs["packed_seq_params"] = PackedDocuments.from_offsets([0, *itertools.accumulate(lengths)], device)
    if rows is not None:
        kwargs["loss_mask"] = pack(rows)
    output = model(pack(on_device["tokens"]), pack(on_device["position_ids"]), None, **kwargs)
    if rows is not None and output.shape[1] != len(index):  # the selected rows: already in the padded order
        return output, on_device
    full = output.new_zeros(b * s, *output.shape[2:])
    return full.index_copy_(0, index, output[0]).view(b, s, *output.shape[2:]), on_device
