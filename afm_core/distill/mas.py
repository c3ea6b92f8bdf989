"""The multi-agent system (MAS) that distillation records: plan, act with tool agents, reflect, verify, re-plan.

One run solves one task (:class:`~afm_core.rollout.AgentTask`)::

    plan = planner(task)
    for round in 0..max_replans:
        until the thinking agent says "answer" (or max_tool_calls / max_steps):
            think = thinker(transcript)                          # reasoning + "NEXT: <tool | answer>"
            query = tool agent of NEXT (search / crawl / code)   # the tool's input
            observation = ToolPool.call(tool, query)             # the real tool
            every reflect_every calls: reflection(transcript)    # good/average/poor on 3 criteria
        reflection (if tools ran since the last one); suggestion = thinker("answer now")
        score = verifier(suggestion)                             # <double_check>, 1-4
        if score >= accept_score: stop; else plan = planner(feedback=verifier) and go on
    final answer = the last suggestion

A thinking-agent reply without a readable ``NEXT:`` follows the plan: one call of the task's first tool per
plan step not yet run in this round, then an answer. A tool agent that writes no usable input costs a step
and calls nothing. Every role call and tool call is recorded (messages, output, parsed fields, teacher,
tokens, seconds, errors) in the run record (:func:`MultiAgentSystem.run`), which the converter
(:mod:`afm_core.distill.convert`) turns into one CoA trajectory.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from afm_core.coa.prompts import TASK_TOOLS
from afm_core.config.eval import MASConfig
from afm_core.distill import roles
from afm_core.distill.roles import Event
from afm_core.distill.teacher import ChatSampling, Teacher
from afm_core.rollout import AgentTask, observation_error_kind, sample_seed
from afm_core.rollout.agent_loop import ToolRunner

RECORD_VERSION = 1


@dataclass(frozen=True)
class RoleTeacher:
    """The teacher a role talks to and the role's sampling."""

    teacher: Teacher
    sampling: ChatSampling


class _Run:
    """The state of one run: the transcript events shown to the roles and the full record."""

    def __init__(self, task: AgentTask, sample: int) -> None:
        self.task = task
        self.sample = sample
        self.events: list[Event] = []
        self.record_events: list[dict[str, Any]] = []
        self.tool_calls = 0
        self.reflected_at = 0  # tool calls made when the last reflection was asked for
        self.steps = 0
        self.seed = sample_seed(task.id, sample)

    @property
    def trajectory_id(self) -> str:
        return f"{self.task.id}#{self.sample}"


