"""The trainer side of an RL run: the policy on the one trainer core
(:class:`~afm_core.engine.core.MegatronTrainer`), the PPO critic (``algorithm.adv_estimator=gae``) and the frozen
reference policy (``algorithm.kl_coef`` > 0), with the two calls of each rollout step::

    advantages = policy.advantages(samples, seq_length)      # GRPO / Dr. GRPO over groups, or critic -> GAE
    metrics = policy.train(samples, advantages, seq_length)  # critic updates, then the policy's mini-batches

:func:`policy_update` is the policy's part (verl ``verl/workers/actor/megatron_actor.py::update_policy``): old
logprobs recomputed, then ``ppo_epochs`` x mini-batches of DAPO optimizer steps (:mod:`afm_core.rl.actor`).

One thing over 400 lines: the trainer side of a rollout step, which the driver calls as one part
(:class:`~afm_core.rl.parts.Policy`), with the policy's update and the figures it reports (the logprob gap by
lag, the phases' throughput); the critic's own update is :mod:`afm_core.rl.critic`, the loss :mod:`afm_core.rl.losses`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from afm_core.config.rl import PolicyConfig
from afm_core.engine.distributed import ParallelLayout, activation_memory_overrides, training_dtype
from afm_core.engine.flops import causal_pairs, datasheet_peak_tflops, mfu, training_flops
from afm_core.models.arch import ModelArch, arch_from_hf_config
from afm_core.rl import advantages as estimators  # looked up at each call: a test negates the estimator
from afm_core.rl.actor import STATS_KEY, policy_forward_step
from afm_core.rl.advantages import Advantages
from afm_core.rl.batch import (
    group_micro_batches,
    local_micro_batches,
    micro_batch_plan,
    minibatch_updates,
    response_values,
)
from afm_core.rl.critic import Critic, gae_per_sample
from afm_core.rl.logprobs import compute_logprobs
from afm_core.rl.losses import logprob_gap_stats, reduce_stats
from afm_core.rl.parts import Record, TrainerCore, ValueModel
from afm_core.rl.policy_model import build_lora_policy_model, reference_chunks, reference_logprobs

if TYPE_CHECKING:
    from afm_core.rl.grading import Sample


def check_batch_split(
    mini_batch: int, train_batch: int, dp: int, micro_batch_size: int, max_tokens: int | None = None
) -> None:
    """Every mini-batch and the train batch (in samples) must split evenly over the data-parallel ranks' micro
    batches; with micro batches by tokens (``max_tokens``, ``trainer.max_tokens_per_micro_batch``) a mini-batch
    (and the rest of a partial train batch) need only give every DP rank a sample.

    Raises:
        ValueError: naming ``algorithm.mini_batch_size``, ``rollout.n`` and ``trainer.micro_batch_size`` (or
            ``trainer.max_tokens_per_micro_batch``).
    """
    if max_tokens is not None:
        rest = train_batch % mini_batch
        if mini_batch < dp or 0 < rest < dp:
            raise ValueError(
                f"algorithm.mini_batch_size x rollout.n = {mini_batch} samples (and the rest {rest} of the train batch "
                f"of {train_batch}) must give each of dp = {dp} ranks a sample with "
                "trainer.max_tokens_per_micro_batch set"
            )
        return
    if mini_batch % (dp * micro_batch_size) or train_batch % (dp * micro_batch_size):
        raise ValueError(
            f"algorithm.mini_batch_size x rollout.n = {mini_batch} samples and the train batch ({train_batch}) must "
            f"be multiples of dp x trainer.micro_batch_size = {dp * micro_batch_size}"
        )


def build_policy_trainer(
    policy: PolicyConfig, layout: ParallelLayout, chunks: list[torch.nn.Module], run_dir: Path, max_optimizer_steps: int
) -> TrainerCore:
    """The policy chunks on :class:`~afm_core.engine.core.MegatronTrainer` (``optim``, ``trainer.grad_clip``,
    ``trainer.keep_last``; checkpoints in ``run_dir/checkpoints``)."""
    from afm_core.engine.core import MegatronTrainer  # megatron: check_batch_split and phase_throughput need none

    return MegatronTrainer(
        layout,
        chunks,
        optim=asdict(policy.optim),
        max_steps=max_optimizer_steps,
        grad_clip=policy.trainer.grad_clip,
        distributed_optimizer=policy.parallel.distributed_optimizer,
        checkpoint_dir=Path(run_dir) / "checkpoints",
        keep_last=policy.trainer.keep_last,
    )


class PolicyTrainer:
    """The policy, its critic (PPO) and its reference (KL) on this rank. With ``model.lora`` the policy trains
    its adapters only and the reference is the policy's own chunks with the adapters disabled
    (:func:`~afm_core.rl.policy_model.reference_chunks`: ``reference`` then holds the trainer's chunks, no copy).

    Args:
        policy: the trainer side's settings (``algorithm``, ``trainer``, ``optim``, ``parallel``, ``critic``,
            ``rollout.n`` and ``rollout.temperature``).
        layout: this rank's parallel layout.
        hf_dir: the initial policy's HF checkpoint.
        run_dir: the run dir (``checkpoints/``, ``checkpoints/critic/``).
        pad_id: the tokenizer's padding id.
        load_weights: load the HF weights (False: a checkpoint load follows).
    Raises:
        ValueError: an unknown ``algorithm.adv_estimator``.
    """

    def __init__(
        self,
        policy: PolicyConfig,
        layout: ParallelLayout,
        hf_dir: Path,
        run_dir: Path,
        pad_id: int,
        *,
        load_weights: bool,
    ):
        a, t = policy.algorithm, policy.trainer
        self.config, self.layout, self.pad_id = policy, layout, pad_id
        updates = t.max_steps * a.ppo_epochs * (a.train_batch_size // a.mini_batch_size)
        dtype = training_dtype(t.precision)
        memory = activation_memory_overrides(policy.parallel)  # recompute / sequence parallel, as SFT's
        chunks, self.hf_config = build_lora_policy_model(
            hf_dir, layout, policy.lora, params_dtype=dtype, load_weights=load_weights, **memory
        )
        self.trainer = build_policy_trainer(policy, layout, chunks, run_dir, max(1, updates))
        self.arch = arch_from_hf_config(self.hf_config)
        self.critic: ValueModel | None = None
        self.reference: list[torch.nn.Module] | None = None
        if a.adv_estimator == "gae":  # PPO: a value model with its own optimizer
            self.critic = Critic(
                policy, layout, hf_dir, run_dir, updates, params_dtype=dtype, load_weights=load_weights
            )
        if a.kl_coef > 0:  # the KL loss (algorithm.kl_loss_type) needs the initial policy: with LoRA the base
            self.reference = reference_chunks(self.trainer.model, hf_dir, layout, params_dtype=dtype, **memory)

    @property
    def model(self) -> list[torch.nn.Module]:
        return self.trainer.model

    @property
    def trainers(self) -> list[TrainerCore]:
        """The trainers with state to offload while the engine generates: the policy's, then the critic's."""
        return [self.trainer] + ([self.critic.trainer] if self.critic is not None else [])

    def advantages(self, samples: Sequence[Sample], seq_length: int) -> Advantages:
        """GRPO (``grpo``: group mean and std; ``drgrpo``: group mean) over each prompt's group, or, PPO, the
        critic's old values -> GAE (per token), with the returns its updates need."""
        a = self.config.algorithm
        if self.critic is None:
            rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
            return Advantages(
                estimators.grpo_advantages(rewards, [s.uid for s in samples], norm_by_std=a.adv_estimator == "grpo")
            )
        start = time.perf_counter()
        old_values = self.critic.values(samples, seq_length, self.pad_id)
        advantages, returns = gae_per_sample(samples, old_values, gamma=a.gamma, lam=a.lam)
        return Advantages(advantages, old_values, returns, {"values_s": time.perf_counter() - start})

    def train(
        self, samples: Sequence[Sample], advantages: Advantages, seq_length: int, version: int | None = None
    ) -> Record:
        """The critic's updates (PPO), then the policy's (:func:`policy_update`); their metrics. ``version``: the
        policy version being trained (partial rollouts: the trainer/engine gap is then also reported by lag)."""
        critic_out: dict[str, float] = {}
        if self.critic is not None:
            old_values, returns = advantages.old_values or [], advantages.returns or []
            critic_out = self.critic.update(samples, old_values, returns, seq_length, self.pad_id)
        out = policy_update(self.trainer, samples, advantages.values, self.config, seq_length, self.pad_id,
                            self.reference, arch=self.arch, version=version)  # fmt: skip
        return {**out, **critic_out}

    def save(self, step: int, common: Record) -> Path:
        """``checkpoints/step_N`` with ``common`` (collective). A critic is saved first
        (``checkpoints/critic/step_N``), so a complete ``step_N`` always has its critic."""
        if self.critic is not None:
            self.critic.save(step)
        return self.trainer.save(step, common)

    def load(self, path: Path) -> Record:
        """Load ``path`` (and its critic) into the models, optimizers and schedules; returns its ``common``."""
        common, _ = self.trainer.load(path)
        if self.critic is not None:
            self.critic.load(path)
        return common

    def export_hf(self, hf_dir: Path, out_dir: Path) -> Path:
        """The policy as an HF checkpoint in ``out_dir`` (safetensors + config + ``hf_dir``'s tokenizer)."""
        from afm_core.models.hf_weights import save_hf_checkpoint  # mbridge, megatron: only the last step exports

        self.trainer.sync_params()
        return save_hf_checkpoint(self.trainer.model, self.hf_config, hf_dir, out_dir)


