"""A scripted engine for agent-loop tests: it "samples" given text segments as forced tokens.

Each ``generate`` call returns the next segment tokenized on its own (``encode_text``), the logprob
``-0.25 * (position + 1)`` per token (distinct values, so misaligned logprobs are caught), and the stop
string the segment ends with as ``stop_reason`` (``None``: an end-of-turn stop). It records the prompt ids
it was given, so tests can check what the loop fed the model.
"""

from __future__ import annotations

from afm_core.data.tokenize import encode_text
from afm_core.rollout.engine import Generation, SamplingConfig


class ReplayEngine:
    def __init__(self, tokenizer, segments: list[str], max_model_len: int = 8192) -> None:
        self.tokenizer = tokenizer
        self.segments = list(segments)
        self.max_model_len = max_model_len
        self.calls: list[tuple[list[int], Generation]] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig, request_id: str) -> Generation:
        text = self.segments[len(self.calls)] if len(self.calls) < len(self.segments) else "<answer>done</answer>"
        ids = encode_text(self.tokenizer, text)
        stop = next((s for s in sampling.stop if text.endswith(s)), None)
        finish = "stop"
        if len(ids) > sampling.max_tokens:
            ids, stop, finish = ids[: sampling.max_tokens], None, "length"
        gen = Generation(ids, [-0.25 * (i + 1) for i in range(len(ids))], text, finish, stop)
        self.calls.append((list(prompt_ids), gen))
        return gen

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
