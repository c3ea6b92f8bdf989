"""An LLM judge behind an OpenAI-compatible ``/v1/chat/completions`` endpoint (AFM's web reward and evaluation).

The prompt and the ``correct``/``incorrect`` JSON verdict follow upstream AFM's
``verl/verl/utils/reward_score/grm_simple.py`` (system message "You are an expert evaluator."; the
labelled/predicted answer prompt below; 3 attempts, 1 s apart). Unlike upstream, which scores a judge
failure as a silent 0, a failure grades ``judge_error`` with ``error=True`` and is counted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from afm_core.rewards.base import Grade, extract_answer
from afm_core.utils.openai_api import EndpointError, auth_headers, endpoint, post_json

JUDGE_SYSTEM = "You are an expert evaluator."
JUDGE_PROMPT = """Please determine if the predicted answer is equivalent to the labeled answer. 
Question:  {question} 
Labeled Answer:  {gt_answer} 
Predicted Answer: {pred_answer}  

**Rules**:
If the prediction and answer are semantically equivalent despite the expression order, the description format, \
and the use of measurement units and the order, then your judgement will be correct.
{{  
"rationale": "your rationale for the judgement, as a text", 
"judgement": "your judgement result, can only be 'correct' or 'incorrect' 
}}"""

_JSON_RE = re.compile(r"\{.*\}", re.DOTALL)


def parse_verdict(text: str) -> tuple[bool, str]:
    """``(correct, rationale)`` from the judge's reply: the JSON object's ``judgement`` field, else a bare word.

    Raises:
        ValueError: no verdict in the reply.
    """
    match = _JSON_RE.search(text)
    if match:
        try:
            data = json.loads(match.group(0))
            verdict = str(data.get("judgement", "")).strip().lower()
            if verdict in ("correct", "incorrect"):
                return verdict == "correct", str(data.get("rationale", ""))
        except json.JSONDecodeError:
            pass
    found = re.findall(r"\b(incorrect|correct)\b", text.lower())
    if found:
        return found[-1] == "correct", text[:300]
    raise ValueError(f"no verdict in the judge's reply: {text[:200]!r}")


@dataclass
class ChatEndpoint:
    """An OpenAI-compatible ``/v1/chat/completions`` endpoint and the HTTP session to it: what the LLM judge and
    the distillation teachers (:class:`afm_core.distill.teacher.ChatEndpointTeacher`) share.

    Requests go through :func:`afm_core.utils.openai_api.post_json` (retries on HTTP 429/5xx, a dropped
    connection, a timeout or a reply that is not JSON, with exponential backoff from 0.5 s).

    Args:
        url: base URL of an OpenAI-compatible server (with or without the trailing ``/v1``).
        model: the served model name.
        api_key_env: environment variable holding the API key (None: no key).
        timeout_s: seconds per request.
    """

    url: str
    model: str
    api_key_env: str | None = None
    timeout_s: float = 120.0
    _session: aiohttp.ClientSession | None = field(default=None, repr=False, kw_only=True)

    @property
    def chat_url(self) -> str:
        return endpoint(self.url, "chat/completions")

    async def chat_completion(self, messages: Sequence[Mapping[str, str]], *, retries: int,
                              headers: Mapping[str, str] | None = None, **sampling: Any) -> Any:  # fmt: skip
        """POST ``{"model", "messages", **sampling}`` (the session opened at the first call) with ``headers`` and the
        API key's; the decoded JSON reply.

        Raises:
            afm_core.utils.openai_api.EndpointError: a status not worth retrying, or every attempt failed.
        """
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        body = {"model": self.model, "messages": [dict(m) for m in messages], **sampling}
        return await post_json(self._session, self.chat_url, body, {**(headers or {}), **auth_headers(self.api_key_env)},
                               retries=retries)  # fmt: skip

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


@dataclass
class LLMJudge(ChatEndpoint):
    """Grades an answer against the labelled answer with an LLM (:class:`ChatEndpoint`: ``url``, ``model``,
    ``api_key_env``, ``timeout_s``).

    Args:
        attempts: tries per question (upstream: 3).
        temperature: the judge's sampling temperature.
    """

    attempts: int = 3
    temperature: float = 0.0
    failures: int = 0

    async def judge(self, question: str, gold: str, prediction: str) -> Grade:
        """``correct`` (1.0) / ``wrong`` (0.0); a request that fails for good, or a reply without a verdict, gives
        ``judge_error`` with ``error=True`` (counted in :attr:`failures`)."""
        messages = [
            {"role": "system", "content": JUDGE_SYSTEM},
            {"role": "user", "content": JUDGE_PROMPT.format(question=question, gt_answer=gold, pred_answer=prediction)},
        ]
        try:
            reply = await self.chat_completion(messages, retries=self.attempts - 1, temperature=self.temperature)
            correct, rationale = parse_verdict(reply["choices"][0]["message"]["content"])
        except (EndpointError, KeyError, IndexError, TypeError, ValueError) as e:
            self.failures += 1
            return Grade(0.0, "judge_error", error=True, extra={"message": f"{e.__class__.__name__}: {e}"[:300]})
        return Grade(float(correct), "correct" if correct else "wrong", extra={"rationale": rationale[:300]})

    async def grade(self, response: str, question: str, gold: str) -> Grade:
        """Judge the last ``<answer>`` of a CoA response (``no_answer`` without calling the judge)."""
        answer = extract_answer(response)
        if answer is None or not answer.strip():
            return Grade(0.0, "no_answer")
        return await self.judge(question, gold, answer)
