"""The algorithmic core of agentic RL (DAPO / GRPO / PPO), independent of the agent loop.

- :mod:`afm_core.rl.batch`: rollout trajectories -> padded micro batches aligned with the trained targets;
- :mod:`afm_core.rl.advantages`: GRPO group-normalised and GAE advantages, broadcast to response tokens;
- :mod:`afm_core.rl.losses`: the clip-higher policy loss (token-mean over the global batch, dual-clip, k3 KL,
  truncated importance sampling), the clipped value loss, their additive statistics;
- :mod:`afm_core.rl.actor`: that loss as a megatron-core ``forward_step_func`` (the policy update);
- :mod:`afm_core.rl.dynamic_sampling`: the DAPO group filter that keeps generating until the batch is full;
- :mod:`afm_core.rl.reward_shaping`: DAPO's overlong reward shaping;
- :mod:`afm_core.rl.logprobs`: trainer-side per-token logprobs and entropy from Megatron (vocab-parallel);
- :mod:`afm_core.rl.policy_model`: the Megatron policy/reference model chunks built from an HF checkpoint;
- :mod:`afm_core.rl.weight_sync`: Megatron -> vLLM weight sync through a vLLM worker extension.
"""
