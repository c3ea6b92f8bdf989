"""A worked example of plug-ins (docs/plugins.md): a reward function and a tool, given by ``_target_``.

    python -m jobs.eval benchmark_files=[my.jsonl] reward_fn._target_=examples/plugins/my_plugins.py:partial_credit \
        +tools.tools.wiki_search._target_=examples.plugins.my_plugins.GlossarySearch

- :func:`partial_credit`: the built-in math grader, plus ``format_bonus`` for a well-formed CoA answer when the
  answer is wrong (the interface every plug-in reward has: ``(response, *, gold, question, meta, kind)``).
- :class:`GlossarySearch`: ``<wiki_search>`` answered from a small in-memory glossary instead of a retrieval
  server (a :class:`afm_core.tools.Tool`; no server needed, so no ``server``/``url`` key).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from afm_core.rewards import Grade, grade_format, grade_math
from afm_core.tools.base import Tool, ToolInputError
from afm_core.tools.http import ToolHttp


def partial_credit(response: str, *, gold: str, question: str, meta: dict[str, Any], kind: str,
                   format_bonus: float = 0.1) -> Grade:  # fmt: skip
    """1 for a correct answer (math-verify); ``format_bonus`` for a wrong one in valid CoA format; else 0."""
    grade = grade_math(response, gold)
    if grade.score > 0 or grade_format(response).score == 0:
        return grade
    return Grade(format_bonus, "format_only", extra={"base_reason": grade.reason})


class GlossarySearch(Tool):
    """``<wiki_search>term</wiki_search>`` -> the glossary entries whose term appears in the query.

    Args:
        entries: ``{term: definition}``; a default science glossary when None.
        topk: entries per answer.
    """

    name = "wiki_search"
    duplicate_observation = "I have searched for this before; I should try another query."

    def __init__(self, entries: Mapping[str, str] | None = None, topk: int = 3):
        self.entries = dict(entries or {"photosynthesis": "How plants turn light, water and CO2 into sugar.",
                                        "mitochondria": "The organelles that make a cell's ATP."})  # fmt: skip
        self.topk = topk

    def parse(self, content: str) -> str:
        query = content.strip()
        if not query:
            raise ToolInputError("empty search query")
        return query

    async def call(self, args: Any, http: ToolHttp, context: Mapping[str, str]) -> str:
        hits = [f"Doc {i} (Title: {term})\n{text}"
                for i, (term, text) in enumerate(((t, d) for t, d in self.entries.items() if t in args.lower()), 1)]  # fmt: skip
        return "\n---\n".join(hits[: self.topk]) or "No results."
