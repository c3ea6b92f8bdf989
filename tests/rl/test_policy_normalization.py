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
from tests.test_train_engine import SEQ, VOCAB, loop_config, make_cfg, tiny_provider


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

    from afm_core.engine.core import build_model_chunks
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.rl.actor import policy_forward_step
    from afm_core.rl.logprobs import response_logprobs
    from afm_core.rl.losses import PolicyLossConfig, policy_loss, reduce_stats
    from afm_core.train.trainer import SFTTrainer

    cfg = OmegaConf.create(spec["cfg"])
    layout = init_distributed(cfg.parallel, seed=cfg.trainer.seed, num_threads=1)
    try:
        chunks = build_model_chunks(tiny_provider(layout), layout)
        trainer = SFTTrainer(loop_config(cfg), layout, chunks, None, [], spec["run_dir"], max_steps=5)  # type: ignore[arg-type]
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


#: (loss settings, the hand divisor of the sum of per-row values, per-row value: the token "sum" or "mean")
_MODES = [
    ({"loss_agg_mode": "seq-mean-token-mean"}, "sequences", "mean"),
    ({"loss_agg_mode": "seq-mean-token-sum"}, "sequences", "sum"),
    ({"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 24.0}, "scale x dp", "sum"),
    ({"icepop_low": 0.5, "icepop_high": 5.0, "geo_mask_low": 0.7, "geo_mask_high": 1.4}, "tokens", "sum"),
]


def _modes_worker(rank: int, world: int, port: int, spec: dict) -> None:
    set_rank_env(rank, world, port)
    from megatron.core import parallel_state as ps

    from afm_core.engine.core import build_model_chunks
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.rl.actor import policy_forward_step
    from afm_core.rl.logprobs import response_logprobs
    from afm_core.rl.losses import PolicyLossConfig, policy_loss, reduce_stats
    from afm_core.train.trainer import SFTTrainer

    cfg = OmegaConf.create(spec["cfg"])
    layout = init_distributed(cfg.parallel, seed=cfg.trainer.seed, num_threads=1)
    try:
        chunks = build_model_chunks(tiny_provider(layout), layout)
        trainer = SFTTrainer(loop_config(cfg), layout, chunks, None, [], spec["run_dir"], max_steps=5)  # type: ignore[arg-type]
        batches = _micro_batches(layout.dp_rank)
        g = torch.Generator().manual_seed(200 + layout.dp_rank)
        for batch in batches:  # the engine's logprobs: log k = logp_old - logp_rollout ~ N(0, 0.6^2) per token
            batch["rollout_log_prob"] = batch["old_log_prob"] - 0.6 * torch.randn(
                batch["old_log_prob"].shape, generator=g
            )
        model, params = chunks[0], list(chunks[0].parameters())
        fused = [m for m in model.modules() if getattr(m, "grad_into_main_grad", False)]
        for settings, divisor, per_row in _MODES:
            config = PolicyLossConfig(clip_ratio_c=3.0, **settings)
            row_config = PolicyLossConfig(clip_ratio_c=3.0, **{k: v for k, v in settings.items() if "loss_" not in k})
            # the hand reference: each trajectory's token loss sum on its own (a one-row micro batch at token-mean),
            # its mean when per_row is "mean", summed, divided by the global count by hand
            for module in fused:
                module.grad_into_main_grad = False
            total, tokens, rows = torch.zeros(()), torch.zeros(()), torch.zeros(())
            for batch in batches:
                logits = model(batch["tokens"], batch["position_ids"], None)
                log_prob, _ = response_logprobs(logits, batch["labels"], batch["response_mask"], temperature=1.0)
                for i in range(log_prob.shape[0]):
                    row = {k: v[i : i + 1] for k, v in batch.items() if k != "labels" and v.dim() == 2}
                    row_sum, _ = policy_loss(
                        log_prob[i : i + 1], row["old_log_prob"], row["advantages"], row["response_mask"],
                        global_num_tokens=1, rollout_log_prob=row["rollout_log_prob"],
                        config=row_config,
                    )  # fmt: skip
                    n = row["response_mask"].sum()
                    total = total + (row_sum / n if per_row == "mean" else row_sum)
                    tokens, rows = tokens + n, rows + 1
            torch.distributed.all_reduce(tokens)
            torch.distributed.all_reduce(rows)
            count = {"tokens": tokens, "sequences": rows, "scale x dp": torch.tensor(24.0 * layout.dp)}[divisor]
            hand = torch.autograd.grad(total / count, params)
            for grad in hand:
                torch.distributed.all_reduce(grad)
            for module in fused:
                module.grad_into_main_grad = True

            reports, _, _ = trainer.core.step(
                batches, policy_forward_step(config), seq_length=SEQ, micro_batch_size=2, what="policy update"
            )
            scale = max(float(grad.abs().max()) for grad in hand)  # fp32 sums in other orders: tolerance by size
            for param, grad in zip(params, hand):
                torch.testing.assert_close(
                    param.main_grad, grad, rtol=1e-4, atol=1e-5 * scale, msg=lambda m, s=settings: f"{s}: {m}"
                )
            stats = reduce_stats([r["policy"] for r in reports], ps.get_data_parallel_group())
            assert stats["tokens"] == int(tokens)
            if "icepop_low" in settings:  # the masks' fractions over both micro batches and DP ranks, by hand
                masked, seq_masked, seqs = torch.zeros(3), torch.zeros(()), torch.zeros(())
                for batch in batches:
                    mask = batch["response_mask"].bool()
                    log_k = (batch["old_log_prob"] - batch["rollout_log_prob"]).clamp(-20, 20)
                    k = log_k.exp()
                    masked[0] += ((k < 0.5) | (k > 5.0))[mask].sum()
                    geo = torch.stack([log_k[i][mask[i]].mean().exp() for i in range(mask.shape[0])])
                    out = (geo < 0.7) | (geo > 1.4)
                    seq_masked += out.sum()
                    masked[1] += mask[out].sum()
                    seqs += mask.shape[0]
                for t in (masked, seq_masked, seqs):
                    torch.distributed.all_reduce(t)
                assert 0 < masked[0] < tokens and 0 < seq_masked < seqs, (masked, seq_masked)  # both masks act
                assert stats["seqs"] == int(seqs)
                assert abs(stats["icepop_masked"] - float(masked[0] / tokens)) < 1e-6
                assert abs(stats["geo_masked"] - float(masked[1] / tokens)) < 1e-6
                assert abs(stats["geo_masked_seq"] - float(seq_masked / seqs)) < 1e-6
    finally:
        destroy_distributed()


@pytest.mark.slow
def test_each_loss_agg_mode_and_mask_gives_the_hand_computed_gradient_over_micro_batches_and_dp_ranks(tmp_path):
    """verl's seq-mean modes divide by the mini-batch's sequences (megatron: the all-reduced row counts), -norm by
    loss_scale_factor x DP (megatron: no division); IcePop and the geometric mask at token-mean keep the masked
    tokens in the denominator. The hand reference runs each trajectory through policy_loss on its own."""
    cfg = make_cfg(**{"trainer.grad_clip": 0.0, "trainer.micro_batch_size": 2, "trainer.global_batch_size": 8})
    spec = {"cfg": OmegaConf.to_container(cfg), "run_dir": str(tmp_path / "run")}
    start_ranks(_modes_worker, args=(2, free_port(), spec), nprocs=2)
