"""A scripted engine for agent-loop tests: it "samples" given text segments as forced tokens.

Each ``generate`` call returns the next segment tokenized on its own (``encode_text``), the logprob
``-0.25 * (position + 1)`` per token (distinct values, so misaligned logprobs are caught), and the stop
string the segment ends with as ``stop_reason`` (``None``: an end-of-turn stop). It records the prompt ids
it was given, so tests can check what the loop fed the model.

Pauses: ``pause_after={call: k}`` has call ``call`` (0-based, over all calls) return only its first ``k`` tokens
with ``finish_reason="abort"`` and ``paused`` set, as if :meth:`pause` had come while it sampled; the engine is
then paused (a new ``generate`` returns the empty paused abort) until :meth:`resume`. The next call after that
continues the interrupted segment from the segment tokens its prompt ends with (so a continuation after tokens
were rolled back samples them again), and, as vLLM does, finds a stop string in ITS OWN text only.
"""

from __future__ import annotations

from afm_core.data.tokenize import encode_text
from afm_core.rollout.engine import Generation, SamplingConfig


class ReplayEngine:
    def __init__(
        self, tokenizer, segments: list[str], max_model_len: int = 8192, pause_after: dict[int, int] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.segments = list(segments)
        self.max_model_len = max_model_len
        self.pause_after = dict(pause_after or {})
        self.paused = False
        self.calls: list[tuple[list[int], Generation]] = []
        self._next = 0  # the next segment
        self._open: str | None = None  # the segment a pause interrupted
        self._segment = ""  # the segment of the last call

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig, request_id: str) -> Generation:
        if self.paused:
            gen = Generation.refused_while_paused()
            self.calls.append((list(prompt_ids), gen))
            return gen
        if self._open is not None:  # continue the interrupted segment after the tokens the prompt ends with
            self._segment, self._open = self._open, None
            segment = encode_text(self.tokenizer, self._segment)
            start = max(m for m in range(len(segment) + 1) if m == 0 or prompt_ids[-m:] == segment[:m])
            ids = segment[start:]
            text = self.tokenizer.decode(ids)  # vLLM searches this call's own text for stop strings
        else:
            text = self.segments[self._next] if self._next < len(self.segments) else "<answer>done</answer>"
            self._next += 1
            self._segment, ids, start = text, encode_text(self.tokenizer, text), 0
        stop = next((s for s in sampling.stop if text.endswith(s)), None)
        finish, paused = "stop", False
        if len(self.calls) in self.pause_after:
            self._open = self._segment
            ids, stop, finish, paused = ids[: self.pause_after[len(self.calls)]], None, "abort", True
            text, self.paused = self.tokenizer.decode(ids), True
        elif len(ids) > sampling.max_tokens:
            ids, stop, finish = ids[: sampling.max_tokens], None, "length"
        logprobs = [-0.25 * (start + i + 1) for i in range(len(ids))]  # by position in the segment
        gen = Generation(ids, logprobs, text, finish, stop, paused=paused)
        self.calls.append((list(prompt_ids), gen))
        return gen

    async def pause(self) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False

    async def close(self) -> None:
        pass


class RecordedTools:
    """A tool runner that answers each call with the next recorded observation (no servers)."""

    def __init__(self, observations: list[str]) -> None:
        self.observations = list(observations)
        self.calls: list[tuple[str, str]] = []

    async def call(self, name, content, trajectory_id=None, context=None) -> str:
        self.calls.append((name, content))
        return self.observations[len(self.calls) - 1]

    def end_trajectory(self, trajectory_id: str) -> None:
        pass
