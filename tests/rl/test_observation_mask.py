"""Observation tokens (response mask 0) never enter the policy loss: through the real Megatron model and
megatron-core's schedule, the gradient does not change when everything at observation positions is replaced
by garbage, and it equals a hand-written loss over the model-generated tokens only (full-vocabulary
log_softmax, gathered over TP at TP=2, so the vocab-parallel logprob path is checked too). The policy's logits
of the response rows only (``loss_mask=response_mask``) are the full logits' rows; empty responses train nothing."""

from __future__ import annotations

import pytest
import torch

from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks

TEMPERATURE = 0.8


def _grads(chunks, batch, config, remove_padding=True):
    """The policy gradient of one micro batch through megatron's schedule (and its loss reports)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from afm_core.rl.actor import policy_forward_step

    for p in chunks[0].parameters():
        p.grad = None
    b, s = batch["tokens"].shape
    reports = get_forward_backward_func()(
        forward_step_func=policy_forward_step(config, temperature=TEMPERATURE, remove_padding=remove_padding),
        data_iterator=iter([batch]),
        model=chunks,
        num_microbatches=1,
        seq_length=s,
        micro_batch_size=b,
        forward_only=False,
    )
    return [p.grad.clone() for p in chunks[0].parameters()], reports


def _worker(rank: int, world: int, port: int) -> None:
    set_rank_env(rank, world, port)
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from omegaconf import OmegaConf

    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rl.advantages import broadcast_to_tokens
    from afm_core.rl.batch import rollout_micro_batch
    from afm_core.rl.logprobs import compute_logprobs
    from afm_core.rl.losses import PolicyLossConfig, reduce_stats
    from afm_core.rl.policy_model import build_policy_model

    layout = init_distributed(OmegaConf.create({"tp": world, "pp": 1}), seed=1, num_threads=1)
    try:
        chunks, _ = build_policy_model(ensure_hf_checkpoint("tiny-llama"), layout)
        chunks[0].config.calculate_per_token_loss = True  # the schedule returns the masked sum (see actor.py)
        # trajectory 0: model tokens, a 3-token tool observation, model tokens; trajectory 1: model tokens only
        batch = rollout_micro_batch(
            [[1, 2, 3], [4, 5]], [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23]], [[1, 1, 0, 0, 0, 1, 1], [1, 1, 1]]
        )
        mask = batch["response_mask"].bool()
        (old,) = compute_logprobs(chunks, [batch], temperature=TEMPERATURE)
        g = torch.Generator().manual_seed(0)
        batch["old_log_prob"] = old["logprobs"] + 0.3 * torch.randn(old["logprobs"].shape, generator=g)  # some clip
        batch["advantages"] = broadcast_to_tokens(torch.tensor([1.0, -1.0]), batch["response_mask"])
        config = PolicyLossConfig(clip_ratio_c=3.0)

        clean = dict(batch)
        observation = (batch["labels"] >= 13) & (batch["labels"] <= 15)
        assert observation.sum() == 3 and not (mask & observation).any()
        garbage = dict(batch)
        garbage["old_log_prob"] = batch["old_log_prob"].masked_fill(~mask, float("nan"))
        garbage["advantages"] = batch["advantages"].masked_fill(~mask, 1e30)
        grads_clean, reports = _grads(chunks, clean, config)
        grads_garbage, _ = _grads(chunks, garbage, config)
        for a, b in zip(grads_clean, grads_garbage):
            assert torch.equal(a, b)
        stats = reduce_stats([r["policy"] for r in reports], group=None if world == 1 else _no_dp())
        assert stats["tokens"] == int(mask.sum()) and 0 < stats["clip_frac"] < 1

        # hand-written: the clipped objective summed over model-generated tokens only, full-vocab log_softmax
        for p in chunks[0].parameters():
            p.grad = None
        logits_local = chunks[0](batch["tokens"], batch["position_ids"], None)  # [b, s, V / tp]: every row
        logits = gather_from_tensor_model_parallel_region(logits_local.contiguous())
        logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
        logp = logp.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)[mask]
        ratio = torch.exp(logp - batch["old_log_prob"][mask])
        adv = batch["advantages"][mask]
        per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * 3.0), per_token)
        per_token.sum().backward()
        # norm-wise: the two paths reduce in different orders (response rows only vs all rows, and a CPU's GEMM
        # blocking: AVX2 and AVX-512 differ), and fp32 error grows with eps x sum|terms|, not with the result: an
        # element that cancels to 0.027 carried 5e-6 on AVX2. A leaked observation token moves the norm by far more.
        for param, mine in zip(chunks[0].parameters(), grads_clean):
            assert (mine - param.grad).norm() <= 1e-5 * param.grad.norm(), (mine - param.grad).abs().max()

        # the old logprobs (output layer on the response rows only) are the full-vocab ones there, 0 elsewhere
        torch.testing.assert_close(old["logprobs"][mask], logp.detach(), rtol=1e-5, atol=1e-5)
        assert not old["logprobs"][~mask].any()
        with torch.no_grad():
            rows = chunks[0](batch["tokens"], batch["position_ids"], None, loss_mask=batch["response_mask"])
        assert tuple(rows.shape[:2]) == (1, int(mask.sum()))
        torch.testing.assert_close(rows[0], logits_local.detach()[mask], rtol=1e-5, atol=1e-5)

        # a rollout that ended before its first token is a prompt-only row; a micro batch of such rows trains nothing
        empty = rollout_micro_batch([[1, 2, 3], [4, 5]], [[11, 12], []], [[1, 1], []])
        (values,) = compute_logprobs(chunks, [empty], temperature=TEMPERATURE)
        assert values["logprobs"][0, 2:4].all() and not values["logprobs"][1].any()
        nothing = rollout_micro_batch([[1, 2, 3]], [[]], [[]])
        nothing["old_log_prob"] = nothing["advantages"] = torch.zeros_like(nothing["response_mask"])
        grads_nothing, _ = _grads(chunks, nothing, config)
        assert not any(g.any() for g in grads_nothing)
    finally:
        destroy_distributed()


def _no_dp():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


def test_observation_tokens_change_nothing_in_the_policy_gradient():
    start_ranks(_worker, args=(1, free_port()), nprocs=1)


@pytest.mark.slow
def test_observation_tokens_change_nothing_in_the_policy_gradient_at_tp2():
    start_ranks(_worker, args=(2, free_port()), nprocs=2)