def policy_update(
    trainer: TrainerCore,
    samples: Sequence[Sample],
    advantages: torch.Tensor | Sequence[Sequence[float]],
    policy: PolicyConfig,
    seq_length: int,
    pad_id: int,
    reference: Sequence[torch.nn.Module] | None = None,
    *,
    arch: ModelArch | None = None,
    version: int | None = None,
) -> Record:
    """Old-logprob recompute, then ``ppo_epochs`` x (train batch / mini batch) optimizer steps on this DP rank's
    share of each mini-batch. Every rank gets the same ``samples`` (the gathered train batch, grouped by prompt).
    The share and its micro batches (:func:`afm_core.rl.batch.micro_batch_plan`): every ``dp``-th sample in micro
    batches of ``trainer.micro_batch_size``, or, with ``trainer.max_tokens_per_micro_batch``, a token-balanced
    share in micro batches of at most that many tokens, as many on every DP rank; the loss is the token-mean over
    the global mini-batch either way.

    Args:
        trainer: the policy's :class:`~afm_core.engine.core.MegatronTrainer`.
        samples: :class:`~afm_core.rl.grading.Sample` s.
        advantages: ``[N]`` one per sample (GRPO: broadcast over its response tokens), or per-token lists as
            long as each response (GAE).
        seq_length: the trainer's sequence length (:func:`afm_core.rl.schedule.train_seq_length`).
        reference: the reference policy's chunks when ``algorithm.kl_coef`` > 0 (the KL loss, verl
            ``use_kl_loss`` with ``algorithm.kl_loss_type``, ``low_var_kl`` by default): a frozen copy, or with
            LoRA the policy's own chunks, run with their adapters disabled.
        arch: the policy's :class:`~afm_core.models.arch.ModelArch`, for the phases' model FLOPs (None: none).
        version: the policy version trained (the rollout step); given, ``logprob_gap_by_lag`` reports the
            trainer/engine gap by each trained token's lag (:func:`logprob_gap_by_lag`).
    Returns:
        Reduced loss statistics (clip fraction, entropy, KL, vLLM-vs-trainer logprob gap...), ``logprob_s``,
        ``train_s``, ``optimizer_steps``, ``grad_norm`` (last), ``lr``; this rank's throughput of the two phases
        (:func:`phase_throughput`).
    Raises:
        ValueError: the mini-batch or the train batch does not split over DP ranks and micro batches
            (:func:`check_batch_split`), a trajectory longer than ``trainer.max_tokens_per_micro_batch`` or that
            budget with pipeline stages, or ``kl_coef`` > 0 without ``reference``.
    """
    from megatron.core import parallel_state as ps  # megatron: check_batch_split and phase_throughput need none

    a, t = policy.algorithm, policy.trainer
    layout = trainer.layout
    dp, dp_rank, mbs, max_tokens = layout.dp, layout.dp_rank, t.micro_batch_size, t.max_tokens_per_micro_batch
    mini = a.mini_batch_size * policy.n
    check_batch_split(mini, len(samples), dp, mbs, max_tokens)
    if max_tokens is not None and layout.pp > 1:
        raise ValueError(
            "trainer.max_tokens_per_micro_batch needs parallel.pp=1 (pipeline stages send one fixed shape)"
        )
    kl_coef = a.kl_coef
    if kl_coef > 0 and reference is None:
        raise ValueError("algorithm.kl_coef > 0 needs the reference policy's chunks")
    temperature, remove_padding = policy.temperature, t.remove_padding
    if isinstance(advantages, torch.Tensor):
        token_adv = [[float(a_)] * len(s.response_ids) for s, a_ in zip(samples, advantages.tolist())]
    else:
        token_adv = [list(map(float, values)) for values in advantages]
    # each micro batch holds samples of similar length and, without pipeline stages (whose p2p shapes are
    # fixed), is padded to its own longest: fewer padded positions through the transformer
    pad_to = seq_length if layout.pp > 1 else None
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]

    def by_length(indices: Sequence[int]) -> list[int]:
        return sorted(indices, key=lambda i: lengths[i])

    # this rank's micro batches of each mini-batch: counted (every dp-th sample) or by tokens (balanced over DP)
    plan = micro_batch_plan(lengths, mini, dp, dp_rank, mbs, max_tokens, by_length=True)
    mine = by_length([i for groups in plan for group in groups for i in group])

    # old logprobs (the trainer's, before this step's updates) and the gap to vLLM's; reference logprobs
    start = time.perf_counter()
    for chunk in trainer.model:
        chunk.eval()
    groups = local_micro_batches(mine, lengths, mbs, max_tokens)
    batches = group_micro_batches(samples, groups, pad_to, pad_id)
    outs = compute_logprobs(
        trainer.model, batches, temperature=temperature, with_entropy=True, remove_padding=remove_padding
    )
    refs = []
    if kl_coef > 0 and reference:
        refs = reference_logprobs(reference, batches, temperature=temperature, remove_padding=remove_padding)
    for chunk in trainer.model:
        chunk.train()
    old: dict[int, list[float]] = {}
    ref: dict[int, list[float]] = {}
    recompute = []
    for b, (group, batch, out) in enumerate(zip(groups, batches, outs)):
        mask = batch["response_mask"]
        recompute.append(
            {
                **logprob_gap_stats(out["logprobs"], batch["rollout_log_prob"], mask),
                "entropy_sum": torch.where(mask.bool(), out["entropy"], 0.0).sum(),
            }
        )
        for i, values in zip(group, response_values(out["logprobs"], batch)):
            old[i] = values.tolist()
        if refs:
            for i, values in zip(group, response_values(refs[b]["logprobs"], batch)):
                ref[i] = values.tolist()
    recomputed = reduce_stats(recompute, ps.get_data_parallel_group())
    by_lag = {} if version is None else logprob_gap_by_lag(samples, old, version, ps.get_data_parallel_group())
    logprob_s = time.perf_counter() - start

    # mini-batch updates
    start = time.perf_counter()

    def extra(share: Sequence[int]) -> dict[str, list[list[float]]]:
        inputs = {"old_log_prob": [old[i] for i in share], "advantages": [token_adv[i] for i in share]}
        if ref:
            inputs["ref_log_prob"] = [ref[i] for i in share]
        return inputs

    # the loss reads the checked algorithm group itself (AlgorithmConfig extends config.policy_loss.PolicyLossConfig)
    forward_step = policy_forward_step(a, temperature=temperature, remove_padding=remove_padding)
    done = minibatch_updates(trainer, samples, plan, forward_step, extra, policy, seq_length, pad_to, pad_id,
                             stats_key=STATS_KEY, what="policy update {step} of this rollout step")  # fmt: skip
    reduced = reduce_stats(done.stats, ps.get_data_parallel_group()) if done.stats else {}
    train_s = time.perf_counter() - start
    passes = 1 + (1 if refs else 0)  # old logprobs (+ the reference's), forward only
    throughput = phase_throughput(arch, [lengths[i] for i in mine], layout, a.ppo_epochs, passes, logprob_s, train_s,
                                  t.peak_tflops)  # fmt: skip
    return {
        **throughput,
        **{f"actor/{k}": v for k, v in reduced.items()},
        "logprob_gap_vllm_trainer": recomputed["logprob_gap"],
        "logprob_gap_vllm_trainer_max": recomputed["logprob_gap_max"],
        **({"logprob_gap_by_lag": by_lag} if version is not None else {}),
        "prob_ratio_error": recomputed["prob_ratio_error"],
        "entropy": recomputed["entropy"],
        "grad_norm": done.grad_norm,
        "lr": done.lr,
        "optimizer_steps": done.steps,
        "logprob_s": logprob_s,
        "train_s": train_s,
    }


