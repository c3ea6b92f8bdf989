"""A teacher: one chat model that the multi-agent system's roles talk to, behind one interface.

:class:`Teacher` has one method, ``chat(messages, sampling) -> ChatReply``. Two backends implement it:

- :class:`ChatEndpointTeacher`: any OpenAI-compatible ``/v1/chat/completions`` endpoint over aiohttp (a
  ``vllm serve`` URL, a hosted API with its key in an environment variable, a local test server);
- :class:`EngineTeacher`: the job's own generation engine (vLLM in-process, or a ``/v1/completions`` server:
  :mod:`afm_core.rollout.engine`), with the messages rendered by the model's chat template
  (``tokenizer.apply_chat_template(..., add_generation_prompt=True)``) and the sampled ids decoded; the same
  token-in/token-out path the agent loop uses, so no second engine is started.

Config: ``teachers.<name>`` in ``conf/distill.yaml``, :class:`afm_core.config.eval.TeacherConfig` (``backend``;
``url``, ``model``, ``api_key_env``, ``timeout_s``, ``retries`` for ``chat``; the default sampling; ``concurrency``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from afm_core.config.eval import TeacherConfig
from afm_core.rewards.judge import ChatEndpoint
from afm_core.rollout.engine import EngineError, GenerationEngine, SamplingConfig
from afm_core.utils.openai_api import EndpointError

Message = Mapping[str, str]


@dataclass(frozen=True)
class ChatSampling:
    """Sampling of one chat call: temperature, nucleus mass, at most ``max_tokens`` tokens, a per-request seed."""

    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None


@dataclass
class ChatReply:
    """What a teacher answered.

    Attributes:
        text: the assistant message (special tokens removed), "" when the call failed.
        finish_reason: ``stop``, ``length`` or ``error``.
        prompt_tokens, completion_tokens: token counts (as the server reports them; None when it does not).
        seconds: wall-clock seconds of the call, retries included.
        error: the failure message when ``finish_reason`` is ``error``.
    """

    text: str
    finish_reason: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    seconds: float = 0.0
    error: str | None = None


class Teacher(Protocol):
    """A chat model. ``chat`` never raises for a failed request: the reply has ``finish_reason="error"``."""

    name: str

    async def chat(self, messages: Sequence[Message], sampling: ChatSampling, request_id: str) -> ChatReply: ...

    async def close(self) -> None: ...


@dataclass
class ChatEndpointTeacher(ChatEndpoint):
    """An OpenAI-compatible chat-completions endpoint (:class:`afm_core.rewards.judge.ChatEndpoint`: ``url``,
    ``model``, ``api_key_env``, ``timeout_s``, the session), as the LLM judge's.

    Args:
        name: the teacher's name in the config (keyword).
        concurrency: requests in flight at once.
        retries: further attempts after HTTP 429/5xx or a connection error (exponential backoff from 0.5 s).
    """

    timeout_s: float = 300.0
    name: str = field(kw_only=True)
    concurrency: int = 16
    retries: int = 3
    _slots: asyncio.Semaphore | None = field(default=None, repr=False, kw_only=True)

    async def chat(self, messages: Sequence[Message], sampling: ChatSampling, request_id: str) -> ChatReply:
        """POST the messages; retries on 429/5xx and connection errors; never raises for a failed request."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        params: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                  "max_tokens": sampling.max_tokens}  # fmt: skip
        if sampling.seed is not None:
            params["seed"] = sampling.seed
        started = time.monotonic()
        async with self._slots:
            try:
                payload = await self.chat_completion(messages, retries=self.retries,
                                                     headers={"X-Request-Id": request_id}, **params)  # fmt: skip
            except EndpointError as e:
                return ChatReply("", "error", seconds=time.monotonic() - started, error=str(e))
        return self._reply(payload, time.monotonic() - started)

    def _reply(self, payload: Any, seconds: float) -> ChatReply:
        try:
            choice = payload["choices"][0]
            text = choice["message"].get("content") or ""
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            error = f"{self.chat_url}: malformed chat completion ({e.__class__.__name__}: {e})"
            return ChatReply("", "error", seconds=seconds, error=error)
        usage = payload.get("usage") or {}
        return ChatReply(text, choice.get("finish_reason") or "stop", usage.get("prompt_tokens"),
                         usage.get("completion_tokens"), seconds)  # fmt: skip


