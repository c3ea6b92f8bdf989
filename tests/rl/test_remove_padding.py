"""RL micro batches through the model without their padding (``trainer.remove_padding``, afm_core.rl.packed): on
the real Megatron model (tiny-llama, fp32, one gloo rank) the packed ``thd`` passes give the padded passes' old
logprobs and entropies, policy gradients and critic values, while the transformer sees only the real tokens."""

from __future__ import annotations

import torch

from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks
from tests.rl.test_observation_mask import TEMPERATURE, _grads


def _worker(rank: int, port: int) -> None:
    set_rank_env(rank, 1, port)
    from omegaconf import OmegaConf

    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rl.advantages import broadcast_to_tokens
    from afm_core.rl.batch import rollout_micro_batch
    from afm_core.rl.critic import build_value_model
    from afm_core.rl.logprobs import compute_logprobs, forward_only
    from afm_core.rl.losses import PolicyLossConfig
    from afm_core.rl.policy_model import build_policy_model

    layout = init_distributed(OmegaConf.create({"tp": 1, "pp": 1}), seed=1, num_threads=1)
    try:
        hf_dir = ensure_hf_checkpoint("tiny-llama")
        chunks, _ = build_policy_model(hf_dir, layout)
        chunks[0].config.calculate_per_token_loss = True  # the schedule returns the masked sum (see actor.py)
        g = torch.Generator().manual_seed(0)
        # three trajectories of 9, 17 and 5 tokens (one with a tool observation): 31 real tokens of 3 x 17
        lengths = [(4, 5), (3, 14), (5, 0)]
        prompts = [torch.randint(1, 500, (p,), generator=g).tolist() for p, _ in lengths]
        responses = [torch.randint(1, 500, (r,), generator=g).tolist() for _, r in lengths]
        masks = [[1] * 5, [1] * 6 + [0] * 4 + [1] * 4, []]
        batch = rollout_micro_batch(prompts, responses, masks)
        b, s = batch["tokens"].shape
        real = torch.arange(s) < torch.tensor([p + r for p, r in lengths]).unsqueeze(1)
        mask = batch["response_mask"].bool()

        seen: list[tuple[int, ...]] = []
        for chunk in chunks:  # megatron calls its embedding with keywords
            chunk.embedding.register_forward_pre_hook(
                lambda module, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
            )

        def logprobs(remove_padding: bool) -> dict[str, torch.Tensor]:
            (out,) = compute_logprobs(
                chunks, [batch], temperature=TEMPERATURE, with_entropy=True, remove_padding=remove_padding
            )
            return out

        padded, packed = logprobs(False), logprobs(True)
        assert seen == [(b, s), (1, 31)], seen  # input_ids [b, s] padded; [1, T] packed
        for key in ("logprobs", "entropy"):
            torch.testing.assert_close(packed[key][mask], padded[key][mask], rtol=1e-5, atol=1e-5, msg=key)
            assert not packed[key][~mask].any() and not padded[key][~mask].any()

        # the policy gradient of one micro batch, both ways
        batch["old_log_prob"] = padded["logprobs"] + 0.3 * torch.randn(padded["logprobs"].shape, generator=g)
        batch["advantages"] = broadcast_to_tokens(torch.tensor([1.0, -1.0, 0.5]), batch["response_mask"])

        config = PolicyLossConfig()
        for want, got in zip(_grads(chunks, batch, config, False)[0], _grads(chunks, batch, config, True)[0]):
            assert (got - want).norm() <= 1e-5 * want.norm(), (got - want).abs().max()

        # the critic's values: the same on every real token; the packed pass leaves the padding 0
        critic = build_value_model(hf_dir, layout)

        def values(remove_padding: bool) -> torch.Tensor:
            (out,) = forward_only(
                critic, [batch], ["values"], lambda output, _: {"values": output[..., 0].float()},
                remove_padding=remove_padding,
            )  # fmt: skip
            return out["values"]

        padded_values, packed_values = values(False), values(True)
        torch.testing.assert_close(packed_values[real], padded_values[real], rtol=1e-5, atol=1e-5)
        assert not packed_values[~real].any() and padded_values[~real].any()
    finally:
        destroy_distributed()


def test_packed_rl_passes_equal_the_padded_ones_on_the_real_tokens():
    start_ranks(_worker, args=(free_port(),), nprocs=1)
