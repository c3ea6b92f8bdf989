"""PPO with a GAE critic and the low-var KL loss (afm_core.rl.critic, ``algorithm.adv_estimator=gae``,
``algorithm.kl_coef``):

- the reward of a trajectory lands on its last model-generated token, never on a trailing observation;
- the critic (the policy build + a scalar head, its own optimizer) checkpointed after an update and loaded
  into a fresh build has the same weights, optimizer state and schedule, and its next update gives bitwise the
  same weights as the uninterrupted critic's;
- ``recipe=rl_smoke`` with ``adv_estimator=gae`` and ``kl_coef=0.001`` (the upstream MHQA recipe's PPO + KL
  loss), interrupted after its first rollout step and resumed: every step once, critic and KL metrics
  logged, the critic checkpoint next to each actor checkpoint;
- ``recipe=afm_mhqa_rl`` carries the upstream MHQA PPO settings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from afm_core.rl.critic import gae_per_sample
from afm_core.rl.grading import Sample
from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env, set_rank_env_for_test
from tests.ranks import start_ranks
from tests.rl.helpers import needs_shared_data, rl_config, run_rl_ranks


def _config(run_dir: Path, *overrides: str, recipe: str = "rl_smoke") -> dict:
    return rl_config(run_dir, *overrides, recipe=recipe)


def _sample(uid: str, reward: float, mask: list[int]) -> Sample:
    return Sample(
        uid=uid,
        task_id="t",
        prompt_ids=[1, 2, 3],
        response_ids=list(range(10, 10 + len(mask))),
        response_mask=mask,
        logprobs=[0.0] * len(mask),
        score=reward,
        format=1.0,
        reward=reward,
        finish_reason="length",
    )


def test_gae_puts_the_reward_on_the_last_model_token_and_skips_observations():
    # a trajectory cut inside a tool observation: its last tokens have mask 0
    samples = [_sample("a", 1.0, [1, 1, 0, 0, 1, 0, 0]), _sample("b", 0.0, [1, 1, 1, 1, 1, 1, 1])]
    values = [[0.0] * 7, [0.0] * 7]
    advantages, returns = gae_per_sample(samples, values, gamma=1.0, lam=1.0)
    # gamma = lam = 1 and zero values: every model token's return is its trajectory's reward
    assert returns[0] == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0] and returns[1] == [0.0] * 7
    assert [round(a, 6) for a in advantages[0][2:4] + advantages[0][5:]] == [0.0] * 4  # observations: 0
    # whitened over the 10 model tokens of the batch: 3 at +x, 7 at -y, mean 0
    model = [a for s, adv in zip(samples, advantages) for a, m in zip(adv, s.response_mask) if m]
    assert abs(sum(model)) < 1e-5 and len(model) == 10 and model[0] > 0 > model[-1]


def test_gae_gives_a_trajectory_without_model_tokens_zero_advantage():
    # an empty response (the rollout ended before its first token) beside a normal one; then a batch of only it
    samples = [_sample("c", 1.0, []), _sample("d", 1.0, [1, 1, 0, 1])]
    advantages, returns = gae_per_sample(samples, [[], [0.5, 0.5, 0.0, 0.5]], gamma=1.0, lam=1.0)
    assert advantages[0] == returns[0] == [] and len(advantages[1]) == 4 and advantages[1][2] == 0.0
    assert returns[1] == [1.0, 1.0, 0.0, 1.0]
    advantages, returns = gae_per_sample([_sample("e", 1.0, [0, 0])], [[0.0, 0.0]], gamma=1.0, lam=1.0)
    assert advantages == returns == [[0.0, 0.0]]


# -- the critic's state ---------------------------------------------------------------------------------------
def _critic_rank(rank: int, world: int, port: int, cfg: dict, out: str) -> None:
    set_rank_env(rank, world, port)
    from afm_core.config.rl import rl_config as as_rl_config
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rl.critic import Critic

    layout = init_distributed(OmegaConf.create(cfg["parallel"]), seed=1, num_threads=1)
    try:
        hf_dir = ensure_hf_checkpoint(cfg["model"])
        run_dir = Path(cfg["run_dir"])
        samples = [_sample(f"g{i // 2}", float(i % 2), [1, 1, 1, 0, 0, 1, 1, 1]) for i in range(4)]
        returns = [[float(i % 2)] * 8 for i in range(4)]

        def update(critic: Critic) -> dict:
            values = critic.values(samples, 11, 0)
            return critic.update(samples, values, returns, 11, 0)

        def state(critic: Critic) -> dict[str, torch.Tensor]:
            tensors = {f"p.{n}": p.detach().clone() for n, p in critic.model[0].module.named_parameters()}
            for i, group in enumerate(critic.trainer.optimizer.optimizer.state.values()):
                for key, value in group.items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"o.{i}.{key}"] = value.clone()
            return tensors

        first = Critic(as_rl_config(cfg).policy, layout, hf_dir, run_dir, 10, params_dtype=torch.float32)
        stats = update(first)
        checkpoint = run_dir / "checkpoints" / "step_00000001"
        first.save(1)
        saved = state(first)
        update(first)  # the uninterrupted critic goes on
        straight = state(first)

        fresh = Critic(
            as_rl_config(cfg).policy, layout, hf_dir, run_dir, 10, params_dtype=torch.float32, load_weights=False
        )
        fresh.load(checkpoint)
        loaded = state(fresh)
        same_state = loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
        same_schedule = fresh.trainer.scheduler.state_dict() == first.trainer.scheduler.state_dict() or None
        update(fresh)
        resumed = state(fresh)
        same_next = all(torch.equal(resumed[k], straight[k]) for k in straight if k.startswith("p."))
        if rank == 0:
            Path(out).write_text(
                json.dumps(
                    {
                        "stats": stats,
                        "same_state": same_state,
                        "same_next": same_next,
                        "schedule_checked": same_schedule is not None,
                        "head": [n for n in loaded if "output_layer" in n],
                    }
                )
            )
    finally:
        destroy_distributed()


@pytest.mark.slow
def test_the_critic_resumes_exactly_from_its_checkpoint(tmp_path):
    cfg = _config(tmp_path / "run", "algorithm.adv_estimator=gae", "algorithm.mini_batch_size=2", "rollout.n=2")
    out = tmp_path / "critic.json"
    start_ranks(_critic_rank, args=(1, free_port(), cfg, str(out)), nprocs=1)
    result = json.loads(out.read_text())
    assert result["head"] == ["p.output_layer.weight"], "a scalar value head replaces the LM head"
    assert result["stats"]["critic/optimizer_steps"] == 1 and result["stats"]["critic/vf_loss"] > 0
    assert result["same_state"], "weights and optimizer moments come back bitwise"
    assert result["same_next"], "the resumed critic's next update equals the uninterrupted one's"


# -- the job ----------------------------------------------------------------------------------------------------
@needs_shared_data
@pytest.mark.slow
def test_ppo_with_a_critic_and_the_kl_loss_runs_and_resumes_with_its_critic(tmp_path):
    run_dir = tmp_path / "ppo"
    cfg = _config(run_dir, "algorithm.adv_estimator=gae", "algorithm.kl_coef=0.001", "trainer.max_steps=2")
    first = run_rl_ranks(cfg, stop_after=1)
    assert first["stopped_early"] and first["step"] == 1
    assert (run_dir / "checkpoints" / "critic" / "step_00000001" / "COMPLETE").is_file()
    second = run_rl_ranks(cfg)
    assert second["resumed_from"] == first["checkpoint"] and second["step"] == 2
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in ("critic/vf_loss", "critic/values", "critic/returns", "critic/grad_norm", "actor/kl", "values_s"):
            assert key in r and r[key] == r[key], key  # present and not nan
        assert r["critic/optimizer_steps"] == r["optimizer_steps"] == 2
        assert r["critic/lr"] == pytest.approx(1e-5) and r["actor/kl"] >= 0
    assert (run_dir / "checkpoints" / "critic" / "step_00000002" / "COMPLETE").is_file()


def test_the_mhqa_ppo_recipe_passes_the_submit_check_as_gae_with_one_sample_per_prompt(tmp_path):
    """afm_mhqa_rl passes the RL schema (what jobs.rl checks before sbatch): PPO needs no group of samples, where
    GRPO's rollout.n=1 is refused."""
    from afm_core.config import ConfigError, check_config
    from afm_core.config.rl import RLConfig

    cfg = _config(tmp_path, "data.files=[p.parquet]", recipe="afm_mhqa_rl")
    checked = check_config(OmegaConf.create(cfg), RLConfig)
    assert checked.algorithm.adv_estimator == "gae" and checked.rollout.n == 1 and not checked.algorithm.filter_groups
    with pytest.raises(ConfigError, match=r"rollout\.n=1: GRPO compares samples of a group"):
        check_config(OmegaConf.create({**cfg, "algorithm": {**cfg["algorithm"], "adv_estimator": "grpo"}}), RLConfig)