@dataclass
class EngineTeacher:
    """The job's generation engine as a chat model: chat template in, sampled ids decoded out.

    Args:
        name: the teacher's name in the config.
        engine: a started :class:`~afm_core.rollout.engine.GenerationEngine` (shared with nothing else here).
        tokenizer: the engine model's HF tokenizer (its chat template renders the messages).
        concurrency: requests in flight at once (vLLM batches them).
    """

    name: str
    engine: GenerationEngine
    tokenizer: Any
    concurrency: int = 64
    _slots: asyncio.Semaphore | None = field(default=None, repr=False)
    _ids: Any = field(default_factory=itertools.count, repr=False)

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The chat-template ids of ``messages`` up to the assistant turn (as :func:`afm_core.data.tokenize.encode_prompt`)."""
        text = self.tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True,
                                                  tokenize=False)  # fmt: skip
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def chat(self, messages: Sequence[Message], sampling: ChatSampling, request_id: str) -> ChatReply:
        """One engine generation; a prompt longer than the engine's context, or an engine error, is an error reply."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        started = time.monotonic()
        ids = self.prompt_ids(messages)
        budget = min(sampling.max_tokens, self.engine.max_model_len - len(ids))
        if budget < 1:
            error = (
                f"prompt of {len(ids)} tokens leaves no room in the engine's {self.engine.max_model_len}-token context"
            )
            return ChatReply("", "error", len(ids), 0, time.monotonic() - started, error)
        params = SamplingConfig(temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=budget,
                                seed=sampling.seed, logprobs=False)  # fmt: skip
        try:
            async with self._slots:
                gen = await self.engine.generate(ids, params, f"{request_id}#{next(self._ids)}")
        except EngineError as e:
            return ChatReply("", "error", len(ids), 0, time.monotonic() - started, str(e))
        text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        finish = "length" if gen.finish_reason == "length" else "stop"
        return ChatReply(text, finish, len(ids), len(gen.token_ids), time.monotonic() - started)

    async def close(self) -> None:
        """The engine belongs to the job; it is closed there."""


def build_teacher(name: str, spec: TeacherConfig, engine: GenerationEngine | None, tokenizer: Any) -> Teacher:
    """The :class:`Teacher` of ``teachers.<name>`` (checked by :class:`afm_core.config.eval.DistillConfig`);
    ``engine`` for ``backend=engine``. ``concurrency`` null: 16 requests in flight to an endpoint, 64 to the engine
    (vLLM batches them).

    Raises:
        ValueError: ``backend=engine`` without an engine.
    """
    if spec.backend == "chat":
        assert spec.url and spec.model  # DistillConfig requires both for backend=chat
        return ChatEndpointTeacher(spec.url, spec.model, spec.api_key_env, spec.timeout_s, name=name,
                                   concurrency=spec.concurrency or 16, retries=spec.retries)  # fmt: skip
    if engine is None:
        raise ValueError(f"teachers.{name}: backend=engine needs the job's engine (engine section)")
    return EngineTeacher(name, engine, tokenizer, concurrency=spec.concurrency or 64)


def teacher_sampling(
    spec: TeacherConfig, *, temperature: float | None = None, max_tokens: int | None = None
) -> ChatSampling:
    """A teacher's :class:`ChatSampling`, with a role's own ``temperature`` / ``max_tokens`` where not None."""
    return ChatSampling(temperature=spec.temperature if temperature is None else temperature, top_p=spec.top_p,
                        max_tokens=spec.max_tokens if max_tokens is None else max_tokens)  # fmt: skip