def logprob_gap_by_lag(
    samples: Sequence[Sample], old: dict[int, list[float]], version: int, group: object = None
) -> dict[str, float]:
    """The trainer/engine mismatch by lag: mean ``|old logprob - rollout logprob|`` over the trained tokens (mask
    1) of each lag (``version`` minus the token's own), over this rank's samples ``old`` holds (index -> the
    trainer's recomputed logprobs of its response) and the ranks of ``group`` (collective). With partial rollouts
    the lag-1 figure is the staleness the off-policy correction sees (NeMo-RL's ``token_mult_prob_error`` read by
    trajectory age); lag 0 is the numerical gap alone. Returns ``{"0": mean, "1": mean, ...}``."""
    sums: dict[int, list[float]] = {}
    for i, values in old.items():
        s = samples[i]
        if len(s.versions) != len(s.response_mask):  # no versions recorded: nothing to bucket
            continue
        for logp, rollout, m, v in zip(values, s.logprobs, s.response_mask, s.versions):
            if m:
                acc = sums.setdefault(version - v, [0.0, 0.0])
                acc[0] += abs(logp - rollout)
                acc[1] += 1
    parts = [sums]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        gathered: list[object] = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(gathered, sums, group=group)
        parts = cast("list[dict[int, list[float]]]", gathered)
    total: dict[int, list[float]] = {}
    for part in parts:
        for lag, (gap, count) in part.items():
            acc = total.setdefault(lag, [0.0, 0.0])
            acc[0] += gap
            acc[1] += count
    return {str(lag): gap / count for lag, (gap, count) in sorted(total.items()) if count}


