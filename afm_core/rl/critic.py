"""PPO's critic on Megatron (``algorithm.adv_estimator=gae``): a value model, its values, GAE, its updates, its state.

The value model is the policy's own build (:func:`afm_core.rl.policy_model.build_policy_model`: the same
``GPTModel`` chunks and HF weights) whose output layer is replaced by a scalar head (``hidden -> 1``, no
bias; verl ``verl/models/mcore/model_initializer.py`` builds its Megatron critic the same way with
``LinearForLastLayer``), trained by the one trainer core (:class:`afm_core.engine.core.MegatronTrainer`:
Megatron DDP, its own AdamW and schedule, per-token loss) with the clipped value loss of
:func:`afm_core.rl.losses.value_loss`. Per rollout step (verl ``verl/trainer/ppo/ray_trainer.py::fit``):

    old values V(s_t) of the train batch         forward-only, each DP rank its share, gathered
    GAE over response tokens                     the outcome reward on the last model token; observation
                                                 tokens skipped (afm_core.rl.advantages.gae_advantages), whitened
    critic updates                               the actor's mini-batches, before the actor's updates

Values are aligned like logprobs (:mod:`afm_core.rl.batch`): the value at the position that predicts response
token ``j`` is the value of the state before ``j``.

Checkpoint: ``checkpoints/critic/step_N`` (model + optimizer in megatron's dist format, scheduler in
``common``), written before the actor's ``checkpoints/step_N`` is published, so a complete actor checkpoint
always has its critic; the critic keeps one more checkpoint than the actor, so that a save killed between the
two leaves the critic of the actor's previous checkpoint in place.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from afm_core.config.rl import PolicyConfig
from afm_core.engine.distributed import ParallelLayout, activation_memory_overrides, gather_objects
from afm_core.rl.advantages import gae_advantages
from afm_core.rl.batch import (
    group_micro_batches,
    local_micro_batches,
    micro_batch_plan,
    minibatch_updates,
    response_values,
    token_micro_batches,
)
from afm_core.rl.logprobs import forward_only
from afm_core.rl.losses import reduce_stats, value_loss
from afm_core.rl.packed import rollout_forward
from afm_core.rl.policy_model import build_policy_model

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

    from afm_core.engine.core import MegatronTrainer
    from afm_core.rl.grading import Sample

STATS_KEY = "critic"


class ValueHead(torch.nn.Module):
    """``hidden -> 1`` linear layer (no bias) standing in for ``GPTModel.output_layer``.

    Replicated over tensor-parallel ranks (its input, the final norm's output, is). Called like megatron's
    output layer: ``(hidden [s, b, h], weight=None, runtime_gather_output=None) -> ([s, b, 1], None)``; a
    ``weight`` passed for tied embeddings is ignored.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
        config.init_method(self.weight)

    def forward(
        self, hidden_states: torch.Tensor, weight: object = None, runtime_gather_output: object = None
    ) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region  # megatron: see values()

            hidden_states = gather_from_sequence_parallel_region(hidden_states)
        return torch.nn.functional.linear(hidden_states, self.weight), None


def build_value_model(
    hf_dir: str | os.PathLike,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    load_weights: bool = True,
    **config_overrides: object,
) -> list[torch.nn.Module]:
    """This rank's value-model chunks: the policy build with HF weights (``config_overrides``: extra
    ``TransformerConfig`` fields, as for the policy), the output layer replaced by a :class:`ValueHead` on the last
    pipeline stage and the embedding no longer tied to it (collective when ``load_weights``)."""
    chunks, _ = build_policy_model(
        hf_dir, layout, params_dtype=params_dtype, load_weights=load_weights, **config_overrides
    )
    for chunk in chunks:
        chunk.share_embeddings_and_output_weights = False
        if chunk.post_process:
            chunk.output_layer = ValueHead(chunk.config).to(layout.device)
    return chunks


def values_forward_step(clip_range_value: float | None, remove_padding: bool = True):
    """A megatron ``forward_step_func`` for the critic: next micro batch -> (values, value-loss func); the
    trajectories packed without their padding where the model can (:func:`afm_core.rl.packed.rollout_forward`)."""

    def loss_func(batch: dict[str, torch.Tensor], output: torch.Tensor):
        loss_sum, stats = value_loss(
            output[..., 0],
            batch["old_values"],
            batch["returns"],
            batch["response_mask"],
            global_num_tokens=1,  # per-token-loss mode: megatron divides by the all-reduced token count
            clip_range_value=clip_range_value,
        )
        stats["values_sum"] = torch.where(batch["response_mask"].bool(), output[..., 0].detach().float(), 0.0).sum()
        return loss_sum, batch["response_mask"].to(torch.bool).sum().to(torch.int), {STATS_KEY: stats}

    def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
        values, batch = rollout_forward(model, next(data_iterator), remove_padding=remove_padding)
        return values, partial(loss_func, batch)

    return forward_step


def gae_per_sample(
    samples: Sequence[Sample], values: Sequence[Sequence[float]], *, gamma: float, lam: float
) -> tuple[list[list[float]], list[list[float]]]:
    """GAE advantages and returns of each trajectory over its response tokens (observation tokens skipped).

    The trajectory's reward sits on its last model-generated token (never on an observation: a reward there
    would be skipped too); advantages are whitened over all response tokens of the batch
    (:func:`afm_core.rl.advantages.gae_advantages`). A trajectory without a model-generated token (a rollout
    that ended before its first token) has nothing to train: its advantages and returns are 0, as on the GRPO
    path.

    Args:
        samples: the train batch (``reward``, ``response_mask``).
        values: each trajectory's old values, one per response token.
    Returns:
        ``(advantages, returns)``: per-token lists as long as each response (0 on observation tokens).
    Raises:
        ValueError: values of the wrong length.
    """
    width = max(len(s.response_mask) for s in samples)
    shape = (len(samples), width)
    rewards, vals, mask = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
    for i, (s, v) in enumerate(zip(samples, values)):
        if len(v) != len(s.response_mask):
            raise ValueError(f"trajectory {i}: {len(v)} values for {len(s.response_mask)} response tokens")
        generated = [j for j, m in enumerate(s.response_mask) if m]
        if generated:  # else (e.g. a rollout that ended before its first token): nothing to train, advantage 0
            rewards[i, generated[-1]] = float(s.reward)
        vals[i, : len(v)] = torch.tensor(v, dtype=torch.float32)
        mask[i, : len(v)] = torch.tensor(s.response_mask, dtype=torch.float32)
    whiten = int(mask.sum()) >= 2  # whitening needs two model tokens in the batch (an all-empty batch has none)
    adv, returns = gae_advantages(rewards, vals, mask, gamma=gamma, lam=lam, whiten=whiten)
    lengths = [len(s.response_mask) for s in samples]
    return [adv[i, :n].tolist() for i, n in enumerate(lengths)], [
        returns[i, :n].tolist() for i, n in enumerate(lengths)
    ]


class Critic:
    """The value model of a PPO run and its optimizer (``algorithm.adv_estimator=gae``).

    Args:
        policy: the trainer side's settings (``critic``: ``optim`` overrides of ``optim``, ``clip_range_value``,
            ``grad_clip``; ``trainer``, ``parallel``, ``algorithm``, ``rollout.n``).
        layout: this rank's parallel layout.
        hf_dir: the policy's HF checkpoint (the critic starts from its weights).
        run_dir: the RL run dir (checkpoints under ``checkpoints/critic``).
        max_optimizer_steps: critic updates of the whole run (its LR schedule).
        params_dtype: training dtype.
        load_weights: load the HF weights (False before a checkpoint load).
    """

    def __init__(
        self,
        policy: PolicyConfig,
        layout: ParallelLayout,
        hf_dir: str | os.PathLike,
        run_dir: Path,
        max_optimizer_steps: int,
        *,
        params_dtype: torch.dtype,
        load_weights: bool = True,
    ):
        from afm_core.engine.core import MegatronTrainer  # megatron: see values()

        critic, t = policy.critic, policy.trainer
        self.config, self.layout = policy, layout
        self.clip_range_value = critic.clip_range_value
        self.remove_padding = t.remove_padding
        self.trainer: MegatronTrainer = MegatronTrainer(
            layout,
            build_value_model(
                hf_dir,
                layout,
                params_dtype=params_dtype,
                load_weights=load_weights,
                **activation_memory_overrides(policy.parallel),  # recompute / sequence parallel, as the policy's
            ),
            optim={**asdict(policy.optim), **asdict(critic.optim)},
            max_steps=max(1, max_optimizer_steps),
            grad_clip=critic.grad_clip,
            distributed_optimizer=policy.parallel.distributed_optimizer,
            checkpoint_dir=critic_checkpoints(run_dir),
            keep_last=t.keep_last + 1,  # see the module docstring
        )

    @property
    def model(self) -> list[torch.nn.Module]:
        return self.trainer.model

    def _pad_to(self, seq_length: int) -> int | None:
        """The critic's micro batches are padded to ``seq_length``; by tokens
        (``trainer.max_tokens_per_micro_batch``, PP=1) each to its own longest."""
        return seq_length if self.config.trainer.max_tokens_per_micro_batch is None else None

    def values(self, samples: Sequence[Sample], seq_length: int, pad_id: int) -> list[list[float]]:
        """Old values of every sample's response tokens (each DP rank computes its share: every ``dp``-th sample
        in micro batches of ``trainer.micro_batch_size``, or a token-balanced share in micro batches of at most
        ``trainer.max_tokens_per_micro_batch`` tokens, :func:`~afm_core.rl.batch.token_micro_batches`; gathered, so
        every rank returns all of them, in sample order)."""
        # megatron: not at the top, so that importing the RL modules (gae_per_sample, the tests) loads none
        from megatron.core import parallel_state as ps

        t = self.config.trainer
        dp, dp_rank = self.layout.dp, self.layout.dp_rank
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        if t.max_tokens_per_micro_batch is None:  # every dp-th sample, in micro batches of micro_batch_size
            groups = local_micro_batches(list(range(len(samples)))[dp_rank::dp], lengths, t.micro_batch_size, None)
        else:  # by tokens, balanced over the DP ranks
            groups = token_micro_batches(lengths, t.max_tokens_per_micro_batch, dp)[dp_rank]
        batches = group_micro_batches(samples, groups, self._pad_to(seq_length), pad_id)
        for chunk in self.model:
            chunk.eval()
        outs = forward_only(
            self.model,
            batches,
            ["values"],
            lambda output, batch: {"values": output[..., 0].float()},
            remove_padding=self.remove_padding,
        )
        for chunk in self.model:
            chunk.train()
        local: dict[int, list[float]] = {}
        for group, batch, out in zip(groups, batches, outs):
            for i, v in zip(group, response_values(out["values"], batch)):
                local[i] = v.tolist()
        if dp > 1:
            for part in gather_objects(local, group=ps.get_data_parallel_group()):
                local.update(part)
        return [local[i] for i in range(len(samples))]

    def update(
        self,
        samples: Sequence[Sample],
        old_values: Sequence[Sequence[float]],
        returns: Sequence[Sequence[float]],
        seq_length: int,
        pad_id: int,
    ) -> dict[str, float]:
        """``ppo_epochs`` x mini-batches of critic optimizer steps (the actor's mini-batch split).

        Returns:
            ``critic/vf_loss``, ``critic/vf_clip_frac``, ``critic/values`` (means over response tokens),
            ``critic/returns``, ``critic/grad_norm`` (last), ``critic/lr``, ``critic/optimizer_steps``,
            ``critic_s``.
        """
        from megatron.core import parallel_state as ps  # megatron: see values()

        start = time.perf_counter()
        t = self.config.trainer
        mini = self.config.algorithm.mini_batch_size * self.config.n
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        plan = micro_batch_plan(lengths, mini, self.layout.dp, self.layout.dp_rank, t.micro_batch_size,
                                t.max_tokens_per_micro_batch, by_length=False)  # fmt: skip

        def inputs(share: Sequence[int]) -> dict[str, list[Sequence[float]]]:
            return {"old_values": [old_values[i] for i in share], "returns": [returns[i] for i in share]}

        forward_step = values_forward_step(self.clip_range_value, self.remove_padding)
        done = minibatch_updates(self.trainer, samples, plan, forward_step, inputs, self.config, seq_length,
                                 self._pad_to(seq_length), pad_id, stats_key=STATS_KEY,
                                 what="critic update {step}")  # fmt: skip
        stats, grad_norm, lr, steps = done.stats, done.grad_norm, done.lr, done.steps
        reduced = reduce_stats(stats, ps.get_data_parallel_group()) if stats else {}
        tokens = [r for s, values in zip(samples, returns) for r, m in zip(values, s.response_mask) if m]
        return {
            **{f"critic/{k}": v for k, v in reduced.items() if k != "tokens"},
            "critic/returns": sum(tokens) / max(len(tokens), 1),
            "critic/grad_norm": grad_norm,
            "critic/lr": lr,
            "critic/optimizer_steps": steps,
            "critic_s": time.perf_counter() - start,
        }

    def save(self, step: int) -> Path:
        """``checkpoints/critic/step_N`` (collective)."""
        return self.trainer.save(step, {})

    def load(self, actor_checkpoint: Path) -> Path:
        """Load the critic saved with the actor checkpoint ``actor_checkpoint`` (collective).

        Raises:
            FileNotFoundError: that critic checkpoint is missing (the run was not a PPO run).
        """
        path = critic_checkpoints(actor_checkpoint.parent.parent) / actor_checkpoint.name
        if not path.is_dir():
            raise FileNotFoundError(
                f"{actor_checkpoint}: no critic checkpoint at {path} (resuming a run without a critic with "
                "algorithm.adv_estimator=gae?)"
            )
        self.trainer.load(path)
        return path


def critic_checkpoints(run_dir: Path) -> Path:
    """Where a run's critic checkpoints live: ``RUN_DIR/checkpoints/critic``."""
    return Path(run_dir) / "checkpoints" / "critic"
