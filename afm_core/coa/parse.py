"""Parsing model text: tool calls (as the rollout sees them), whole responses, code-tool queries."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from afm_core.coa.grammar import TagGrammarError, content_issues, scan_text
from afm_core.coa.tags import TOOL_TAGS
from afm_core.coa.trajectory import Step


@dataclass(frozen=True)
class ToolCall:
    """One tool call: the tool's tag name and its single string argument (upstream ``{"query": ...}``)."""

    name: str
    query: str


@cache
def _tool_re(name: str) -> re.Pattern[str]:
    # Upstream verl/tools/xml_tool_parser.py: the shortest <name>...</name> with no <name> inside.
    return re.compile(rf"<{name}>((?:(?!<{name}>).)*?)</{name}>", re.DOTALL)


def parse_tool_calls(text: str, tool_names: Sequence[str] = TOOL_TAGS) -> list[ToolCall]:
    """The tool calls in ``text``, in order of appearance.

    Same matching as upstream ``XMLToolParser.parse_non_stream`` (one regex per tool,
    ``<name>((?:(?!<name>).)*?)</name>`` with DOTALL; a call counts only if its stripped content is
    non-empty; ``query`` is the stripped inner text). Upstream lists calls tool by tool; here they are
    ordered by position, which is the order the model wrote them.
    """
    found = []
    for name in tool_names:
        for match in _tool_re(name).finditer(text):
            query = match.group(1).strip()
            if query:
                found.append((match.start(), ToolCall(name, query)))
    return [call for _, call in sorted(found, key=lambda item: item[0])]


def has_tool_call(text: str, tool_names: Sequence[str] = TOOL_TAGS) -> bool:
    """Whether ``text`` holds at least one non-empty tool call (upstream ``XMLToolParser.has_tool_call``)."""
    return any(m.group(1).strip() for name in tool_names for m in _tool_re(name).finditer(text))


def stop_strings(tool_names: Sequence[str] = TOOL_TAGS) -> list[str]:
    """Generation stop strings: each tool's closing tag, then ``</answer>`` (upstream ``get_stop_phrases``).

    Generate with the stop string kept in the output (vLLM ``include_stop_str_in_output=True``,
    SGLang ``no_stop_trim=True``) so the text ends with the closing tag.
    """
    return [f"</{name}>" for name in tool_names] + ["</answer>"]


def parse_steps(text: str) -> list[Step]:
    """Parse a rendered response (see :func:`afm_core.coa.render.render_response`) back into steps.

    Whitespace around and inside blocks is not significant, so ``parse_steps(render_response(s)) == s``
    for any steps whose contents hold no CoA tags. The step order is not checked here (a rollout in
    progress parses too); use :func:`afm_core.coa.grammar.validate_steps` for that.

    Raises:
        TagGrammarError: text outside blocks, unbalanced or nested tags.
    """
    steps, issues = scan_text(text)
    for i, step in enumerate(steps):
        issues += [issue for issue in content_issues(i, step) if issue.code == "nested_tag"]
    if issues:
        raise TagGrammarError(issues)
    return steps


_FENCE_RE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)\n?```", re.DOTALL)


def format_code_query(code: str, stdin: str | None = None) -> str:
    """The ``query`` of a ``<code>`` call: a ```` ```py ```` block, plus a ```` ```sh ```` stdin block if given.

    Layout of the upstream math/code prompts (afm-reference §2.1).
    """
    query = f"```py\n{code.strip()}\n```"
    if stdin is not None:
        query += f"\n```sh\n{stdin.strip()}\n```"
    return query


def parse_code_query(query: str) -> tuple[str, str | None]:
    """Split a ``<code>`` query into ``(python source, stdin or None)``.

    The source is the first fenced block tagged ``py``/``python`` (or untagged); stdin is the first
    block tagged ``sh`` (upstream code tool). A query with no fence is taken as bare source.
    """
    code, stdin = None, None
    for match in _FENCE_RE.finditer(query):
        lang, body = match.group(1).lower(), match.group(2)
        if lang in ("py", "python", "python3", "") and code is None:
            code = body
        elif lang == "sh" and stdin is None:
            stdin = body
    return (query.strip() if code is None else code), stdin
