"""The roles of the multi-agent system: what each is asked (chat messages) and how its reply is read.

The roles follow the CoA paper's agents (arXiv 2508.13167, "Chain-of-Agents" paradigm: role-playing agents
and tool agents): a planner; a thinking agent that decides the next action and later suggests an answer;
tool agents (search, crawl, code) that write the input of their tool; a reflection agent that rates the
trajectory good/average/poor on information conflict, tool effectiveness and trajectory monitoring (the
three criteria of the upstream web prompt, ``AFM/data/sys_prompts.py``); and a verifier that scores the
suggested answer 1-4 (``<double_check>``: <= 2 re-plans, >= 3 answers).

Every role sees the run so far as a plain-text transcript (:func:`transcript`), never in CoA tags, so that a
teacher is not tempted to write tags; the converter (:mod:`afm_core.distill.convert`) writes the tags. Each
parser is lenient (a weak teacher answers loosely) and returns what it could not read as None.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from afm_core.coa.grammar import TAG_RE
from afm_core.coa.parse import format_code_query, parse_code_query, parse_tool_calls
from afm_core.data.trajectory_checks import double_check_score

ROLES = ("planner", "thinker", "search", "crawl", "code", "reflection", "verifier")
"""Role names; ``teachers``/``roles`` in the config map each to a teacher."""

TOOL_AGENTS = {"wiki_search": "search", "web_search": "search", "crawl_page": "crawl", "code": "code"}
"""The tool agent (role) that writes each tool's input."""

REFLECTION_CRITERIA = ("information conflict", "tool effectiveness", "trajectory monitoring")
RATINGS = ("good", "average", "poor")

ANSWER_FORMATS = {
    "math": "the final number or expression inside \\boxed{}, for example \\boxed{42}",
    "mhqa": "as short as possible: a name, a date, a number, yes or no",
    "web": "as short as possible: a name, a date, a number, yes or no",
    "code": "the complete Python program that reads stdin and writes stdout, in one ```py block",
}

TOOL_USES = {
    "wiki_search": "wiki_search: searches a Wikipedia index with a short query",
    "web_search": "web_search: searches the web with a short query",
    "crawl_page": "crawl_page: reads web pages at given URLs",
    "code": "code: runs a Python program and returns what it prints",
}


@dataclass
class Event:
    """One entry of a run's transcript: a role's output or a tool call with its observation."""

    kind: str  # plan | think | tool | reflection | suggest | double_check
    text: str
    tool: str | None = None
    observation: str | None = None


TEAM = ("You are one agent in a team of agents that solves a task together: a planning agent, a thinking agent, "
        "tool agents (search, crawl, code), a reflection agent and a verification agent. The user message shows "
        "the work so far, then tells you which agent you are. Follow its instructions exactly and write only "
        "what is asked, in plain text.")  # fmt: skip
"""The system message of every role. It is the same for all, and the role comes last in the user message, so
the successive calls of a run share their prefix (the transcript grows at its end) and an engine with prefix
caching computes each transcript once."""


def _messages(history: str, role: str, ask: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": TEAM},
            {"role": "user", "content": f"{history}\n\nYou are the {role}. {ask}"}]  # fmt: skip


