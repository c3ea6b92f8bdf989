"""The Chain-of-Agents tag vocabulary (afm-reference §2.1).

A CoA trajectory is a sequence of blocks ``<tag>content</tag>``:

* role blocks, written by the model playing a "function": think, plan, reflection,
  suggested_answer, double_check, answer;
* tool calls, one tag per tool, the content being the tool's single string argument ``query``:
  web_search, crawl_page, wiki_search, code;
* observations, the tool output, written by the environment, never trained on: observation.

Upstream also has ``visual_inspector`` (a multimodal tool); it is not part of this vocabulary.
"""

from __future__ import annotations

ROLE_TAGS: tuple[str, ...] = ("think", "plan", "reflection", "suggested_answer", "double_check", "answer")
TOOL_TAGS: tuple[str, ...] = ("web_search", "crawl_page", "wiki_search", "code")
OBSERVATION_TAG = "observation"
ALL_TAGS: tuple[str, ...] = (*ROLE_TAGS, *TOOL_TAGS, OBSERVATION_TAG)


def tag_kind(tag: str) -> str:
    """``"role"``, ``"tool"`` or ``"observation"``.

    Raises:
        ValueError: ``tag`` is not in :data:`ALL_TAGS`.
    """
    if tag in ROLE_TAGS:
        return "role"
    if tag in TOOL_TAGS:
        return "tool"
    if tag == OBSERVATION_TAG:
        return "observation"
    raise ValueError(f"unknown CoA tag {tag!r}; known tags: {', '.join(ALL_TAGS)}")