def phase_throughput(
    arch: ModelArch | None,
    lengths: Sequence[int],
    layout: ParallelLayout,
    epochs: int,
    logprob_passes: int,
    logprob_s: float,
    train_s: float,
    peak_tflops: float | None = None,
) -> dict[str, float | None]:
    """Tokens/s, model TFLOP/s and MFU of this rank's logprob and train phases, as the SFT job reports its step's
    (:mod:`afm_core.engine.flops`): the real tokens of its trajectories (``lengths``, prompt + response: padding
    is not model work), ``epochs`` forward + backward passes over them in training, ``logprob_passes`` forward
    passes (a third of a training pass) to recompute logprobs; per device (over TP x PP ranks); MFU against
    ``peak_tflops`` (``trainer.peak_tflops``, else the CUDA device's datasheet peak; None on CPU).

    Returns:
        ``train_tokens_per_s``, ``train_tflops``, ``train_mfu``, ``logprob_tokens_per_s``, ``logprob_tflops``
        (the FLOP figures None without ``arch``).
    """
    tokens = sum(lengths)
    out: dict[str, float | None] = {
        "train_tokens_per_s": epochs * tokens / train_s if train_s > 0 else None,
        "logprob_tokens_per_s": logprob_passes * tokens / logprob_s if logprob_s > 0 else None,
        "train_tflops": None,
        "train_mfu": None,
        "logprob_tflops": None,
    }
    if arch is None:
        return out
    if peak_tflops is None and layout.on_gpu:
        peak_tflops = datasheet_peak_tflops(torch.cuda.get_device_name())
    flops = training_flops(arch, tokens, causal_pairs(lengths))
    one_pass = (flops["linear"] + flops["attention"]) / (layout.tp * layout.pp)  # forward + backward, per device
    if train_s > 0:
        out["train_tflops"] = epochs * one_pass / train_s / 1e12
        out["train_mfu"] = mfu(epochs * one_pass, train_s, peak_tflops)
    if logprob_s > 0:
        out["logprob_tflops"] = logprob_passes * one_pass / 3 / logprob_s / 1e12
    return out