# -- activation memory (B2) ------------------------------------------------------------------------------------
def test_the_policy_its_critic_and_its_reference_are_built_with_the_jobs_recompute_setting(tmp_path, monkeypatch):
    """RL applies ``parallel.recompute`` / ``parallel.sequence_parallel`` as SFT does (it built its models without
    them: at 32B and 32k tokens the activations did not fit). One rank, tiny-llama, all three models."""
    from afm_core.config.rl import rl_config as as_rl_config
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rl.policy_trainer import PolicyTrainer

    set_rank_env_for_test(monkeypatch, free_port())
    cfg = _config(tmp_path / "run", "parallel.recompute=full", "algorithm.adv_estimator=gae", "algorithm.kl_coef=0.1")
    layout = init_distributed(OmegaConf.create(cfg["parallel"]), seed=1, num_threads=1)
    try:
        hf_dir = ensure_hf_checkpoint(cfg["model"])
        policy = PolicyTrainer(as_rl_config(cfg).policy, layout, hf_dir, tmp_path / "run", 0, load_weights=False)
        assert policy.critic is not None and policy.reference is not None
        for name, chunks in (
            ("policy", policy.model),
            ("critic", policy.critic.model),
            ("reference", policy.reference),
        ):
            config = chunks[0].config
            assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == (
                "full", "uniform", 1,
            ), name  # fmt: skip
        cfg["parallel"]["sequence_parallel"] = True  # transformer-engine only: refused, not silently ignored
        with pytest.raises(ValueError, match=r"parallel\.sequence_parallel needs transformer-engine"):
            PolicyTrainer(as_rl_config(cfg).policy, layout, hf_dir, tmp_path / "run", 0, load_weights=False)
    finally:
        destroy_distributed()
