"""``<web_search>``: a client of the Serper search API (``POST /search``).

Request ``{"q": query, "num": n}`` with header ``X-API-KEY``; answer ``{"organic": [{"title", "link",
"snippet", "date"?, "source"?}, ...]}``. The observation follows the upstream ``SerperCacheAPITool``
(OPPO-PersonalAI/Agent_Foundation_Models, ``verl/verl/tools/web_search_v2.py``): ``Found N results:\\n\\n## Web Results\\n1. [title](link)``
then the optional ``Date published:`` / ``Source:`` lines, the link and the snippet; or ``No results found
for query: '…'. Use a less specific query.``

``base_url`` may be Serper itself (``https://google.serper.dev``), an upstream-style caching proxy, or the
offline server :mod:`afm_core.tools.servers.web_search`, which speaks the same API over a local corpus.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from afm_core.tools.base import Tool, ToolError, search_query
from afm_core.tools.http import ToolHttp
from afm_core.tools.wiki_search import REPEATED_SEARCH


def format_results(query: str, organic: list[dict]) -> str:
    """The upstream observation text for Serper ``organic`` results."""
    if not organic:
        return f"No results found for query: '{query}'. Use a less specific query."
    entries = []
    for i, page in enumerate(organic, 1):
        date = f"\nDate published: {page['date']}" if page.get("date") else ""
        source = f"\nSource: {page['source']}" if page.get("source") else ""
        snippet = f"\n{page['snippet']}" if page.get("snippet") else ""
        entries.append(f"{i}. [{page.get('title', '')}]({page['link']}){date}{source}\n{page['link']}{snippet}")
    return f"Found {len(organic)} results:\n\n## Web Results\n" + "\n\n".join(entries)


class WebSearchTool(Tool):
    """Client of a Serper-style ``/search`` endpoint.

    Args:
        base_url: e.g. ``https://google.serper.dev`` or ``http://127.0.0.1:9001``.
        num_results: results requested per query (upstream default 10).
        api_key_env: environment variable holding the ``X-API-KEY`` value (unset: no header).
    """

    name = "web_search"
    duplicate_observation = REPEATED_SEARCH

    def __init__(self, base_url: str, num_results: int = 10, api_key_env: str = "WEB_SEARCH_SERPER_API_KEY") -> None:
        self.url = base_url.rstrip("/") + "/search"
        self.num_results = num_results
        self.api_key_env = api_key_env

    def parse(self, content: str) -> str:
        return search_query(content, self.coa_tag)

    def cache_key(self, args: str, context: Mapping[str, str]) -> str:
        return json.dumps({"query": args, "num": self.num_results}, ensure_ascii=False)

    async def call(self, args: str, http: ToolHttp, context: Mapping[str, str]) -> str:
        key = os.environ.get(self.api_key_env)
        headers = {"X-API-KEY": key} if key else None
        answer = await http.request_json(
            "POST", self.url, json_body={"q": args, "num": self.num_results}, headers=headers
        )
        organic = answer.get("organic", []) if isinstance(answer, dict) else None
        if not isinstance(organic, list) or not all(
            isinstance(p, dict) and isinstance(p.get("link"), str) for p in organic
        ):
            raise ToolError("bad_response", f"search answer has no valid 'organic' list: {str(answer)[:200]}")
        return format_results(args, organic[: self.num_results])
