"""Any OpenAI-compatible ``/v1/completions`` server as the generation engine (e.g. ``vllm serve``).

Token-in/token-out where the server allows it: the prompt is sent as a list of token ids (the OpenAI
completions API accepts ``prompt`` as an array of integers), and vLLM's ``return_tokens_as_token_ids``
extension returns each sampled token as ``"token_id:<id>"`` in ``logprobs.tokens``, with its logprob in
``logprobs.token_logprobs``. A server that ignores the extension returns token strings; their ids are then
looked up in the vocabulary, and only when that fails is the completion text tokenized (the result is
marked ``extra["retokenized"] = True`` so an RL trainer can reject it).

The completions API cannot interrupt a request and hand back its tokens so far, so this engine pauses at turn
boundaries: :meth:`RemoteEngine.pause` lets the requests in flight finish and refuses new ones until
:meth:`RemoteEngine.resume`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp

from afm_core.rollout.engine import EngineError, Generation, InFlight, SamplingConfig
from afm_core.utils.openai_api import EndpointError, auth_headers, endpoint, post_json


@dataclass
class RemoteEngine:
    """Client of an OpenAI-compatible completions server.

    Args:
        url: the server's base URL (``http://host:8000`` or ``http://host:8000/v1``).
        model: the served model name.
        tokenizer: the model's tokenizer (to map token strings back to ids when a server returns strings).
        max_model_len: the server's context length in tokens.
        api_key_env: environment variable with the API key (None: none).
        timeout_s: seconds per request.
        retries: attempts after a connection error or HTTP 429/5xx.
    """

    url: str
    model: str
    tokenizer: Any
    max_model_len: int = 4096
    api_key_env: str | None = None
    timeout_s: float = 600.0
    retries: int = 3
    _session: aiohttp.ClientSession | None = field(default=None, repr=False)
    _paused: bool = field(default=False, repr=False)
    _calls: InFlight = field(default_factory=InFlight, repr=False)

    @property
    def endpoint(self) -> str:
        return endpoint(self.url, "completions")

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig, request_id: str) -> Generation:
        """One completion of ``prompt_ids`` (see :class:`~afm_core.rollout.engine.GenerationEngine`).

        Raises:
            EngineError: the server was unreachable, or answered with an error after the retries.
        """
        if self._paused:
            return Generation.refused_while_paused()
        with self._calls:
            return await self._generate(prompt_ids, sampling, request_id)

    async def pause(self) -> None:
        """Pause at turn boundaries: return once the requests in flight have completed (normally: they are not
        interrupted); until :meth:`resume` a new ``generate`` returns
        :meth:`~afm_core.rollout.engine.Generation.refused_while_paused` at once."""
        self._paused = True
        await self._calls.drained()

    async def resume(self) -> None:
        """Undo :meth:`pause`."""
        self._paused = False

    async def _generate(self, prompt_ids: list[int], sampling: SamplingConfig, request_id: str) -> Generation:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stop": list(sampling.stop) or None,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "logprobs": 1 if sampling.logprobs else None,
            "return_tokens_as_token_ids": True,
        }
        if sampling.top_k > 0:
            body["top_k"] = sampling.top_k
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        headers = {"X-Request-Id": request_id, **auth_headers(self.api_key_env)}
        try:
            payload = await post_json(self._session, self.endpoint, body, headers, retries=self.retries)
        except EndpointError as e:
            raise EngineError(str(e)) from e
        return self._generation(payload)

    def _generation(self, payload: dict[str, Any]) -> Generation:
        try:
            choice = payload["choices"][0]
        except (KeyError, IndexError, TypeError) as e:
            raise EngineError(f"{self.endpoint}: malformed completion response ({e.__class__.__name__}: {e})") from e
        text = choice.get("text") or ""
        logprobs_obj = choice.get("logprobs") or {}
        tokens = logprobs_obj.get("tokens") or []
        token_logprobs = logprobs_obj.get("token_logprobs")
        found: list[int] = []
        ids: list[int] | None = found
        for token in tokens:
            if isinstance(token, str) and token.startswith("token_id:"):
                found.append(int(token.split(":", 1)[1]))
            else:
                token_id = self.tokenizer.convert_tokens_to_ids(token)
                if not isinstance(token_id, int) or token_id == self.tokenizer.unk_token_id:
                    ids = None
                    break
                found.append(token_id)
        extra: dict[str, Any] = {}
        if not tokens or ids is None:
            ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            token_logprobs = None
            extra["retokenized"] = True
        stop_reason = choice.get("stop_reason")
        return Generation(
            token_ids=list(ids),
            logprobs=[float(x) for x in token_logprobs] if token_logprobs and len(token_logprobs) == len(ids) else None,
            text=text,
            finish_reason=choice.get("finish_reason") or "stop",
            stop_reason=stop_reason if isinstance(stop_reason, str) else None,
            extra=extra,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
