"""DAPO's token-mean as production computes it: the trainer core's ``step`` with
:func:`afm_core.rl.actor.policy_forward_step` (what :mod:`afm_core.rl.policy_trainer` runs) on Megatron DDP (per-token-loss mode) over two data-parallel ranks
and two micro batches each, with different numbers of response tokens everywhere, against a reference computed by
hand: the gradient of (sum of the per-token losses of the whole mini-batch) / (its response tokens)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks
from tests.test_train_engine import SEQ, VOCAB, make_cfg, tiny_provider


def _micro_batches(dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """Two micro batches of two trajectories; response lengths differ per row, micro batch and rank, and each row
    masks one observation token."""
    from afm_core.rl.batch import rollout_micro_batch

    g = torch.Generator().manual_seed(100 + dp_rank)
    batches = []
    for micro in range(2):
        prompts, responses, masks = [], [], []
        for row in range(2):
            n = 3 + 5 * row + 4 * micro + 7 * dp_rank  # 3 .. 23 response tokens
            prompts.append(torch.randint(0, VOCAB, (4,), generator=g).tolist())
            responses.append(torch.randint(0, VOCAB, (n,), generator=g).tolist())
            masks.append([1] * n)
            masks[-1][n // 2] = 0  # an observation token: no loss
        batch = rollout_micro_batch(prompts, responses, masks, seq_length=SEQ)
        shape = batch["response_mask"].shape
        batch["old_log_prob"] = -5.0 - torch.rand(shape, generator=g)  # ratios around e^1: some clip, some not
        batch["advantages"] = torch.randn(shape, generator=g)
        batches.append(batch)
    return batches


def _worker(rank: int, world: int, port: int, spec: dict) -> None:
    set_rank_env(rank, world, port)
    from megatron.core import parallel_state as ps

    from afm_core.rl.actor import policy_forward_step
    from afm_core.rl.logprobs import response_logprobs
    from afm_core.rl.losses import PolicyLossConfig, policy_loss, reduce_stats
    from afm_core.train.core import build_model_chunks
    from afm_core.train.distributed import destroy_distributed, init_distributed
    from afm_core.train.trainer import SFTTrainer

    cfg = OmegaConf.create(spec["cfg"])
    layout = init_distributed(cfg.parallel, seed=cfg.trainer.seed, num_threads=1)
    try:
        chunks = build_model_chunks(tiny_provider(layout), layout)
        trainer = SFTTrainer(cfg, layout, chunks, None, [], spec["run_dir"], max_steps=5)  # type: ignore[arg-type]
        config = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
        batches = _micro_batches(layout.dp_rank)
        model, params = chunks[0], list(chunks[0].parameters())

        # the reference: autograd of the global token mean (the fused layers' main_grad shortcut off meanwhile)
        fused = [m for m in model.modules() if getattr(m, "grad_into_main_grad", False)]
        for module in fused:
            module.grad_into_main_grad = False
        total, tokens = torch.zeros(()), torch.zeros(())
        for batch in batches:
            logits = model(batch["tokens"], batch["position_ids"], None)  # [b, s, V], every row
            log_prob, _ = response_logprobs(logits, batch["labels"], batch["response_mask"], temperature=1.0)
            loss_sum, _ = policy_loss(
                log_prob, batch["old_log_prob"], batch["advantages"], batch["response_mask"], global_num_tokens=1,
                config=config,
            )  # fmt: skip
            total, tokens = total + loss_sum, tokens + batch["response_mask"].sum()
        torch.distributed.all_reduce(tokens)
        hand = torch.autograd.grad(total / tokens, params)
        for grad in hand:
            torch.distributed.all_reduce(grad)
        hand_loss = total.detach().clone()
        torch.distributed.all_reduce(hand_loss)
        for module in fused:
            module.grad_into_main_grad = True

        # production: one optimizer step (no clipping: main_grad keeps the reduced, normalised gradient)
        reports, _, _ = trainer.core.step(
            batches, policy_forward_step(config), seq_length=SEQ, micro_batch_size=2, what="policy update"
        )
        stats = reduce_stats([r["policy"] for r in reports], ps.get_data_parallel_group())
        assert stats["tokens"] == int(tokens), (stats["tokens"], int(tokens))
        assert abs(stats["pg_loss"] - float(hand_loss / tokens)) < 1e-5, (stats["pg_loss"], float(hand_loss / tokens))
        for param, grad in zip(params, hand):
            torch.testing.assert_close(param.main_grad, grad, rtol=1e-4, atol=1e-7)
    finally:
        destroy_distributed()


@pytest.mark.slow
def test_the_policy_update_divides_by_the_response_tokens_of_all_micro_batches_and_data_parallel_ranks(tmp_path):
    cfg = make_cfg(**{"trainer.grad_clip": 0.0, "trainer.micro_batch_size": 2, "trainer.global_batch_size": 8})
    spec = {"cfg": OmegaConf.to_container(cfg), "run_dir": str(tmp_path / "run")}
    start_ranks(_worker, args=(2, free_port(), spec), nprocs=2)
