"""The ONE canonical text layout of a CoA response (the assistant turn), shared by SFT, RL and eval.

Layout, for steps ``think, web_search, observation, think, answer``::

    <think>\\nI should search.\\n</think>\\n<web_search>\\nAFM Chain-of-Agents\\n</web_search>
    \\n<observation>\\nFound 10 results: ...\\n</observation>\\n\\n<think>\\ndone\\n</think>\\n<answer>\\n42\\n</answer>

* a role block or tool call is ``<tag>\\n{content}\\n</tag>``, as upstream re-emits tool calls
  (afm-reference §2.2); consecutive such blocks are separated by one ``\\n``;
* an observation is EXACTLY ``\\n<observation>\\n{content}\\n</observation>\\n\\n`` (upstream's RL
  layout). The newline before ``<observation>`` and the blank line after ``</observation>`` are the
  ones upstream's token-level SFT mask needs (§3.3); the environment appends them with the
  observation, the model never writes them;
* the response ends right after ``</answer>``, where generation stops.

So a rollout generates up to and including a tool's closing tag (a stop string, see
:func:`afm_core.coa.parse.stop_strings`), appends :func:`render_observation` of the tool output, and
generates on: the text it builds is byte-identical to :func:`render_response` of its steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from afm_core.coa.trajectory import Step

OBSERVATION_OPEN = "<observation>"
OBSERVATION_CLOSE = "</observation>"


def render_observation(content: str) -> str:
    """``"\\n<observation>\\n" + content.strip() + "\\n</observation>\\n\\n"``: a tool output as appended to the text."""
    return f"\n{OBSERVATION_OPEN}\n{content.strip()}\n{OBSERVATION_CLOSE}\n\n"


def render_block(tag: str, content: str) -> str:
    """``"<tag>\\n" + content.strip() + "\\n</tag>"``: a role block or tool call (no surrounding newlines)."""
    return f"<{tag}>\n{content.strip()}\n</{tag}>"


def render_response(steps: Sequence[Step]) -> str:
    """Render steps in the canonical layout (module docstring). Inverse: :func:`afm_core.coa.parse.parse_steps`."""
    parts: list[str] = []
    prev: Step | None = None
    for step in steps:
        if step.kind == "observation":
            parts.append(render_observation(step.content))
        else:
            if prev is not None and prev.kind != "observation":
                parts.append("\n")
            parts.append(render_block(step.tag, step.content))
        prev = step
    return "".join(parts)


def observation_spans(text: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of every ``<observation>…</observation>`` block, both tags included.

    Found by the tags alone, so any whitespace (or none) around them works. A block ends at the first
    ``</observation>`` after its ``<observation>``; an unclosed block (a text truncated inside an
    observation) runs to the end of the text, so that a loss mask built on these spans never trains
    on observation text. The whitespace that the canonical layout puts around a block
    (``"\\n"`` before, ``"\\n\\n"`` after) is NOT inside the span.

    Example: ``observation_spans("a<observation>x</observation>b") == [(1, 29)]``.
    """
    spans = []
    pos = 0
    while (start := text.find(OBSERVATION_OPEN, pos)) >= 0:
        close = text.find(OBSERVATION_CLOSE, start + len(OBSERVATION_OPEN))
        end = len(text) if close < 0 else close + len(OBSERVATION_CLOSE)
        spans.append((start, end))
        pos = end
    return spans
