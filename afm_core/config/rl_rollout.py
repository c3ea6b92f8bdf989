"""The rollout side's groups of ``conf/rl.yaml``: ``data`` (the prompts), ``rollout`` (sampling, turns, tool
calls, the staged context length, partial rollouts, the simulated environment), ``reward``, ``judge``,
``colocation`` and ``tool_servers``, each with its own range checks, and :func:`check_context_length` (the
rollout's longest context against the model's positions), which :class:`afm_core.config.rl.RLConfig` runs with its
other checks across groups. Read at run time by :mod:`afm_core.rl.prompts`, :mod:`afm_core.rl.rollout_actor`
(:class:`afm_core.config.rl.ActorConfig`), :mod:`afm_core.rl.train_batch`, :mod:`afm_core.rl.rollout_buffer`,
:mod:`afm_core.rl.reward_shaping` and :mod:`afm_core.rl.colocation`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from afm_core.config.checks import at_least_one, positive, require
from afm_core.rollout.simulated_tools import ENVIRONMENTS

REWARD_MODES = ("score_x_format", "score", "score_minus_format_penalty")  # reward.mode: afm_core.rl.reward_shaping
TOOL_SERVER_START = ("auto", "always", "never")  # afm_core.tools.job_servers
COLOCATION_MODES = ("auto", "inprocess", "async")  # colocation.mode: afm_core.rl.colocation


@dataclass
class RLDataConfig:
    presets: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    skip: int = 0
    limit: int | None = None
    max_calculator_steps: int | None = None
    max_prompt_len: int = 1024

    def __post_init__(self) -> None:
        require(self.skip >= 0, "data.skip", self.skip, "an integer >= 0")
        if self.limit is not None:
            at_least_one("data.limit", self.limit)
        at_least_one("data.max_prompt_len", self.max_prompt_len)


@dataclass
class SimulatorConfig:
    model: str | None = None
    max_tokens: int = 256
    temperature: float | None = None

    def __post_init__(self) -> None:
        at_least_one("rollout.simulator.max_tokens", self.max_tokens)
        if self.temperature is not None:
            require(self.temperature >= 0, "rollout.simulator.temperature", self.temperature, ">= 0, or null")


STALE_ACTIONS = ("mask", "drop")  # rollout.partial.stale: afm_core.rl.rollout_buffer
STOP_ACTIONS = ("keep", "restart")  # rollout.partial.on_stop: afm_core.rl.train_batch


@dataclass
class PartialConfig:
    """``rollout.partial``: partial rollouts, the staleness bound and what a stop during generation keeps
    (:mod:`afm_core.rl.rollout_buffer`, :mod:`afm_core.rl.train_batch`).

    Attributes:
        enable: a generation round stops once the dynamic sampler can fill the train batch (or
            ``max_tokens_per_step`` is spent); its unfinished trajectories are paused into the rollout buffer and
            continued first, oldest first, in the next rollout step under the new weights.
        max_staleness: the largest lag (policy versions between a token's sampling and its training) allowed.
        stale: what happens past it: ``mask`` (the token leaves the loss) or ``drop`` (the trajectory is
            regenerated from its prompt when it would be resumed).
        max_tokens_per_step: a round also stops once this many tokens were sampled in the rollout step (per
            engine); None: no token budget.
        on_stop: a stop (USR2, preemption) during generation: ``keep`` (the round's finished groups go to the
            sampler, its trajectories in flight are paused into the buffer, both saved in the checkpoint and
            continued on resume) or ``restart`` (the round is thrown away and the state from before it saved:
            a resumed run is bitwise the uninterrupted one; for tests and debugging). With
            ``rollout.environment=simulated`` a stop restarts the round (the simulated observations come from the
            policy's own engine, which a pause would cut short).
    """

    enable: bool = False
    max_staleness: int = 1
    stale: str = "mask"
    max_tokens_per_step: int | None = None
    on_stop: str = "keep"

    def __post_init__(self) -> None:
        p = "rollout.partial."
        require(self.max_staleness >= 0, p + "max_staleness", self.max_staleness, "an integer >= 0")
        require(self.stale in STALE_ACTIONS, p + "stale", self.stale, "mask or drop")
        require(self.on_stop in STOP_ACTIONS, p + "on_stop", self.on_stop, "keep or restart")
        if self.max_tokens_per_step is not None:
            at_least_one(p + "max_tokens_per_step", self.max_tokens_per_step)


@dataclass
class ContextStage:
    max_response_len: int = MISSING
    until_step: int | None = None


@dataclass
class RolloutConfig:
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_len: int = 4096
    context_schedule: list[ContextStage] = field(default_factory=list)
    max_turns: int = 16
    max_tool_calls: int = 8
    timeout_s: float = 600
    concurrency: int = 64
    environment: str = "real"
    simulator: SimulatorConfig = field(default_factory=SimulatorConfig)
    partial: PartialConfig = field(default_factory=PartialConfig)

    def __post_init__(self) -> None:
        for key in ("n", "max_response_len", "max_turns", "concurrency"):
            at_least_one(f"rollout.{key}", getattr(self, key))
        require(self.max_tool_calls >= 0, "rollout.max_tool_calls", self.max_tool_calls, "an integer >= 0")
        require(self.temperature >= 0, "rollout.temperature", self.temperature, ">= 0")
        require(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "in (0, 1]")
        require(self.top_k == -1 or self.top_k >= 1, "rollout.top_k", self.top_k, "-1 (off) or >= 1")
        positive("rollout.timeout_s", self.timeout_s)
        require(self.environment in ENVIRONMENTS, "rollout.environment", self.environment, "real or simulated")
        last = 0  # a stage runs for the rollout steps from the previous stage's until_step to its own (exclusive)
        for i, stage in enumerate(self.context_schedule):
            key = f"rollout.context_schedule[{i}]"
            at_least_one(f"{key}.max_response_len", stage.max_response_len)
            if stage.until_step is not None:
                valid = f"increasing: above the previous stage's ({last})" if i else "an integer >= 1"
                require(stage.until_step > last, f"{key}.until_step", stage.until_step, valid)
                last = stage.until_step
            else:
                require(i == len(self.context_schedule) - 1, f"{key}.until_step", None, "only the last stage has none")

    @property
    def longest_response(self) -> int:
        """The largest stage's ``max_response_len`` (tokens): ``max_response_len`` is the only stage when the
        schedule is empty, and unused otherwise (as ``afm_core.rl.schedule.build_stages`` reads them)."""
        return (
            max(s.max_response_len for s in self.context_schedule) if self.context_schedule else self.max_response_len
        )


@dataclass
class RewardConfig:
    mode: str = "score_x_format"
    format_penalty: float = 1.0
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    test_timeout_s: float = 10

    def __post_init__(self) -> None:
        require(self.mode in REWARD_MODES, "reward.mode", self.mode, f"one of {', '.join(REWARD_MODES)}")
        require(self.format_penalty >= 0, "reward.format_penalty", self.format_penalty, ">= 0")
        require(self.overlong_buffer_len >= 0, "reward.overlong_buffer_len", self.overlong_buffer_len, ">= 0 tokens")
        require(
            self.overlong_penalty_factor >= 0, "reward.overlong_penalty_factor", self.overlong_penalty_factor, ">= 0"
        )
        positive("reward.test_timeout_s", self.test_timeout_s)


@dataclass
class ColocationConfig:
    mode: str = "auto"
    sleep_level: int = 1
    offload_trainer: bool | None = None

    def __post_init__(self) -> None:
        require(self.mode in COLOCATION_MODES, "colocation.mode", self.mode, f"one of {', '.join(COLOCATION_MODES)}")
        require(self.sleep_level in (0, 1, 2), "colocation.sleep_level", self.sleep_level, "0, 1 or 2")


@dataclass
class JudgeConfig:
    url: str | None = None
    model: str | None = None
    api_key_env: str | None = None

    def __post_init__(self) -> None:
        require(
            self.url is None or bool(self.model), "judge.model", self.model, "the judge's model name (judge.url is set)"
        )


@dataclass
class ToolServersConfig:
    start: str = "auto"
    wait_s: float = 0
    servers: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(self.start in TOOL_SERVER_START, "tool_servers.start", self.start, "auto, always or never")
        require(self.wait_s >= 0, "tool_servers.wait_s", self.wait_s, "seconds >= 0")


def check_context_length(model: Any, max_prompt_len: int, longest_response: int) -> None:
    """The rollout engine's context, ``data.max_prompt_len`` + the largest stage's ``max_response_len`` (vLLM's
    ``max_model_len``), must fit the model's positions: vLLM refuses a longer ``max_model_len`` at start, after the
    queue (it allows more only with RoPE scaling such as YaRN, which the Megatron conversion does not reproduce:
    :func:`afm_core.models.arch.hf_rope_scaling`).

    Raises:
        ConfigError: naming the three numbers and what to lower.
    """
    limit = int(model.max_position_embeddings)
    total = max_prompt_len + longest_response
    require(
        total <= limit,
        "rollout.max_response_len",
        longest_response,
        f"data.max_prompt_len + the largest stage's max_response_len = {max_prompt_len} + {longest_response} = "
        f"{total} tokens (vLLM max_model_len) > model.max_position_embeddings = {limit} of {model.name}; lower "
        f"rollout.max_response_len / rollout.context_schedule to at most {limit - max_prompt_len} or "
        f"data.max_prompt_len",
    )