class MultiAgentSystem:
    """Runs the MAS on tasks (see the module docstring).

    Args:
        teachers: the :class:`RoleTeacher` of every role in :data:`afm_core.distill.roles.ROLES`.
        tools: a started :class:`~afm_core.tools.ToolPool` (anything with its ``call``/``end_trajectory``).
        config: the run's limits and policy (``mas``: :class:`afm_core.config.eval.MASConfig`).

    Raises:
        ValueError: a role without a teacher.
    """

    def __init__(self, teachers: Mapping[str, RoleTeacher], tools: ToolRunner | None, config: MASConfig) -> None:
        if missing := [role for role in roles.ROLES if role not in teachers]:
            raise ValueError(f"roles: no teacher for {missing}")
        self.teachers = dict(teachers)
        self.tools = tools
        self.config = config

    def tool_names(self, task: AgentTask) -> tuple[str, ...]:
        return TASK_TOOLS.get(task.task, ("code",))

    async def _ask(self, run: _Run, role: str, kind: str, messages: list[dict[str, str]], **parsed: Any) -> str:
        spec = self.teachers[role]
        seed = run.seed + len(run.record_events)
        reply = await spec.teacher.chat(messages, replace(spec.sampling, seed=seed), f"{run.trajectory_id}-{role}")
        run.record_events.append({
            "role": role, "kind": kind, "teacher": spec.teacher.name, "messages": messages, "output": reply.text,
            "finish_reason": reply.finish_reason, "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": reply.completion_tokens, "seconds": round(reply.seconds, 3), "error": reply.error,
            **parsed,
        })  # fmt: skip
        return reply.text

    def _note(self, run: _Run, **fields: Any) -> None:
        run.record_events[-1].update(fields)

    async def _plan(self, run: _Run, feedback: str | None) -> list[str]:
        tools = self.tool_names(run.task)
        messages = roles.planner_messages(self._history(run), tools, feedback, self.config.max_plan_steps)
        text = await self._ask(run, "planner", "plan", messages)
        steps = roles.plan_steps(text)[: self.config.max_plan_steps]
        self._note(run, plan_steps=steps)
        if text.strip():
            run.events.append(Event("plan", text))
        return steps

    async def _tool_call(self, run: _Run, tool: str) -> None:
        messages = roles.tool_messages(self._history(run), tool)
        reply = await self._ask(run, roles.TOOL_AGENTS[tool], "tool_input", messages)
        query = roles.tool_input(tool, reply)
        self._note(run, tool=tool, query=query)
        if not query:
            return
        started = time.monotonic()
        if self.tools is None:
            observation = f"[{tool} error: bad_input] no tools are available"
        else:
            context = {"task": run.task.question or run.task.prompt}
            observation = await self.tools.call(tool, query, run.trajectory_id, context)
        seconds = time.monotonic() - started
        run.record_events.append({"role": "tool", "kind": "tool_call", "tool": tool, "query": query,
                                  "observation": observation, "seconds": round(seconds, 3),
                                  "error": observation_error_kind(observation)})  # fmt: skip
        run.events.append(Event("tool", query, tool=tool, observation=observation))
        run.tool_calls += 1

    async def _reflect(self, run: _Run) -> None:
        text = await self._ask(run, "reflection", "reflection", roles.reflection_messages(self._history(run)))
        run.reflected_at = run.tool_calls
        self._note(run, ratings=roles.reflection_ratings(text))
        if text.strip():
            run.events.append(Event("reflection", text))

    def _history(self, run: _Run) -> str:
        """The transcript the roles see: the question and the last ``context_events`` events."""
        return roles.transcript(run.task.question, run.events, self.config.obs_chars, self.config.context_events)

    async def _act(self, run: _Run, plan: Sequence[str]) -> None:
        """Think and call tools until the thinking agent answers or a limit is reached."""
        tools = self.tool_names(run.task)
        done_in_round = 0
        while run.tool_calls < self.config.max_tool_calls and run.steps < self.config.max_steps:
            run.steps += 1
            text = await self._ask(run, "thinker", "think", roles.thinker_messages(self._history(run), tools))
            action = roles.next_action(text, tools)
            followed = action is None
            if action is None:
                action = tools[0] if done_in_round < max(len(plan), 1) else "answer"
            self._note(run, next=action, next_from_plan=followed)
            if thought := roles.reasoning(text):
                run.events.append(Event("think", thought))
            if action == "answer":
                return
            before = run.tool_calls
            await self._tool_call(run, action)
            if run.tool_calls > before:
                done_in_round += 1
                if self.config.reflect_every and run.tool_calls - run.reflected_at >= self.config.reflect_every:
                    await self._reflect(run)

    async def run(self, task: AgentTask, sample: int = 0) -> dict[str, Any]:
        """Run the MAS on ``task`` and return its record (JSON-safe).

        Record fields: ``record_version``, ``benchmark``, ``problem_id``, ``sample`` (the resume key), ``task``
        (the :class:`AgentTask` as a dict), ``events`` (every role call: role, kind, teacher, messages, output,
        finish_reason, token counts, seconds, error, parsed fields; every tool call: tool, query, observation,
        seconds, error kind), ``final_answer``, ``finish`` (``answer``, ``no_answer``), ``replans``,
        ``tool_calls``, ``seconds``. It never raises for teacher or tool failures (they are recorded).
        """
        started = time.monotonic()
        run = _Run(task, sample)
        replans = 0
        suggestion = ""
        plan = await self._plan(run, None)
        while True:
            await self._act(run, plan)
            if run.tool_calls > run.reflected_at:
                await self._reflect(run)
            reply = await self._ask(run, "thinker", "suggest", roles.suggest_messages(self._history(run), task.task))
            answer = roles.suggested_answer(reply)
            self._note(run, answer=answer)
            if not answer:
                break
            suggestion = answer
            run.events.append(Event("suggest", answer))
            check = await self._ask(
                run, "verifier", "double_check", roles.verifier_messages(self._history(run), answer)
            )
            score = roles.verifier_score(check)
            self._note(run, score=score)
            if check.strip():
                run.events.append(Event("double_check", check))
            if (score is not None and score >= self.config.accept_score) or replans >= self.config.max_replans:
                break
            replans += 1
            plan = await self._plan(run, check)
        if self.tools is not None:
            self.tools.end_trajectory(run.trajectory_id)
        return {
            "record_version": RECORD_VERSION,
            "benchmark": task.meta.get("benchmark", ""),
            "problem_id": str(task.meta.get("problem_id", task.id)),
            "sample": sample,
            "task": asdict(task),
            "events": run.record_events,
            "final_answer": suggestion or None,
            "finish": "answer" if suggestion else "no_answer",
            "replans": replans,
            "tool_calls": run.tool_calls,
            "seconds": round(time.monotonic() - started, 3),
        }
