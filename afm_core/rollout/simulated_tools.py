"""A simulated environment: a model writes each ``<observation>`` instead of the real tool (AutoCoA RL stage 1).

AutoCoA (arXiv 2503.06580, §3.3.3 "RL-Stage1: CoT + CoA (simulated environment)") first runs GRPO in an
environment simulated by the policy's own internal world model, learned in SFT stage 3 (§3.2.4: the observation
tokens trained too), then moves to the real tools (§3.3.4). Upstream AutoCoA's two RL scripts differ only there:
``RL_training/scripts/run_grpo_sequence_parallel_stage1.sh`` samples with ``rollout.mode=normal`` (no stop at a
call: the policy writes the ``<search_result>`` itself, masked in the loss by ``use_observation_mask``) and
``..._stage2.sh`` with ``rollout.mode=search`` (the retriever answers).

:class:`SimulatedTools` is a tool runner for the one agent loop (:class:`afm_core.rollout.AgentLoop`, anything with
:class:`~afm_core.rollout.agent_loop.ToolRunner`'s ``call``): for each call it prompts its engine with the
trajectory so far, token for token as the policy saw it (prompt and response ids up to and including the call's
closing tag), followed by the tokens of ``"\\n<observation>\\n"``, and samples until ``</observation>`` (kept out
of the result), ``max_tokens`` or the engine's context. The loop then appends that text exactly as it appends a
real tool's output (:func:`afm_core.coa.render_observation`, tokenized on its own, mask 0): the trainer never
trains on simulated observations, and switching to the real environment changes only the runner
(:func:`build_tool_runner`, ``rollout.environment: simulated | real``).

The engine is the policy's own (the RL job's vLLM engine, weights synced after every update) or a second model
(``rollout.simulator.model``); with a second model whose tokenizer differs, the transcript is decoded with the
policy's tokenizer and encoded with the simulator's.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from afm_core.coa.render import OBSERVATION_CLOSE, OBSERVATION_OPEN
from afm_core.data.tokenize import encode_text
from afm_core.rollout.engine import EngineError, GenerationEngine, SamplingConfig

ENVIRONMENTS = ("real", "simulated")
TRANSCRIPT_KEY = "token_ids"
"""The ``context`` key under which the agent loop passes the trajectory's ids so far to a runner that asks."""


@dataclass(frozen=True)
class SimulatorConfig:
    """Sampling of a simulated observation.

    Attributes:
        max_tokens: tokens the simulator may write per observation.
        temperature, top_p: sampling (the RL rollout's by default).
        seed: base seed; each call samples with a seed derived from it, the trajectory id and the call's position.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"rollout.simulator.max_tokens must be >= 1, got {self.max_tokens}")


class SimulatedTools:
    """A tool runner whose observations a model writes (module docstring).

    Args:
        engine: the simulator's generation engine (the policy's own, or a second model's).
        tokenizer: the simulator's tokenizer.
        config: :class:`SimulatorConfig`.
        policy_tokenizer: the policy's tokenizer when it is another one (the transcript is re-tokenized); None:
            the same tokenizer, the transcript ids are used as they are.
    """

    reads_transcript = True
    """Tells the agent loop to pass the trajectory's ids so far in ``context[TRANSCRIPT_KEY]``."""

    def __init__(
        self,
        engine: GenerationEngine,
        tokenizer: Any,
        config: SimulatorConfig = SimulatorConfig(),
        policy_tokenizer: Any = None,
    ):
        self.engine, self.tokenizer, self.config, self.policy_tokenizer = engine, tokenizer, config, policy_tokenizer
        self.open_ids = encode_text(tokenizer, f"\n{OBSERVATION_OPEN}\n")
        self._calls: dict[str, int] = {}
        self.stats = {"calls": 0, "errors": 0, "generated_tokens": 0, "truncated": 0, "seconds": 0.0}

    async def call(self, name: str, content: str, trajectory_id: str | None = None, context: Any = None) -> str:
        """The simulated observation of ``<name>content</name>``: the engine's text after ``<observation>``.

        Never raises for engine failures or a full context: those give an error observation
        ``[<name> error: simulator] ...`` as the tool pool's failures do.

        Raises:
            ValueError: ``context`` lacks the transcript (the runner is used outside the agent loop).
        """
        if not isinstance(context, Mapping) or TRANSCRIPT_KEY not in context:
            raise ValueError(f"SimulatedTools.call needs the trajectory's ids in context[{TRANSCRIPT_KEY!r}]")
        ids = list(context[TRANSCRIPT_KEY])
        if self.policy_tokenizer is not None:
            text = self.policy_tokenizer.decode(ids, skip_special_tokens=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += self.open_ids
        key = trajectory_id or ""
        position = self._calls.get(key, 0)
        self._calls[key] = position + 1
        room = min(self.config.max_tokens, self.engine.max_model_len - len(ids))
        self.stats["calls"] += 1
        if room < 1:
            self.stats["errors"] += 1
            return f"[{name} error: simulator] the simulator's context is full"
        sampling = SamplingConfig(
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            max_tokens=room,
            stop=(OBSERVATION_CLOSE,),
            seed=(zlib.crc32(f"{key}#{position}".encode()) + self.config.seed) % (2**31 - 1),
            logprobs=False,
        )
        start = time.monotonic()
        try:
            gen = await self.engine.generate(ids, sampling, f"sim-{key}-{position}")
        except EngineError as err:
            self.stats["errors"] += 1
            return f"[{name} error: simulator] {err}"
        finally:
            self.stats["seconds"] += time.monotonic() - start
        self.stats["generated_tokens"] += len(gen.token_ids)
        self.stats["truncated"] += gen.stop_reason != OBSERVATION_CLOSE
        text = gen.text
        if text.endswith(OBSERVATION_CLOSE):
            text = text[: -len(OBSERVATION_CLOSE)]
        return text.strip()

    def end_trajectory(self, trajectory_id: str) -> None:
        self._calls.pop(trajectory_id, None)

    def metrics_snapshot(self) -> dict[str, dict[str, float]]:
        """``{"simulated": {calls, errors, generated_tokens, truncated (no closing tag), seconds}}``."""
        return {"simulated": dict(self.stats)}


def build_tool_runner(
    environment: str,
    *,
    pool: Any,
    engine: GenerationEngine | None = None,
    tokenizer: Any = None,
    simulator: Mapping[str, Any] | None = None,
    policy_tokenizer: Any = None,
    temperature: float = 1.0,
) -> Any:
    """The tool runner of ``rollout.environment``: ``real`` gives ``pool`` (the real tools), ``simulated`` a
    :class:`SimulatedTools` on ``engine`` with ``simulator`` (``max_tokens``, ``temperature``, ``top_p``,
    ``seed``; other keys are ignored; a null or missing temperature is ``temperature``, the rollout's).

    Raises:
        ValueError: an unknown environment, or ``simulated`` without an engine and tokenizer.
    """
    if environment == "real":
        return pool
    if environment == "simulated":
        if engine is None or tokenizer is None:
            raise ValueError("rollout.environment=simulated needs a generation engine and its tokenizer")
        s = dict(simulator or {})
        config = SimulatorConfig(
            max_tokens=int(s.get("max_tokens", 256)),
            temperature=float(temperature if s.get("temperature") is None else s["temperature"]),
            top_p=float(s.get("top_p", 1.0)),
            seed=int(s.get("seed", 0)),
        )
        return SimulatedTools(engine, tokenizer, config, policy_tokenizer=policy_tokenizer)
    raise ValueError(f"rollout.environment={environment!r}: expected one of {', '.join(ENVIRONMENTS)}")
