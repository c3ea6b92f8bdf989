"""Agentic RL (DAPO / GRPO / PPO): :func:`afm_core.rl.driver.run_rl` over named parts, one module each.

- :mod:`afm_core.rl.driver`: the loop only (fill a train batch -> advantages -> train -> log -> validate -> save)
  over the run's parts (``RunParts``);
- :mod:`afm_core.rl.parts`: the ``typing.Protocol`` s of the parts a run swaps (trainer core, critic, policy
  trainer, handover, rollout side, colocated engine, tools);
- :mod:`afm_core.rl.train_batch`: generation rounds until the train batch is full; a stop aborts the round and
  puts the run's state back;
- :mod:`afm_core.rl.validation`: the validation benchmarks, when to validate, the run on engine 0;
- :mod:`afm_core.rl.schedule`: the staged context length (response budget, trainer sequence length);
- :mod:`afm_core.rl.prompts`: the RL tasks and the resumable, epoch-shuffled prompt stream;
- :mod:`afm_core.rl.rollout_actor`: this rank's vLLM engine, tool pool and graders, beside its node's tool servers;
- :mod:`afm_core.rl.rounds`: a generation round's target and result, and how a stop ends it;
- :mod:`afm_core.rl.grading`: a rollout graded into the trainer's ``Sample`` (the rollout contract);
- :mod:`afm_core.rl.reward_shaping`: the reward from score and format, DAPO's overlong penalty;
- :mod:`afm_core.rl.dynamic_sampling`: the DAPO group filter that keeps generating until the batch is full;
- :mod:`afm_core.rl.advantages`: GRPO group-normalised and GAE advantages, broadcast to response tokens;
- :mod:`afm_core.rl.policy_trainer`: the policy, critic and reference on the one trainer core; the policy update;
- :mod:`afm_core.rl.actor`: the DAPO loss as a megatron-core ``forward_step_func``;
- :mod:`afm_core.rl.critic`: PPO's value model, its values, GAE and updates;
- :mod:`afm_core.rl.batch`: trajectories -> padded micro batches; mini-batch shares and the one mini-batch loop;
- :mod:`afm_core.rl.losses`: the clip-higher policy loss (token-mean over the global batch, dual-clip, k3 KL,
  truncated importance sampling), the clipped value loss, their additive statistics;
- :mod:`afm_core.rl.logprobs`: trainer-side per-token logprobs and entropy from Megatron (vocab-parallel);
- :mod:`afm_core.rl.policy_model`: the Megatron policy/reference model chunks built from an HF checkpoint;
- :mod:`afm_core.rl.weight_sync`: Megatron -> vLLM weight sync through a vLLM worker extension;
- :mod:`afm_core.rl.colocation`: where each rank's engine runs (in-process TP groups, or ``AsyncLLM``);
- :mod:`afm_core.rl.metrics`: the metrics.jsonl record of a rollout step, ``rl.png``;
- :mod:`afm_core.rl.checkpoint`: the run's resumable state beside the models; when to save (and the stop lead).
"""

from afm_core.utils import import_hooks

import_hooks.install()  # before this package's modules first import megatron-core / mbridge
