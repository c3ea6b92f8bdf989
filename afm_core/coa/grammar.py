"""The CoA tag grammar: scanning a response into steps, and checking a step sequence.

Rules (after the upstream prompts' "Function Association Instructions", afm-reference §2.1, and the
LLaMA-Factory-AFM SFT validity checks, §3.2):

=======================================  =============================================================
code                                     rule
=======================================  =============================================================
``text_outside_tags``                    only whitespace between blocks
``unbalanced_tag``                       every opening tag is closed, every closing tag was opened
``nested_tag``                           no CoA tag inside a role block or a tool call; no
                                         ``<observation>`` tag inside an observation
``empty_step``                           role blocks and tool calls have non-empty content
``observation_without_tool_call``        an observation comes right after a tool call
``missing_observation``                  a tool call is followed by its observation
``double_check_without_suggested_answer`` double_check comes right after suggested_answer
``answer_not_last``                      the answer is the last step (so there is at most one)
``missing_answer``                       a complete trajectory ends with an answer
=======================================  =============================================================

The codes are stable: converters count rejections by them. Observation contents are opaque (a web
page may legitimately contain ``<code>``), except for the observation tags themselves.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from afm_core.coa.tags import ALL_TAGS
from afm_core.coa.trajectory import Step

TAG_RE = re.compile(r"<(/?)(" + "|".join(ALL_TAGS) + r")>")
"""Any opening or closing CoA tag; group 1 is ``"/"`` for a closing tag, group 2 the tag name."""

_OBSERVATION_TAGS_RE = re.compile(r"</?observation>")


@dataclass(frozen=True)
class GrammarIssue:
    """One violation of the tag grammar.

    Attributes:
        code: a stable short code (see the module docstring).
        message: human-readable detail (char offsets into the text, or step indices).
    """

    code: str
    message: str

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class TagGrammarError(ValueError):
    """A text or step sequence breaks the CoA tag grammar; ``issues`` lists every violation."""

    def __init__(self, issues: Sequence[GrammarIssue], context: str = "") -> None:
        self.issues = list(issues)
        prefix = f"{context}: " if context else ""
        super().__init__(prefix + "; ".join(str(issue) for issue in self.issues))


def _snippet(text: str, limit: int = 40) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def scan_text(text: str) -> tuple[list[Step], list[GrammarIssue]]:
    """Split a rendered response into its top-level blocks, leniently.

    An observation runs from ``<observation>`` to the next ``</observation>`` whatever it contains;
    any other block runs to the next closing tag of its own name. Scanning stops at an unclosed
    block. Only structural issues are reported here (``text_outside_tags``, ``unbalanced_tag``);
    :func:`validate_steps` checks the contents and the order.

    Returns:
        ``(steps, issues)``: the blocks found and the structural issues met.
    """
    steps: list[Step] = []
    issues: list[GrammarIssue] = []
    pos = 0
    while True:
        match = TAG_RE.search(text, pos)
        outside = text[pos : match.start() if match else len(text)]
        if outside.strip():
            message = f"text outside any block at char {pos}: {_snippet(outside)}"
            issues.append(GrammarIssue("text_outside_tags", message))
        if match is None:
            return steps, issues
        is_close, tag = match.group(1) == "/", match.group(2)
        if is_close:
            issues.append(GrammarIssue("unbalanced_tag", f"</{tag}> at char {match.start()} closes no open block"))
            pos = match.end()
            continue
        close = f"</{tag}>"
        end = text.find(close, match.end())
        if end < 0:
            issues.append(GrammarIssue("unbalanced_tag", f"<{tag}> at char {match.start()} is never closed"))
            return steps, issues
        steps.append(Step(tag, text[match.end() : end]))
        pos = end + len(close)


def content_issues(index: int, step: Step) -> list[GrammarIssue]:
    """Issues inside one step: ``nested_tag`` and ``empty_step``."""
    issues = []
    if step.kind == "observation":
        nested = _OBSERVATION_TAGS_RE.search(step.content)
    else:
        nested = TAG_RE.search(step.content)
        if not step.content:
            issues.append(GrammarIssue("empty_step", f"step {index} <{step.tag}> is empty"))
    if nested:
        issues.append(GrammarIssue("nested_tag", f"step {index} <{step.tag}> contains {nested.group(0)}"))
    return issues


def validate_steps(steps: Sequence[Step], *, require_answer: bool = True, strict: bool = False) -> list[GrammarIssue]:
    """Check a step sequence against the tag grammar.

    Args:
        steps: the trajectory's steps.
        require_answer: a complete trajectory must end with ``<answer>`` (and its last tool call must
            have its observation). False for a rollout still in progress.
        strict: raise instead of returning the issues.

    Returns:
        The issues, in step order; empty when the sequence is valid.

    Raises:
        TagGrammarError: ``strict`` and at least one issue.
    """
    issues: list[GrammarIssue] = []
    for i, step in enumerate(steps):
        issues += content_issues(i, step)
        prev = steps[i - 1] if i > 0 else None
        nxt = steps[i + 1] if i + 1 < len(steps) else None
        if step.kind == "observation" and (prev is None or prev.kind != "tool"):
            issues.append(GrammarIssue("observation_without_tool_call", f"step {i} <observation> follows no tool call"))
        if step.kind == "tool" and (nxt.kind != "observation" if nxt else require_answer):
            issues.append(GrammarIssue("missing_observation", f"step {i} <{step.tag}> has no observation after it"))
        if step.tag == "double_check" and (prev is None or prev.tag != "suggested_answer"):
            message = f"step {i} <double_check> does not follow <suggested_answer>"
            issues.append(GrammarIssue("double_check_without_suggested_answer", message))
        if step.tag == "answer" and nxt is not None:
            message = f"step {i} <answer> is followed by {len(steps) - i - 1} more step(s)"
            issues.append(GrammarIssue("answer_not_last", message))
    if require_answer and (not steps or steps[-1].tag != "answer"):
        issues.append(GrammarIssue("missing_answer", "the trajectory does not end with <answer>"))
    if strict and issues:
        raise TagGrammarError(issues)
    return issues


def validate_text(text: str, *, require_answer: bool = True, strict: bool = False) -> list[GrammarIssue]:
    """Check a rendered response: its structure (:func:`scan_text`) and its steps (:func:`validate_steps`).

    Raises:
        TagGrammarError: ``strict`` and at least one issue.
    """
    steps, issues = scan_text(text)
    issues += validate_steps(steps, require_answer=require_answer)
    if strict and issues:
        raise TagGrammarError(issues)
    return issues
