"""``<wiki_search>``: query a retrieval server (``/retrieve``, the Search-R1/AFM wiki RAG API).

Request ``{"queries": [q], "topk": k, "return_scores": true}``; answer
``{"result": [[{"document": {"id", "title", "contents"}, "score"}, ...]]}``. The observation lists the
passages as ``Doc i (Title: <first line of contents>)\\n<rest>``, joined by ``\\n---\\n`` (upstream
``SearchTool`` in OPPO-PersonalAI/Agent_Foundation_Models, ``verl/verl/tools/search_tool.py``). The offline server is
:mod:`afm_core.tools.servers.wiki`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from afm_core.tools.base import Tool, ToolError, search_query
from afm_core.tools.http import ToolHttp

#: Upstream's canned answer to a repeated search query in one trajectory (rollout duplicate guard).
REPEATED_SEARCH = (
    "I have performed a web search with the same query before. "
    "To find new information, I should try a more diverse or specific search query."
)


def format_passages(hits: list[dict]) -> str:
    """``Doc i (Title: t)\\ntext`` blocks joined by ``\\n---\\n``; the title is the first line of ``contents``."""
    blocks = []
    for i, hit in enumerate(hits, 1):
        contents = hit["document"]["contents"]
        title, _, text = contents.partition("\n")
        blocks.append(f"Doc {i} (Title: {title.strip()})\n{text.strip()}")
    return "\n---\n".join(blocks)


class WikiSearchTool(Tool):
    """Client of a ``/retrieve`` server.

    Args:
        base_url: the retrieval server, e.g. ``http://127.0.0.1:8000``.
        topk: passages per query (upstream MHQA default: 3).
    """

    name = "wiki_search"
    duplicate_observation = REPEATED_SEARCH

    def __init__(self, base_url: str, topk: int = 3) -> None:
        self.url = base_url.rstrip("/") + "/retrieve"
        self.topk = topk

    def parse(self, content: str) -> str:
        return search_query(content, self.coa_tag)

    def cache_key(self, args: str, context: Mapping[str, str]) -> str:
        return json.dumps({"query": args, "topk": self.topk}, ensure_ascii=False)

    async def call(self, args: str, http: ToolHttp, context: Mapping[str, str]) -> str:
        hits = await self.retrieve(args, http)
        if not hits:
            return f"No passages found for query: '{args}'. Use a different query."
        return format_passages(hits)

    async def retrieve(self, query: str, http: ToolHttp) -> list[dict]:
        """The raw hits ``[{"document": {...}, "score": float}, ...]`` for one query, best first.

        Raises:
            ToolError: ``bad_response`` when the answer does not have the ``/retrieve`` shape.
        """
        body = {"queries": [query], "topk": self.topk, "return_scores": True}
        answer = await http.request_json("POST", self.url, json_body=body)
        result = answer.get("result") if isinstance(answer, dict) else None
        hits = result[0] if isinstance(result, list) and result else None
        if not isinstance(hits, list) or not all(
            isinstance(h, dict)
            and isinstance(h.get("document"), dict)
            and isinstance(h["document"].get("contents"), str)
            for h in hits
        ):
            raise ToolError(
                "bad_response", f"retrieval answer is not {{'result': [[{{'document': ...}}]]}}: {str(answer)[:200]}"
            )
        return hits
