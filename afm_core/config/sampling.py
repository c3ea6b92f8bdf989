"""``eval``'s sampling settings (:class:`SamplingConfig`): the eval job's (``conf/eval.yaml``, ``jobs.filter_rl``,
``afm_core.config.eval``) and RL validation's (``val``, ``afm_core.config.rl.ValConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from afm_core.config.checks import at_least_one, require


@dataclass
class SamplingConfig:
    """``eval``: samples per problem and the agent loop's budgets."""

    k: int = 4
    limit: int | None = None
    temperature: float = 0.8
    seed: int = 0
    top_p: float = 1.0
    max_response_tokens: int = 4096
    max_tool_calls: int = 12
    max_turns: int = 16
    timeout_s: float = 900
    concurrency: int = 64
    test_timeout_s: float = 10
    per_benchmark: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("k", "max_response_tokens", "max_turns", "concurrency"):
            at_least_one(f"eval.{key}", getattr(self, key))
        if self.limit is not None:
            at_least_one("eval.limit", self.limit)
        require(self.max_tool_calls >= 0, "eval.max_tool_calls", self.max_tool_calls, "an integer >= 0")
        require(self.temperature >= 0, "eval.temperature", self.temperature, ">= 0")
        require(0 < self.top_p <= 1, "eval.top_p", self.top_p, "in (0, 1]")
        for key in ("timeout_s", "test_timeout_s"):
            require(getattr(self, key) > 0, f"eval.{key}", getattr(self, key), "seconds > 0")
