"""Trainer-side per-token logprobs and entropy of given tokens from the Megatron policy (vocab-parallel at TP > 1).

The logits of a Megatron ``GPTModel`` are split over the vocabulary at TP > 1 (``[b, s, V / tp]`` per rank).
Nothing here gathers the full vocabulary: the target logprob is megatron-core's
``tensor_parallel.vocab_parallel_cross_entropy`` (max and sum-exp all-reduced over the TP group, fused
backward), and the entropy ``H = log Z - sum_v p_v z_v`` needs two more all-reduced sums
(``reduce_from_tensor_model_parallel_region``: all-reduce forward, identity backward, which is the exact
gradient because every TP rank computes the same loss from the reduced values).

Temperature: logprobs are of ``softmax(logits / temperature)``, the distribution the sampler drew from. vLLM
reports the same quantity with ``logprobs_mode="processed_logprobs"`` (its default ``raw_logprobs`` is before
temperature), which is what the trainer/engine comparison needs (verl ``rollout.yaml`` sets it too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch

from afm_core.rl.packed import rollout_forward


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of ``labels`` and entropy under ``softmax(logits / temperature)``, differentiable.

    Args:
        logits: ``[b, s, V / tp]`` this TP rank's vocabulary slice (any float dtype; computed in fp32; not
            modified).
        labels: ``[b, s]`` int64 target token ids in ``[0, V)`` (any valid id at masked positions).
        temperature: sampling temperature (> 0).
        with_entropy: also return the entropy.
        entropy_grad: keep the entropy's autograd graph (an entropy bonus); False saves its activations.
    Returns:
        ``(logprobs [b, s] fp32, entropy [b, s] fp32 or None)``, identical on every TP rank.
    Raises:
        ValueError: ``temperature <= 0``.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # megatron: loaded only where a model runs

    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    scaled = logits.float() / temperature  # a new tensor: the cross entropy below works on it in place
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            entropy = _vocab_parallel_entropy(scaled)
    logprobs = -vocab_parallel_cross_entropy(scaled, labels)
    return logprobs, entropy


def response_logprobs(
    output: torch.Tensor,
    labels: torch.Tensor,
    rows: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`vocab_parallel_logprobs` on the selected rows only, scattered back to ``[b, s]`` (0 elsewhere).

    Args:
        output: the policy's output for ``model(tokens, position_ids, None, loss_mask=rows)``: the selected rows'
            logits ``[1, n, V / tp]`` (``afm_core.models.gpt._GPTModel``), or the full ``[b, s, V / tp]``
            where the model computed every row (the rows are then selected here).
        labels: ``[b, s]`` int64 target ids.
        rows: ``[b, s]``, nonzero where a value is wanted (the response mask: the model's own tokens).
        temperature, with_entropy, entropy_grad: as for :func:`vocab_parallel_logprobs`.
    Returns:
        ``(logprobs [b, s] fp32, entropy [b, s] fp32 or None)``, 0 outside ``rows``; differentiable.
    """
    selected = rows.to(torch.bool)
    if tuple(output.shape[:-1]) == tuple(selected.shape):  # full logits: select here
        output = output[selected].unsqueeze(0)
    if output.shape[1] == 0:  # no response token in the micro batch: zeros, still attached to the graph
        zeros = torch.zeros(selected.shape, dtype=torch.float32, device=output.device) + output.sum().float()
        return zeros, (zeros.clone() if with_entropy else None)
    logprobs, entropy = vocab_parallel_logprobs(
        output,
        labels[selected].unsqueeze(0),
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )

    def scatter(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(selected.shape, dtype=values.dtype, device=values.device).masked_scatter(selected, values[0])

    return scatter(logprobs), (scatter(entropy) if entropy is not None else None)


def _vocab_parallel_entropy(scaled: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps  # megatron: loaded only where a model runs
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    with torch.no_grad():
        shift = scaled.max(dim=-1, keepdim=True).values
        if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(
                shift, op=torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group()
            )
    z = scaled - shift
    e = torch.exp(z)
    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
        total = reduce_from_tensor_model_parallel_region(e.sum(dim=-1).contiguous())
        weighted = reduce_from_tensor_model_parallel_region((e * z).sum(dim=-1).contiguous())
    else:
        total, weighted = e.sum(dim=-1), (e * z).sum(dim=-1)
    return torch.log(total) - weighted / total


@torch.no_grad()
def compute_logprobs(
    model_chunks: Sequence[torch.nn.Module],
    micro_batches: Sequence[dict[str, torch.Tensor]],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    remove_padding: bool = True,
) -> list[dict[str, torch.Tensor]]:
    """Per-token logprobs (and entropy) of each micro batch's ``labels`` under the current Megatron weights.

    :func:`forward_only` with :func:`vocab_parallel_logprobs`. Used for the old logprobs of a rollout step
    (before its first update) and, with the reference model's chunks, for the reference logprobs. A micro batch
    with a ``response_mask`` gets values on its nonzero positions only (0 elsewhere: prompt, observations,
    padding, none of which a loss reads), and the output layer runs on those rows only
    (:func:`response_logprobs`).

    Args:
        model_chunks: this rank's model chunk(s), one per virtual pipeline stage.
        micro_batches: dicts with ``tokens``, ``labels``, ``position_ids`` ``[b, s]`` and optionally
            ``response_mask`` ``[b, s]`` (CPU or device; see :func:`afm_core.rl.batch.rollout_micro_batch`); of
            one ``[b, s]`` when pipeline-parallel.
        temperature: the rollout's sampling temperature.
        with_entropy: also compute the entropy.
        remove_padding: as for :func:`forward_only`.
    Returns:
        One dict per micro batch, ``{"logprobs": [b, s] fp32, "entropy": [b, s] fp32 (if asked)}`` on CPU, on
        every rank.
    Raises:
        ValueError: micro batches of different shapes with pipeline parallelism.
    """

    def per_token(output: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        labels, rows = batch["labels"], batch.get("response_mask")
        if rows is None:
            logprobs, entropy = vocab_parallel_logprobs(
                output, labels, temperature=temperature, with_entropy=with_entropy
            )
        else:
            logprobs, entropy = response_logprobs(
                output, labels, rows, temperature=temperature, with_entropy=with_entropy
            )
        return {"logprobs": logprobs, **({"entropy": entropy} if entropy is not None else {})}

    keys = ["logprobs"] + (["entropy"] if with_entropy else [])
    return forward_only(
        model_chunks, micro_batches, keys, per_token, rows_key="response_mask", remove_padding=remove_padding
    )


@torch.no_grad()
def forward_only(
    model_chunks: Sequence[torch.nn.Module],
    micro_batches: Sequence[dict[str, torch.Tensor]],
    keys: Sequence[str],
    per_token: Callable[[torch.Tensor, dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    *,
    rows_key: str | None = None,
    remove_padding: bool = True,
) -> list[dict[str, torch.Tensor]]:
    """Per-token values ``per_token(model output, micro batch)`` of each micro batch, without gradients.

    Runs megatron-core's forward-only schedule (``get_forward_backward_func``: no pipelining at PP=1,
    1F1B / interleaved at PP>1) over the micro batches, so it works on any TP/PP/VPP layout and on wrapped
    (DDP, Float16Module) or bare chunks. Collective over the model-parallel group: every TP/PP rank of one
    data-parallel replica calls it with the same micro batches.

    Args:
        model_chunks: this rank's model chunk(s), one per virtual pipeline stage.
        micro_batches: dicts with ``tokens``, ``labels``, ``position_ids`` ``[b, s]``; ``s`` may differ between
            micro batches at PP=1 (each padded to its own longest), not with pipeline stages (fixed p2p shapes).
        keys: the names ``per_token`` returns.
        per_token: ``(output of the last stage, the micro batch on the model's device) -> {key: [b, s] tensor}``.
        rows_key: a ``[b, s]`` entry of the micro batches passed to the model as ``loss_mask``: the output layer
            then computes those rows only (``afm_core.models.gpt._GPTModel``); ``per_token`` must accept that
            output (:func:`response_logprobs`). None: the full output.
        remove_padding: the model sees each micro batch's trajectories packed, without their padding, where it
            can (:func:`afm_core.rl.packed.rollout_forward`); the values come back in the padded layout.
    Returns:
        One dict per micro batch, ``{key: [b, s] fp32}`` on CPU, on every rank (the last pipeline stage
        broadcasts them over the pipeline group).
    Raises:
        ValueError: micro batches of different shapes with pipeline parallelism.
    """
    from megatron.core import parallel_state as ps  # megatron: loaded only where a model runs
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        return []
    pipelined = ps.get_pipeline_model_parallel_world_size() > 1
    shape = tuple(micro_batches[0]["tokens"].shape)
    for batch in micro_batches:
        if pipelined and (tuple(batch["tokens"].shape) != shape or tuple(batch["labels"].shape) != shape):
            raise ValueError(
                f"forward_only: with pipeline parallelism the micro batches must share one [b, s] shape, got "
                f"{tuple(batch['tokens'].shape)} and {shape}"
            )
    device = next(model_chunks[0].parameters()).device
    iterators = [iter(micro_batches) for _ in model_chunks]
    outputs = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, per_token=per_token, rows_key=rows_key, remove_padding=remove_padding),
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=list(model_chunks),
        num_microbatches=len(micro_batches),
        seq_length=max(int(batch["tokens"].shape[1]) for batch in micro_batches),
        micro_batch_size=shape[0],
        forward_only=True,
    )
    if not pipelined:
        return [{key: out[key].float().cpu() for key in keys} for out in outputs]
    b, s = shape
    stacked = torch.zeros(len(keys), len(micro_batches), b, s, dtype=torch.float32, device=device)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        for m, out in enumerate(outputs):
            for k, key in enumerate(keys):
                stacked[k, m] = out[key]
    torch.distributed.broadcast(
        stacked, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
    )
    stacked = stacked.cpu()
    return [{key: stacked[k, m] for k, key in enumerate(keys)} for m in range(len(micro_batches))]


def _forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]],
    model: torch.nn.Module,
    *,
    per_token: Callable,
    rows_key: str | None,
    remove_padding: bool,
):
    output, batch = rollout_forward(model, next(data_iterator), rows_key=rows_key, remove_padding=remove_padding)

    def loss_func(output: torch.Tensor):
        return torch.zeros((), device=output.device), torch.tensor(0, dtype=torch.int), per_token(output, batch)

    return output, loss_func
