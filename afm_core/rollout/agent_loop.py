"""The one agent loop: a CoA trajectory generated turn by turn, with real tool calls in between.

Shared by evaluation (``jobs.eval``), RL rollouts and distillation. Per trajectory (an ``asyncio`` task):

1. generate from ``prompt_ids + response_ids`` until a tool's closing tag or ``</answer>`` (stop strings,
   kept in the output: :func:`afm_core.coa.stop_strings`);
2. parse the calls in the new segment (:func:`afm_core.coa.parse_tool_calls`) and run them concurrently
   through :class:`~afm_core.tools.ToolPool` (which never raises: a failed call is an error observation);
3. append the observation in the canonical layout (:func:`afm_core.coa.render_observation`), tokenized on
   its own (:func:`afm_core.data.tokenize.encode_text`), with mask 0;
4. continue until an answer, the model's end of turn, ``max_turns``, the response-token budget, or the
   per-trajectory timeout.

Token-in/token-out: the sampled ids and their logprobs are kept as sampled; model text is never
re-tokenized. SFT tokenizes a trajectory the same way, segment by segment
(:func:`afm_core.data.tokenize.tokenize_sft_example`), so a model meets the same ids in RL as in SFT.
This follows the multi-turn rollout of upstream AFM's verl fork (``verl/workers/rollout`` tool agent:
stop at a tool's closing tag, call, append ``\\n<observation>…</observation>\\n\\n``, generate on) and
slime's token-level ``Sample`` contract.

One module, past 400 lines: the turns, tool calls, limits and pauses all act on one private per-trajectory state
(``_State``, carried into and out of a :class:`~afm_core.rollout.types.PausedTrajectory`), which a split would
have to expose.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from tqdm import tqdm

from afm_core.coa import TOOL_TAGS, TagGrammarError, Trajectory, parse_steps, parse_tool_calls, stop_strings
from afm_core.coa.grammar import validate_text
from afm_core.coa.parse import ToolCall
from afm_core.coa.prompts import TASK_TOOLS, TASKS
from afm_core.coa.render import render_observation
from afm_core.data.tokenize import encode_prompt, encode_text, end_of_turn_ids
from afm_core.rollout.engine import EngineError, Generation, GenerationEngine, SamplingConfig
from afm_core.rollout.types import AgentTask, FinishReason, PausedTrajectory, Rollout, ToolCallRecord

# The pool's error observations start "[<tool> error: <kind>]" (afm_core.tools.pool.error_observation).
_ERROR_OBSERVATION_RE = re.compile(r"^\[(?P<tool>\w+) error: (?P<kind>\w+)\]")


def observation_error_kind(observation: str) -> str | None:
    """The error kind of an error observation written by the tool pool, or None for a normal observation."""
    match = _ERROR_OBSERVATION_RE.match(observation)
    return match.group("kind") if match else None


def call_limit_observation(tool: str, max_tool_calls: int, last_turn: bool) -> str:
    """The observation of a tool call past ``max_tool_calls`` (not run). Before the last turn the model may still
    answer, and is told to; on the last turn (:func:`turn_limit_note` follows) no answer turn is left to ask for."""
    then = "" if last_turn else "; give your final answer now"
    return f"[{tool} error: call_limit] the limit of {max_tool_calls} tool calls is reached{then}"


def turn_limit_note(max_turns: int) -> str:
    """The last line of the observation after a tool call on the last of ``max_turns`` generation calls: the
    trajectory ends there, without an answer turn (finish reason ``max_turns``)."""
    return f"[turn_limit] the last of {max_turns} turns is spent: the trajectory ends without an answer"


@dataclass(frozen=True)
class AgentConfig:
    """Limits of one trajectory.

    Attributes:
        max_turns: generation calls per trajectory; after a tool call on the last one the observation ends
            with :func:`turn_limit_note` and the trajectory with finish reason ``max_turns``.
        max_tool_calls: tool calls per trajectory (the paper's evaluation allows 12); a call past the limit
            is not run: its observation says so (:func:`call_limit_observation`), and the model may still
            answer when a turn is left.
        max_response_tokens: tokens after the prompt (model + observation tokens), the RL ``max_response_len``.
        timeout_s: wall-clock seconds per trajectory (None: no limit).
        tools: the tools the model may call (their closing tags are stop strings); None: the task family's
            tools (:data:`afm_core.coa.prompts.TASK_TOOLS`).
    """

    max_turns: int = 16
    max_tool_calls: int = 12
    max_response_tokens: int = 4096
    timeout_s: float | None = 600.0
    tools: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_response_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"agent.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tool_calls < 0:
            raise ValueError(f"agent.max_tool_calls must be >= 0, got {self.max_tool_calls}")
        unknown = set(self.tools or ()) - set(TOOL_TAGS)
        if unknown:
            raise ValueError(f"agent.tools: unknown tools {sorted(unknown)}; known: {', '.join(TOOL_TAGS)}")


@dataclass
class _State:
    prompt_ids: list[int]
    version: int = 0  # the policy version of the tokens sampled from here on
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    turns: int = 0
    finish: FinishReason | None = None
    error: str | None = None
    # the turn a pause interrupted: its kept ids, their logprobs and versions (empty between turns)
    turn_ids: list[int] = field(default_factory=list)
    turn_logprobs: list[float] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    rolled_back: int = 0
    pauses: int = 0

    def add(
        self,
        ids: Sequence[int],
        sampled: bool,
        logprobs: Sequence[float] | None,
        text: str,
        versions: Sequence[int] | None = None,
    ) -> None:
        self.response_ids += ids
        self.response_mask += [1 if sampled else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.versions += list(versions) if versions is not None else [self.version] * len(ids)
        self.text_parts.append(text)

    @classmethod
    def resumed(cls, paused: PausedTrajectory, version: int) -> _State:
        """The state of a paused trajectory, to continue with policy ``version``."""
        return cls(version=version, rolled_back=paused.rolled_back_tokens, **_carried(paused))

    def paused(self, task_id: str, sample: int, base_seed: int, seconds: float) -> PausedTrajectory:
        """This state as a :class:`~afm_core.rollout.types.PausedTrajectory` (copied: the state may go on)."""
        return PausedTrajectory(task_id=task_id, sample=sample, base_seed=base_seed, seconds=seconds,
                                rolled_back_tokens=self.rolled_back, **_carried(self))  # fmt: skip


#: The fields a pause carries from a trajectory's :class:`_State` into its ``PausedTrajectory`` and back (lists).
_CARRIED_LISTS = ("prompt_ids", "response_ids", "response_mask", "logprobs", "versions", "text_parts", "turn_ids",
                  "turn_logprobs", "turn_versions")  # fmt: skip


def _carried(source: _State | PausedTrajectory) -> dict[str, Any]:
    """The fields :class:`_State` and ``PausedTrajectory`` share, copied from ``source`` (lists, tool calls,
    turns and pauses: the rolled-back count is named differently in each)."""
    out: dict[str, Any] = {name: list(getattr(source, name)) for name in _CARRIED_LISTS}
    out.update(tool_calls=[replace(call) for call in source.tool_calls], turns=source.turns, pauses=source.pauses)
    return out


def kept_at_pause(tokenizer: Any, ids: Sequence[int], stop: Sequence[str]) -> int:
    """How many leading ``ids`` of a turn interrupted by a pause to keep: the rest are rolled back, to be sampled
    again after the resume.

    vLLM looks for stop strings in a request's own output text only (``vllm/v1/engine/detokenizer.py``,
    ``check_stop_strings``), so a stop string split across the pause (``</cod`` before, ``e>`` after) would be
    missed. Trailing tokens are dropped until no suffix of the kept text is a proper prefix of a stop string and
    the text does not end in an incomplete UTF-8 character (decoded as U+FFFD); then a stop string in the whole
    turn either lies in the kept text, which the engine already searched, or wholly in the continuation, where it
    finds it. Decoding follows the engine's (``skip_special_tokens=False``).

    Returns:
        The kept count, in ``[0, len(ids)]``.
    """
    prefixes = {s[:k] for s in stop for k in range(1, len(s))}
    n = len(ids)
    while n > 0:
        text = tokenizer.decode(list(ids[:n]), skip_special_tokens=False)
        if not text.endswith("\ufffd") and not any(text.endswith(prefix) for prefix in prefixes):
            break
        n -= 1
    return n


def sample_seed(task_id: str, sample: int, base: int = 0) -> int:
    """A stable per-(task, sample) sampling seed, so a resumed or repeated evaluation draws the same samples."""
    return (zlib.crc32(f"{task_id}#{sample}".encode()) + 1_000_003 * base) % (2**31 - 1)


class ToolRunner(Protocol):
    """What the loop needs of a tool pool: ``call(name, content, trajectory_id, context) -> observation``.

    ``context`` holds ``task`` (the question); a runner with ``reads_transcript = True`` (a simulated environment,
    :class:`afm_core.rollout.simulated_tools.SimulatedTools`) also gets ``token_ids``: the trajectory's prompt and
    response ids up to and including the call's closing tag.
    """

    async def call(self, name: str, content: str, trajectory_id: str | None = None, context: Any = None) -> str: ...

    def end_trajectory(self, trajectory_id: str) -> None: ...


class AgentLoop:
    """Runs CoA trajectories against a generation engine and a tool pool.

    Args:
        engine: a :class:`~afm_core.rollout.engine.GenerationEngine`.
        tokenizer: the model's HF tokenizer (the same one SFT uses).
        tools: a started :class:`~afm_core.tools.ToolPool` (or anything with its ``call``), or None for
            no tools (every tool call then gets an error observation).
        config: :class:`AgentConfig`.
        sampling: default sampling settings; ``max_tokens`` is the cap per generation call and ``stop`` is
            filled in from the tools.
    """

    def __init__(
        self,
        engine: GenerationEngine,
        tokenizer: Any,
        tools: ToolRunner | None,
        config: AgentConfig = AgentConfig(),
        sampling: SamplingConfig = SamplingConfig(),
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.tools = tools
        self.config = config
        self.sampling = sampling
        self._end_of_turn_ids = end_of_turn_ids(tokenizer)

    def tool_names(self, task: AgentTask) -> tuple[str, ...]:
        return self.config.tools if self.config.tools is not None else TASK_TOOLS.get(task.task, TOOL_TAGS)

    async def run(
        self,
        task: AgentTask,
        sample: int = 0,
        *,
        sampling: SamplingConfig | None = None,
        seed: int | None = None,
        version: int = 0,
        resume: PausedTrajectory | None = None,
    ) -> Rollout:
        """Generate one trajectory for ``task``, or continue a paused one.

        Args:
            sample: the sample index (0..k-1) of this trajectory for the task.
            sampling: overrides the loop's default sampling settings.
            seed: the base sampling seed of this trajectory (turn t samples with ``seed + t``); None:
                :func:`sample_seed` of the task id and sample, so repeated runs draw the same samples. A resumed
                trajectory keeps its own (``resume.base_seed``).
            version: the policy version of the tokens sampled in this call (:attr:`Rollout.versions`).
            resume: a trajectory an engine pause stopped (:attr:`Rollout.paused`): it continues token-in from
                ``prompt_ids + response_ids + turn_ids`` (no re-rendering), the unfinished turn's budget is what
                its ``max_tokens`` left, the continuation and the kept ids are one turn, and the timeout counts
                the seconds it already ran.

        Returns:
            A :class:`~afm_core.rollout.types.Rollout`; it never raises for engine or tool failures (they
            end the trajectory with finish reason ``error``, or become error observations). An engine pause ends
            it with finish reason ``paused`` and :attr:`Rollout.paused` set; its tool-pool trajectory is then not
            ended (:meth:`ToolRunner.end_trajectory` runs when the trajectory really ends).

        Raises:
            ValueError: ``resume`` is another task's or sample's trajectory.
        """
        started = time.monotonic()
        if resume is None:
            state = _State(prompt_ids=encode_prompt(self.tokenizer, task.prompt, task.system), version=version)
            base_seed = sample_seed(task.id, sample) if seed is None else seed
            before = 0.0
        else:
            if (resume.task_id, resume.sample) != (task.id, sample):
                raise ValueError(
                    f"resume: the paused trajectory is {resume.task_id}#{resume.sample}, not {task.id}#{sample}"
                )
            state, base_seed, before = _State.resumed(resume, version), resume.base_seed, resume.seconds
        timeout = None if self.config.timeout_s is None else self.config.timeout_s - before
        try:
            if timeout is None:
                await self._loop(task, sample, state, sampling or self.sampling, base_seed)
            elif timeout <= 0:
                state.finish = FinishReason.TIMEOUT
            else:
                await asyncio.wait_for(self._loop(task, sample, state, sampling or self.sampling, base_seed), timeout)
        except TimeoutError:
            state.finish = FinishReason.TIMEOUT
        finally:
            if self.tools is not None and state.finish != FinishReason.PAUSED:
                self.tools.end_trajectory(_trajectory_id(task, sample))
        return self._rollout(task, sample, state, before + time.monotonic() - started, base_seed)

    async def _loop(self, task: AgentTask, sample: int, state: _State, sampling: SamplingConfig, seed: int) -> None:
        tools = self.tool_names(task)
        stop = tuple(stop_strings(tools))
        answer_stop = stop[-1]
        while state.finish is None:
            if state.turns >= self.config.max_turns:
                state.finish = FinishReason.MAX_TURNS
                break
            held = len(state.turn_ids)  # the kept ids of a turn a pause interrupted
            budget = min(
                self.config.max_response_tokens - len(state.response_ids) - held,
                self.engine.max_model_len - len(state.prompt_ids) - len(state.response_ids) - held,
                sampling.max_tokens - held,
            )
            if budget <= 0:
                if held:  # the interrupted turn had used its whole budget: it ends here
                    self._end_turn(state, [], None)
                state.finish = FinishReason.LENGTH
                break
            params = replace(sampling, max_tokens=budget, stop=stop, seed=seed + state.turns)
            try:
                gen = await self.engine.generate(
                    state.prompt_ids + state.response_ids + state.turn_ids,
                    params,
                    f"{_trajectory_id(task, sample)}-t{state.turns}",
                )
            except EngineError as e:
                state.finish, state.error = FinishReason.ERROR, str(e)
                break
            if gen.paused:
                self._hold_turn(state, gen, stop)
                state.finish = FinishReason.PAUSED
                break
            before = self.tokenizer.decode(state.turn_ids, skip_special_tokens=False) if held else ""
            self._end_turn(state, gen.token_ids, gen.logprobs)
            if gen.finish_reason == "abort":
                state.finish = FinishReason.ABORT
            elif gen.finish_reason == "length":
                state.finish = FinishReason.LENGTH
            elif gen.stop_reason == answer_stop:
                state.finish = FinishReason.ANSWER
            elif gen.stop_reason in stop:
                await self._call_tools(task, sample, state, before + gen.text, gen.stop_reason, tools)
            else:
                state.finish = FinishReason.EOS

    def _end_turn(self, state: _State, ids: list[int], logprobs: list[float] | None) -> None:
        """Append a finished turn: the ids a pause left of it (if any), then the ids sampled now."""
        state.turns += 1
        if state.turn_ids:
            logprobs = state.turn_logprobs + (list(logprobs) if logprobs is not None else [0.0] * len(ids))
            versions = state.turn_versions + [state.version] * len(ids)
            ids = state.turn_ids + ids
            state.turn_ids, state.turn_logprobs, state.turn_versions = [], [], []
        else:
            versions = None
        shown = ids[:-1] if ids and ids[-1] in self._end_of_turn_ids else ids
        state.add(ids, True, logprobs, self.tokenizer.decode(shown, skip_special_tokens=False), versions)

    def _hold_turn(self, state: _State, gen: Generation, stop: Sequence[str]) -> None:
        """Keep what a paused generation sampled as the unfinished turn, less the tokens :func:`kept_at_pause`
        rolls back."""
        n = len(gen.token_ids)
        ids = state.turn_ids + gen.token_ids
        logprobs = state.turn_logprobs + (list(gen.logprobs) if gen.logprobs is not None else [0.0] * n)
        versions = state.turn_versions + [state.version] * n
        kept = kept_at_pause(self.tokenizer, ids, stop)
        state.rolled_back += len(ids) - kept
        state.turn_ids, state.turn_logprobs, state.turn_versions = ids[:kept], logprobs[:kept], versions[:kept]
        state.pauses += 1

    async def _call_tools(
        self, task: AgentTask, sample: int, state: _State, segment: str, stop: str, tools: Sequence[str]
    ) -> None:
        turn = state.turns - 1
        last_turn = state.turns >= self.config.max_turns  # no generation follows this observation
        tag = stop[2:-1]
        calls: list[ToolCall | None] = [call for call in parse_tool_calls(segment, tools) if call.name == tag] or [None]
        records: list[ToolCallRecord] = []
        pending = []
        for call in calls:
            if call is None:
                records.append(
                    ToolCallRecord(
                        turn,
                        tag,
                        "",
                        f"[{tag} error: bad_input] no non-empty <{tag}> call before </{tag}>",
                        0.0,
                        "bad_input",
                    )
                )
            elif len(state.tool_calls) + len(records) >= self.config.max_tool_calls:
                observation = call_limit_observation(call.name, self.config.max_tool_calls, last_turn)
                records.append(ToolCallRecord(turn, call.name, call.query, observation, 0.0, "call_limit"))
            elif self.tools is None:
                records.append(
                    ToolCallRecord(
                        turn,
                        call.name,
                        call.query,
                        f"[{call.name} error: bad_input] no tools are available",
                        0.0,
                        "bad_input",
                    )
                )
            else:
                record = ToolCallRecord(turn, call.name, call.query, "", 0.0)
                records.append(record)
                pending.append((record, call))
        if pending:
            transcript = state.prompt_ids + state.response_ids  # up to the call's closing tag
            await asyncio.gather(*(self._run_call(task, sample, record, call, transcript) for record, call in pending))
        state.tool_calls += records
        observations = [record.observation for record in records]
        if last_turn:
            observations.append(turn_limit_note(self.config.max_turns))
        text = render_observation("\n\n".join(observations))
        ids = encode_text(self.tokenizer, text)
        room = self.config.max_response_tokens - len(state.response_ids)
        room = min(room, self.engine.max_model_len - len(state.prompt_ids) - len(state.response_ids))
        if len(ids) > room:
            ids = ids[: max(room, 0)]
            text = self.tokenizer.decode(ids)
            state.finish = FinishReason.LENGTH
        state.add(ids, False, None, text)

    async def _run_call(
        self, task: AgentTask, sample: int, record: ToolCallRecord, call: Any, transcript: list[int]
    ) -> None:
        started = time.monotonic()
        context: dict[str, Any] = {"task": task.question or task.prompt}
        assert self.tools is not None
        if getattr(self.tools, "reads_transcript", False):  # a simulated environment continues the trajectory
            context["token_ids"] = transcript
        record.observation = await self.tools.call(call.name, call.query, _trajectory_id(task, sample), context)
        record.seconds = time.monotonic() - started
        record.error = observation_error_kind(record.observation)

    def _rollout(self, task: AgentTask, sample: int, state: _State, seconds: float, base_seed: int) -> Rollout:
        text = "".join(state.text_parts)
        paused = None
        if state.finish == FinishReason.PAUSED:  # not parsed nor validated: the trajectory has not ended
            paused = state.paused(task.id, sample, base_seed, seconds)
        issues = [] if paused else [issue.code for issue in validate_text(text)]
        trajectory = None
        if task.task in TASKS and paused is None:
            try:
                steps = parse_steps(text)
                trajectory = Trajectory(
                    id=_trajectory_id(task, sample),
                    task=task.task,
                    question=task.question,
                    prompt=task.prompt,
                    steps=steps,
                    answer=task.answer,
                    source="rollout",
                    source_id=task.id,
                )
            except TagGrammarError:
                trajectory = None
        return Rollout(
            task=task,
            sample=sample,
            prompt_ids=state.prompt_ids,
            response_ids=state.response_ids,
            response_mask=state.response_mask,
            logprobs=state.logprobs,
            response_text=text,
            turns=state.turns,
            tool_calls=state.tool_calls,
            finish_reason=state.finish or FinishReason.ERROR,
            trajectory=trajectory,
            format_issues=issues,
            seconds=seconds,
            error=state.error,
            versions=state.versions,
            paused=paused,
            rolled_back_tokens=state.rolled_back,
            pauses=state.pauses,
        )

    async def run_many(
        self,
        items: Iterable[tuple[AgentTask, int]],
        *,
        concurrency: int = 64,
        sampling: SamplingConfig | Callable[[AgentTask], SamplingConfig] | None = None,
        on_result: Callable[[Rollout], Any] | None = None,
        progress: str | None = "rollouts",
    ) -> list[Rollout]:
        """Run ``(task, sample)`` pairs with at most ``concurrency`` trajectories in flight.

        Args:
            sampling: settings for every task, or a function of the task (per-benchmark settings).
            on_result: called (in the event loop) as each trajectory finishes, e.g. to grade it and append it to a
                file; a coroutine result is awaited (the trajectory's slot is held until it finishes).
            progress: a progress-bar label (tqdm on stderr), or None for no bar.

        Returns:
            The rollouts in the order of ``items``.
        """
        items = list(items)
        slots = asyncio.Semaphore(max(1, concurrency))
        bar = tqdm(total=len(items), desc=progress, unit="traj", disable=progress is None, dynamic_ncols=True)

        async def one(task: AgentTask, sample: int) -> Rollout:
            async with slots:
                params = sampling(task) if callable(sampling) else sampling
                rollout = await self.run(task, sample, sampling=params)
                if on_result is not None:
                    result = on_result(rollout)
                    if inspect.isawaitable(result):
                        await result
            bar.update(1)
            return rollout

        try:
            return list(await asyncio.gather(*(one(task, sample) for task, sample in items)))
        finally:
            bar.close()


def _trajectory_id(task: AgentTask, sample: int) -> str:
    return f"{task.id}#{sample}"
