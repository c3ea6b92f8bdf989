"""A generation round of the rollout actor (:meth:`afm_core.rl.rollout_actor.RolloutActor.generate`): when it
stops early (:class:`RoundTarget`, partial rollouts), what it did (:class:`Round`), and how a stop request ends it
(:func:`unless_stopped`: cancelled and aborted in vLLM, :class:`RolloutAborted`; or paused and kept, :data:`STOPPED`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from afm_core.rl.rollout_buffer import Group

if TYPE_CHECKING:  # grading imports torch: jobs.rl loads this module (driver, train_batch) where it only submits
    from afm_core.rl.grading import Sample
    from afm_core.rollout.engine import GenerationEngine

T = TypeVar("T")

STOP_POLL_S = 0.05  # how often a generation round looks for a stop request (SIGUSR2 / preemption)


class RolloutAborted(RuntimeError):
    """A stop was requested (SIGUSR2 / preemption: :class:`afm_core.engine.preemption.Preemption`) while a
    generation round ran: its requests were aborted in vLLM and its trajectories dropped; the rollout step restarts
    on resume."""


@dataclass(frozen=True)
class RoundTarget:
    """When a partial-rollout round stops on one engine (:meth:`~afm_core.rl.rollout_actor.RolloutActor.generate`):
    once ``groups`` complete groups that ``keeps`` (the dynamic sampler's filter) accepts are graded, or ``tokens``
    tokens were sampled in the round (None: no token budget)."""

    groups: int
    keeps: Callable[[list[Sample]], bool]
    tokens: int | None = None


@dataclass
class Round:
    """What a generation round did: its ``groups`` (filled in place: finished samples graded, unfinished
    trajectories paused), whether a stop paused it (``stopped``), whether its :class:`RoundTarget` was reached,
    and its counts: trajectories ``paused`` and ``resumed``, tokens sampled (``sampled_tokens``: the model's,
    in this round only) and ``regenerated_tokens`` (rolled back at a pause and sampled again)."""

    groups: list[Group]
    stopped: bool
    target_reached: bool = False
    paused: int = 0
    resumed: int = 0
    sampled_tokens: int = 0
    regenerated_tokens: int = 0

    @classmethod
    def merge(cls, parts: Sequence[Round]) -> Round:
        """The engines' rounds as one (groups engine by engine, counts added)."""
        out = cls([g for p in parts for g in p.groups], stopped=any(p.stopped for p in parts))
        out.target_reached = any(p.target_reached for p in parts)
        for key in ("paused", "resumed", "sampled_tokens", "regenerated_tokens"):
            setattr(out, key, sum(getattr(p, key) for p in parts))
        return out


class Stopped:
    """The type of :data:`STOPPED`."""


#: What :func:`unless_stopped` returns when a stop paused the work (``keep_on_stop``).
STOPPED = Stopped()


async def unless_stopped(
    work: Awaitable[T],
    engine: GenerationEngine,
    stop_requested: Callable[[], bool],
    *,
    keep_on_stop: bool = False,
    pause_when: Callable[[], bool] | None = None,
) -> T | Stopped | None:
    """``await work``, or None when ``stop_requested()`` turns true first (then ``work`` is cancelled and the
    engine's aborted requests are settled before returning). With ``keep_on_stop`` a stop pauses the engine
    instead (its requests return what they sampled; ``work`` ends with them) and :data:`STOPPED` is returned;
    ``pause_when()`` turning true pauses it too, and ``work``'s result is returned. A paused engine is resumed
    before returning."""
    task = asyncio.ensure_future(work)
    paused = stopped = False
    try:
        while not task.done():
            if not stopped and stop_requested():
                if not keep_on_stop:
                    task.cancel()
                    await asyncio.wait({task})
                    idle = getattr(engine, "idle", None)  # engines that abort as the cancellation arrives have none
                    if idle is not None:
                        await idle()
                    return None
                stopped = True
            if not paused and (stopped or (pause_when is not None and pause_when())):
                paused = True
                await engine.pause()  # every request in flight returns its tokens so far
            await asyncio.wait({task}, timeout=STOP_POLL_S)
        result = task.result()
    finally:
        if paused:
            await engine.resume()
    return STOPPED if stopped else result
