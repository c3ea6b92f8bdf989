"""``run_rl(config)``: one colocated DAPO job with tool rollouts, the entry point every rank of ``jobs.rl`` runs.

Reads like slime's ``train.py`` (THUDM/slime) and verl's DAPO ``fit`` (``recipe/dapo/dapo_ray_trainer.py``); each
line is a call on a named part::

    resume (models, optimizers, rollout step, stage, prompt position, dynamic sampler, RNG)  rl/checkpoint.py
    start the engine; the RNG it reseeded put back; sync the trainer's weights into it      rl/rollout_actor.py
    open the tracker (metrics.jsonl + logger backends, the resumed runs continued)         rl/metrics.py
    validation.before_training()                       # trainer.val_before_train          rl/validation.py
    for each rollout step (profile.steps traced):
        stage = stage_at(stages, step)                 # response budget, trainer seq length   rl/schedule.py
        batch = fill_train_batch(...)                  # rounds of prompts -> engine -> graded rl/train_batch.py
                                                       # samples until DAPO's sampler is full, the rollout buffer's
                                                       # groups first; a stop keeps the round in the buffer (None)
        handover.to_trainer()                          # GPU: the engine sleeps, the trainer's state comes back
        advantages = policy.advantages(samples)        # GRPO over groups, or critic -> GAE    rl/policy_trainer.py
        policy.train(samples, advantages)              # critic, old logprobs, mini-batches    rl/policy_trainer.py
        metrics.write(step_record(...))                # metrics.jsonl, rl.png, the backends    rl/metrics.py
        dump_rollouts(...)                             # trainer.rollout_data_dir/<step>.jsonl  rl/rollout_dump.py
        validation.after_step(step)                    # every trainer.test_freq steps, last   rl/validation.py
        checkpoints.at_step_end(step)                  # at the interval or when asked; a stop rl/checkpoint.py
                                                       # ends the run
    the engine's turns (rl/colocation.py Handover) sync the trained weights, Megatron -> vLLM (rl/weight_sync.py)

The rollout contract between the two sides is :class:`afm_core.rl.grading.Sample`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from afm_core.config.rl import RLConfig
from afm_core.engine.checkpoint_dirs import find_resume_checkpoint
from afm_core.engine.preemption import JOB_PREEMPTION, Preemption
from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
from afm_core.rl.checkpoint import Checkpointer, RLProgress, RLState
from afm_core.rl.dynamic_sampling import dynamic_sampler
from afm_core.rl.metrics import RLMetricsLog, step_record
from afm_core.rl.prompts import PromptStream, load_prompts
from afm_core.rl.rollout_dump import dump_rollouts
from afm_core.rl.schedule import Stage, build_stages, stage_at, train_seq_length
from afm_core.rl.train_batch import fill_train_batch
from afm_core.rl.validation import Validation, naming, validation_benchmarks
from afm_core.rollout.factory import load_tokenizer
from afm_core.utils.plugins import check_plugins
from afm_core.utils.profiling import StepProfiler

if TYPE_CHECKING:  # torch, megatron, vLLM: jobs.rl imports this module where it only submits (check_inputs)
    from transformers import PreTrainedTokenizerBase

    from afm_core.engine.distributed import ParallelLayout
    from afm_core.eval.benchmarks import Benchmark
    from afm_core.rl.parts import Policy, Record, Turns
    from afm_core.rl.rollout_actor import RolloutActor
    from afm_core.rollout.types import AgentTask


@dataclass
class RunParts:
    """The parts of one run on this rank, built by :func:`run_rl` and driven by :func:`_loop` (slime's ``train.py``
    holds its actor and rollout models the same way): where the rank sits (``layout``), the trainer side
    (``policy``), the rollout side (``actor``), whose turn the device is (``handover``), the prompts (``tasks``,
    the ``tokenizer`` that dumps them), the validation benchmarks, the response-budget ``stages``, the resumable
    ``state`` and where a stop is asked for (``preemption``)."""

    layout: ParallelLayout
    policy: Policy
    actor: RolloutActor
    handover: Turns
    tokenizer: PreTrainedTokenizerBase
    tasks: list[AgentTask]
    val_benchmarks: list[Benchmark]
    stages: list[Stage]
    state: RLState
    preemption: Preemption


def run_rl(
    config: RLConfig,
    after_step: Callable[[int], None] | None = None,
    preemption: Preemption | None = None,
) -> Record:
    """DAPO with tool rollouts on this rank (see the module docstring); every rank of the job calls it.

    Args:
        config: the checked ``conf/rl.yaml`` (``jobs.rl``'s ranks make it with
            :func:`~afm_core.config.rl.rl_config`); each part gets the typed sub-config it reads.
        after_step: called with the rollout step number after each step's metrics are written (before the
            checkpoint decision), e.g. to ``preemption.request``.
        preemption: where a checkpoint or a stop is asked for (:class:`~afm_core.engine.preemption.Preemption`: read
            at each step boundary, polled while a round generates or validates); None: the job's
            (:data:`~afm_core.engine.preemption.JOB_PREEMPTION`, what its SIGUSR2 sets).
    Returns:
        ``{"step", "max_steps", "stopped_early", "resumed_from", "checkpoint", "hf_dir", "stage", "data_state",
        "run_dir", ...}`` (identical on every rank); ``hf_dir`` is the policy's HF export ``RUN_DIR/hf``
        (safetensors + config + tokenizer, written when the run completes and ``trainer.export_hf``), else None.
    Raises:
        ValueError: a bad config value (names the field).
        afm_core.rl.dynamic_sampling.DynamicSamplingExhausted: ``max_num_gen_batches`` batches did not fill a
            train batch.
    """
    # torch, megatron, vLLM: not at the top, where jobs.rl imports this module to submit (check_inputs)
    from afm_core.engine.checkpoint import rng_state, set_rng_state
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.rl.colocation import Handover
    from afm_core.rl.policy_trainer import PolicyTrainer, check_batch_split
    from afm_core.rl.rollout_actor import start_rollout_actor

    preemption = JOB_PREEMPTION if preemption is None else preemption
    t, a, r, ckpt = config.trainer, config.algorithm, config.rollout, config.checkpoint
    run_dir = Path(ckpt.run_dir)
    stages = build_stages(r)

    hf_dir = ensure_hf_checkpoint(asdict(config.model))
    tokenizer = load_tokenizer(hf_dir)
    tasks = load_prompts(config.data, config.data_dir, tokenizer)
    val_benchmarks = validation_benchmarks(config.validation)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    layout = init_distributed(config.parallel, seed=t.seed, num_threads=t.num_threads)
    try:
        # before any model or engine starts, not after the first rollout step's generation
        check_batch_split(a.mini_batch_size * r.n, a.train_batch_size * r.n, layout.dp, t.micro_batch_size,
                          t.max_tokens_per_micro_batch)  # fmt: skip
        resume_path = find_resume_checkpoint(run_dir, ckpt.resume)
        policy = PolicyTrainer(config.policy, layout, hf_dir, run_dir, pad_id, load_weights=resume_path is None)
        # groups kept on algorithm.filter_groups_metric (accuracy by default)
        state = RLState(RLProgress(), PromptStream(len(tasks), t.seed), dynamic_sampler(a))
        if resume_path is not None:
            state.load_state_dict(policy.load(resume_path))
            if layout.is_rank0:
                print(
                    f"[rl] resumed from {resume_path} at rollout step {state.progress.rollout_step}, stage "
                    f"{state.progress.stage}, prompts {state.stream.state_dict()}",
                    flush=True,
                )
        max_model_len = config.data.max_prompt_len + r.longest_response
        val_tasks = [task for bench in val_benchmarks for task in bench.tasks]  # their tool servers start too
        rng = rng_state()  # seeded, or the checkpoint's: vLLM's start reseeds this process (set_random_seed)
        with start_rollout_actor(config.actor, layout, hf_dir, tokenizer, tasks + val_tasks, max_model_len,
                                 preemption) as actor:  # fmt: skip
            set_rng_state(rng)  # an in-process engine samples from it on CPU: a resumed run draws what it would have
            offload = bool(actor.colocation is not None and actor.colocation.offload_trainer)
            handover = Handover(
                actor, policy.trainers, offload=offload, bucket_bytes=config.weight_sync.bucket_mb * 2**20
            )
            sync0 = handover.to_engine()  # the trainer's weights into the engine (they differ after a resume)
            if layout.is_rank0:
                print(
                    f"[rl] {config.model.name}: world {layout.world_size} (tp={layout.tp} pp={layout.pp} "
                    f"dp={layout.dp}), {len(tasks)} prompts, {t.max_steps} rollout steps x {a.train_batch_size} "
                    f"prompts x n={r.n}; stages {[asdict(s) for s in stages]}; first sync "
                    f"{sync0['weight_sync_s']:.2f} s; trainer offloaded while generating: {offload}; run dir {run_dir}",
                    flush=True,
                )
            parts = RunParts(
                layout, policy, actor, handover, tokenizer, tasks, val_benchmarks, stages, state, preemption
            )
            summary = _loop(config, parts, sync0, after_step)
            summary["resumed_from"] = str(resume_path) if resume_path else None
            summary["hf_dir"] = None
            if ckpt.export_hf and not summary["stopped_early"]:  # the policy, for python -m jobs.eval
                handover.to_trainer()
                summary["hf_dir"] = str(policy.export_hf(hf_dir, run_dir / "hf"))
        return summary
    finally:
        destroy_distributed()


def check_inputs(config: RLConfig) -> None:
    """What :func:`run_rl` reads besides the model, checked where ``jobs.rl`` is submitted (before the queue, no
    model or engine built): the plug-ins (``reward_fn``, plug-in tools: imported, not built), the validation
    benchmarks and the RL prompt sources (``data.presets`` / ``data.files``). ``config``: the checked config, as
    :func:`run_rl` takes it.

    Raises:
        ValueError: naming the key: an unknown preset, a plug-in that does not import, no prompt source.
        FileNotFoundError: a prompt or benchmark file that is absent.
    """
    from afm_core.eval.benchmarks import load_sources  # aiohttp (graders' clients): not where jobs.rl is imported

    check_plugins({"reward_fn": config.reward_fn, "tools": asdict(config.tools)})
    validation_benchmarks(config.validation)
    data = config.data
    try:
        load_sources(data.presets, data.files, config.data_dir, unique=False,
                     empty="name at least one source of RL prompts")  # fmt: skip
    except (ValueError, FileNotFoundError) as err:
        raise naming(f"data.presets={data.presets} / data.files={data.files}", err) from None


def _loop(
    config: RLConfig, parts: RunParts, carry: dict[str, float], after_step: Callable[[int], None] | None
) -> Record:
    """The rollout steps from ``parts.state.progress.rollout_step`` to ``trainer.max_steps`` (or a stop
    ``parts.preemption`` asks for); ``carry``: the first sync's times, logged with the first step (as a
    validation's are with the step after it)."""
    t, a, r = config.trainer, config.algorithm, config.rollout
    layout, policy, actor, handover, state = parts.layout, parts.policy, parts.actor, parts.handover, parts.state
    progress, stream = state.progress, state.stream
    run_dir, max_steps, max_prompt_len = Path(config.run_dir), t.max_steps, config.data.max_prompt_len
    metrics = RLMetricsLog(config, progress, enabled=layout.is_rank0)
    profiler = StepProfiler(asdict(config.profile), run_dir, layout.rank, layout.on_gpu)
    validation = Validation(parts.val_benchmarks, config.validation, max_steps=max_steps, actor=actor,
                            handover=handover, metrics=metrics)  # fmt: skip
    checkpoints = Checkpointer(policy, handover, state, parts.preemption, config.checkpoint, max_steps=max_steps,
                               on_gpu=layout.on_gpu, verbose=layout.is_rank0)  # fmt: skip
    carry = {**carry, **validation.before_training(progress.rollout_step)}
    stopped_early = False
    train: Record  # the step's update metrics ({} when it trained nothing)
    while progress.rollout_step < max_steps:
        step_start = time.perf_counter()
        times, carry = {"generate_s": 0.0, "tools_s": 0.0, "weight_sync_s": 0.0, **carry}, {}
        with profiler.step(progress.rollout_step + 1):  # a no-op outside profile.steps
            stage = stage_at(parts.stages, progress.rollout_step)
            progress.enter_stage(stage, verbose=layout.is_rank0)
            batch = fill_train_batch(actor, handover, state, parts.tasks, stage, n=r.n,
                                     gen_batch_size=a.gen_batch_size, seed=t.seed, times=times, partial=r.partial,
                                     simulated=r.environment == "simulated")  # fmt: skip
            if batch is not None:
                times.update(handover.to_trainer())  # GPU: the engine sleeps, the trainer's state comes back
                checkpoints.trainer_turn_starts()
                seq_length, train = 0, {}
                if batch.samples:  # empty only with allow_partial when no group had reward spread
                    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in batch.samples]
                    seq_length = train_seq_length(stage, max_prompt_len, lengths, layout.pp)
                    advantages = policy.advantages(batch.samples, seq_length)
                    times.update(advantages.times)
                    version = progress.rollout_step if r.partial.enable else None  # the gap by lag, when lags exist
                    train = policy.train(batch.samples, advantages, seq_length, version)
                    handover.trained()  # synced into the engine at its next turn
        if batch is None:  # a stop came during a round: the buffer (or the state from before it) is saved
            checkpoints.save_stopped_round()
            stopped_early = True
            break
        times["step_s"] = time.perf_counter() - step_start
        progress.step_done(len(batch.samples), int(cast("int", train.get("optimizer_steps", 0))), times["step_s"])
        tool_metrics = actor.tool_metrics() if layout.is_rank0 else None
        metrics.write(step_record(progress, stage, seq_length, max_prompt_len, batch.samples, batch.generated,
                                  batch.sampling, train, times, stream, tool_metrics,
                                  r.environment, batch.partial))  # fmt: skip
        if t.rollout_data_dir and layout.is_rank0:
            dump_rollouts(t.rollout_data_dir, progress.rollout_step, batch.generated, batch.samples, parts.tokenizer)
        carry = validation.after_step(progress.rollout_step)  # its weight sync / offload: the next step's
        if after_step is not None:
            after_step(progress.rollout_step)
        if checkpoints.at_step_end(progress.rollout_step):
            stopped_early = True
            break
    profiler.stop()
    metrics.close()
    return {
        "step": progress.rollout_step,
        "max_steps": max_steps,
        "stopped_early": stopped_early,
        "checkpoint": str(checkpoints.last) if checkpoints.last else None,
        "stage": progress.stage,
        "optimizer_steps": progress.optimizer_steps,
        "data_state": stream.state_dict(),
        "train_time_s": progress.train_time_s,
        "run_dir": str(run_dir),
    }
