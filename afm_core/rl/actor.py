"""The policy update on Megatron: a ``forward_step_func`` for megatron-core's schedules computing the DAPO loss.

One optimizer step (one mini-batch) of the actor runs ``get_forward_backward_func()(forward_step_func=
policy_forward_step(config, temperature=...), ...)`` over the mini-batch's micro batches, with the model
wrapped by the one trainer core (:class:`afm_core.engine.core.MegatronTrainer`: Megatron DDP with
``TransformerConfig.calculate_per_token_loss=True``; the step is :meth:`~afm_core.engine.core.MegatronTrainer.step`). In that mode megatron sums the micro-batch losses,
all-reduces the returned token counts over data-parallel ranks and divides the gradients by the total
(``megatron/core/distributed/finalize_model_grads.py``), so :func:`megatron_policy_loss` returns the masked
token SUM and the local token count, and the result is DAPO's token-mean over the global mini-batch. The other
``algorithm.loss_agg_mode``s return the count their divisor needs (:func:`megatron_policy_loss`).

A micro batch is :func:`afm_core.rl.batch.rollout_micro_batch`'s dict plus ``old_log_prob`` and
``advantages`` ``[b, s]`` (and ``ref_log_prob`` / ``rollout_log_prob`` when the config uses them), all aligned
with ``labels``. The loss reports come back from the schedule as ``{"policy": stats}`` per micro batch (on the
last pipeline stage only; other stages get none); reduce them with :func:`afm_core.rl.losses.reduce_stats`
over the data-parallel group, on the last stage.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING

import torch

from afm_core.rl.logprobs import response_logprobs
from afm_core.rl.losses import PolicyLossConfig, policy_loss
from afm_core.rl.packed import rollout_forward

if TYPE_CHECKING:
    from afm_core.rl.parts import ForwardStep

STATS_KEY = "policy"


def megatron_policy_loss(
    batch: dict[str, torch.Tensor], config: PolicyLossConfig, temperature: float, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, dict[str, torch.Tensor]]]:
    """Megatron ``loss_func`` (3-tuple, per-token-loss mode) of one micro batch.

    Megatron sums the returned losses over micro batches (and their gradients over DP ranks) and divides the
    gradients by the all-reduced sum of the returned counts, when it is > 0 (``finalize_model_grads.py``). So,
    per ``config.loss_agg_mode`` (:func:`~afm_core.rl.losses.policy_loss`; verl ``core_algos.py::agg_loss``):

    - ``token-mean``: (sum of the token losses, response tokens) -> / the mini-batch's response tokens;
    - ``seq-mean-token-mean`` / ``-token-sum``: (sum over rows of each row's token mean / sum, rows) -> / the
      mini-batch's sequences, verl's ``global_batch_size`` (``ppo_mini_batch_size * rollout.n``);
    - ``seq-mean-token-sum-norm``: (token sum / (loss_scale_factor * DP), 0): no division by megatron, the
      gradient of ``sum / (loss_scale_factor * DP)``, verl's (whose DP reduction averages and whose ``agg_loss``
      does not multiply this mode by ``dp_size``).

    Args:
        batch: the micro batch on the logits' device (see the module docstring).
        config: :class:`~afm_core.rl.losses.PolicyLossConfig`.
        temperature: the rollout's sampling temperature (the logprobs are of ``softmax(logits / T)``).
        logits: from the last pipeline stage: the response rows' ``[1, n, V / tp]`` (the policy computes only
            those, :func:`policy_forward_step`) or the full ``[b, s, V / tp]``.
    Returns:
        ``(aggregated loss, count (int), {"policy": additive stats})``.
    """
    log_prob, entropy = response_logprobs(
        logits,
        batch["labels"],
        batch["response_mask"],
        temperature=temperature,
        with_entropy=True,
        entropy_grad=config.entropy_coeff > 0,
    )
    mode, divisor = config.loss_agg_mode, 1
    if mode == "seq-mean-token-sum-norm":
        from megatron.core import parallel_state as ps  # megatron: loaded only where a model runs

        divisor = ps.get_data_parallel_world_size()
    loss_sum, stats = policy_loss(
        log_prob,
        batch["old_log_prob"],
        batch["advantages"],
        batch["response_mask"],
        global_num_tokens=divisor,
        config=config,
        ref_log_prob=batch.get("ref_log_prob"),
        rollout_log_prob=batch.get("rollout_log_prob"),
        entropy=entropy,
    )
    mask = batch["response_mask"]
    if mode == "token-mean":
        count = mask.to(torch.bool).sum().to(torch.int)
    elif mode == "seq-mean-token-sum-norm":
        count = torch.zeros((), dtype=torch.int, device=mask.device)
    else:  # one per row: a trajectory
        count = torch.tensor(mask.shape[0], dtype=torch.int, device=mask.device)
    return loss_sum, count, {STATS_KEY: stats}


def policy_forward_step(
    config: PolicyLossConfig, *, temperature: float = 1.0, remove_padding: bool = True
) -> ForwardStep:
    """A megatron ``forward_step_func``: next micro batch -> (logits, loss_func) with :func:`megatron_policy_loss`.

    The policy computes the logits of the response rows only (``loss_mask=response_mask``: the output layer and
    the fp32 softmax passes skip the prompt, observation and padding rows, which no loss term reads), over the
    micro batch's trajectories packed without their padding where the model can (``remove_padding``,
    :func:`afm_core.rl.packed.rollout_forward`)."""

    def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
        logits, batch = rollout_forward(
            model, next(data_iterator), rows_key="response_mask", remove_padding=remove_padding
        )
        return logits, partial(megatron_policy_loss, batch, config, temperature)

    return forward_step