def _clip(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def transcript(question: str, events: Sequence[Event], obs_chars: int = 600, last: int = 12) -> str:
    """The run so far as plain text for a role prompt: the question, then the last ``last`` events
    (observations clipped to ``obs_chars`` characters)."""
    lines = [f"Task: {question.strip()}"]
    shown = list(events)[-last:] if last else []
    if len(shown) < len(events):
        lines.append(f"({len(events) - len(shown)} earlier steps not shown)")
    for event in shown:
        if event.kind == "tool":
            lines.append(f"Tool call {event.tool}: {_clip(event.text, 400)}")
            lines.append(f"Result: {_clip(event.observation or '', obs_chars)}")
        else:
            label = {"plan": "Plan", "think": "Thought", "reflection": "Reflection", "suggest": "Suggested answer",
                     "double_check": "Verification"}[event.kind]  # fmt: skip
            lines.append(f"{label}: {_clip(event.text, 600)}")
    return "\n".join(lines)


def planner_messages(history: str, tools: Sequence[str], feedback: str | None, max_steps: int) -> list[dict[str, str]]:
    """Ask for a numbered plan (again, with the verifier's feedback, after a low score); ``history`` is the
    :func:`transcript`, as for every role."""
    ask = (f"Write a numbered plan of at most {max_steps} short steps to solve the task. Each step is one "
           f"sub-question or computation that one tool call can settle. Tools: {'; '.join(TOOL_USES[t] for t in tools)}.")  # fmt: skip
    if feedback:
        ask = f"The last answer was judged unreliable: {_clip(feedback, 300)}\nMake a new plan. " + ask
    return _messages(history, "planning agent", ask)


def thinker_messages(history: str, tools: Sequence[str]) -> list[dict[str, str]]:
    """Ask for reasoning and the next action, as a last line ``NEXT: <tool or answer>``."""
    choices = ", ".join([*tools, "answer"])
    ask = (f"Think step by step about what is known and what is still missing. Then write a last line "
           f"'NEXT: X' where X is one of: {choices} (answer when the task can be answered now).")  # fmt: skip
    return _messages(history, "thinking agent", ask)


def tool_messages(history: str, tool: str) -> list[dict[str, str]]:
    """Ask a tool agent for the input of its tool."""
    ask = {
        "wiki_search": "Write one short Wikipedia search query for the next step of the plan. Reply with the "
        "query only.",
        "web_search": "Write one short web search query for the next step of the plan. Reply with the query only.",
        "crawl_page": "Choose up to 3 URLs from the results above that answer the next step. Reply with the URLs "
        "only, separated by |.",
        "code": "Write a short Python program for the next step of the plan that prints the result with "
        "print(). Reply with one ```py code block only.",
    }[tool]
    return _messages(history, f"{TOOL_AGENTS[tool]} agent", ask)


def reflection_messages(history: str) -> list[dict[str, str]]:
    """Ask for good/average/poor on the three criteria, and what to change."""
    ask = ("Review the steps so far. Rate each criterion good, average or poor, one per line:\n"
           "Information conflict: (do the results contradict each other?)\n"
           "Tool effectiveness: (did the tool calls return useful results?)\n"
           "Trajectory monitoring: (are the steps on track to answer the task?)\n"
           "Then one sentence on what to do next.")  # fmt: skip
    return _messages(history, "reflection agent", ask)


def suggest_messages(history: str, task: str) -> list[dict[str, str]]:
    """Ask for the answer only, in the task's answer format."""
    ask = f"Give the final answer to the task now: {ANSWER_FORMATS[task]}. Reply with the answer only."
    return _messages(history, "thinking agent", ask)


def verifier_messages(history: str, suggestion: str) -> list[dict[str, str]]:
    """Ask for a 1-4 score of the suggested answer, as ``Score: N`` and one sentence why."""
    ask = (f"Suggested answer: {_clip(suggestion, 600)}\nCheck it against the steps above. Write 'Score: N' where N "
           "is 1 (surely wrong), 2 (doubtful), 3 (probably right) or 4 (surely right), then one sentence why.")  # fmt: skip
    return _messages(history, "verification agent", ask)


# --------------------------------------------------------------------------------------------------
# Parsing replies

_NEXT_RE = re.compile(r"NEXT\s*[:=-]\s*`?([A-Za-z_]+)", re.IGNORECASE)
_PLAN_STEP_RE = re.compile(r"^\s*(?:\d+[.)]|[-*•])\s+(.+)$", re.MULTILINE)
_URL_RE = re.compile(r"https?://[^\s|<>\"')\]]+")
_PREFIX_RE = re.compile(r"^\s*(?:query|search query|answer|final answer|urls?)\s*[:=-]\s*", re.IGNORECASE)


def strip_tags(text: str) -> tuple[str, int]:
    """``text`` without CoA tags (``<think>``, ``</answer>``...) and the number removed."""
    cleaned, count = TAG_RE.subn("", text)
    return cleaned.strip(), count


def plan_steps(plan: str) -> list[str]:
    """The numbered or bulleted lines of a plan; the whole text as one step when it has none."""
    steps = [m.group(1).strip() for m in _PLAN_STEP_RE.finditer(plan) if m.group(1).strip()]
    return steps or ([plan.strip()] if plan.strip() else [])


def next_action(reply: str, tools: Sequence[str]) -> str | None:
    """The action of the LAST ``NEXT: X`` line: a tool name, ``answer``, or None when absent or unknown.

    A tool agent's name (``search``, ``code``...) is read as the task's tool of that agent.
    """
    found = _NEXT_RE.findall(reply)
    if not found:
        return None
    word = found[-1].lower()
    if word in tools or word == "answer":
        return word
    for tool in tools:
        if TOOL_AGENTS[tool] == word or tool.startswith(word):
            return tool
    return None


def reasoning(reply: str) -> str:
    """The thinking agent's reply without its ``NEXT:`` lines."""
    return "\n".join(line for line in reply.splitlines() if not _NEXT_RE.search(line)).strip()


def tool_input(tool: str, reply: str) -> str:
    """The tool input in a tool agent's reply ("" when there is none).

    A reply that wraps the input in the tool's own tag (``<wiki_search>q</wiki_search>``) is read inside it.
    code: the first ```py block (or the bare text), re-fenced as :func:`afm_core.coa.parse.format_code_query`;
    crawl_page: the URLs found, joined by `` | ``; search: the first non-empty line, without a ``Query:``
    prefix or quotes, at most 300 characters.
    """
    calls = parse_tool_calls(reply, (tool,))
    text = calls[0].query if calls else reply
    text, _ = strip_tags(text)
    if tool == "code":
        code, stdin = parse_code_query(text)
        return format_code_query(code, stdin) if code.strip() else ""
    if tool == "crawl_page":
        urls = list(dict.fromkeys(url.rstrip(".,;:!?") for url in _URL_RE.findall(text)))[:3]
        return " | ".join(urls)
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    return _PREFIX_RE.sub("", line).strip().strip("\"'`").strip()[:300]


def reflection_ratings(reply: str) -> dict[str, str | None]:
    """``{criterion: good | average | poor | None}`` read from a reflection reply."""
    ratings: dict[str, str | None] = {}
    lower = reply.lower()
    for criterion in REFLECTION_CRITERIA:
        match = re.search(re.escape(criterion) + r"\W{0,5}(good|average|poor)", lower)
        ratings[criterion.replace(" ", "_")] = match.group(1) if match else None
    return ratings


def suggested_answer(reply: str) -> str:
    """The answer in a suggest reply: tags and an ``Answer:`` prefix removed."""
    text, _ = strip_tags(reply)
    return _PREFIX_RE.sub("", text).strip()


def verifier_score(reply: str) -> int | None:
    """The 1-4 score of a verifier reply (:func:`afm_core.data.trajectory_checks.double_check_score`)."""
    return double_check_score(reply)
