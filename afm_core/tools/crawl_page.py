"""``<crawl_page>``: fetch pages through the crawl server and report their main text (or a summary).

The tag holds URLs separated by ``|`` (upstream ``CrawlPageV2Tool``); each part may be a bare URL, a
markdown link ``[title](url)`` or text containing a URL. The crawl server
(:mod:`afm_core.tools.servers.crawl`) fetches the pages with aiohttp, extracts title and main text with
trafilatura, and, when ``summarize`` is on, asks an OpenAI-compatible LLM for a summary toward the task
(the trajectory's ``context["task"]``). Observation per page, joined by blank lines, as upstream:
``Page i [url] Summary:\\n…``; without summaries ``Page i [url] Title: …\\n<main text>``; a failed page
gives ``Page i [url]: [Page content not accessible: …]``. The crawl server refuses non-public addresses
(:mod:`afm_core.tools.url_guard`); when it refuses every URL of a call, the call fails with a ``blocked_url``
error observation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from afm_core.tools.base import Tool, ToolError, ToolInputError
from afm_core.tools.http import ToolHttp

REPEATED_CRAWL = (
    "I have crawled the same page(s) before. "
    "To find new information, I should crawl different pages or search with a different query."
)
_MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\((https?://[^)\s]+)\)")
_URL = re.compile(r"https?://[^\s<>\"'|]+")


def parse_urls(content: str, max_urls: int) -> list[str]:
    """URLs from a ``<crawl_page>`` tag's content (split on ``|``; duplicates dropped, order kept).

    Raises:
        ToolInputError: a part holds no http(s) URL, there is none at all, or more than ``max_urls``.
    """
    urls: list[str] = []
    for part in content.split("|"):
        part = part.strip()
        if not part:
            continue
        match = _MARKDOWN_LINK.search(part) or _URL.search(part)
        if match is None:
            raise ToolInputError(
                f"no http(s) URL in crawl_page part {part[:100]!r}; write <crawl_page>url_1 | url_2</crawl_page>"
            )
        url = match.group(1) if match.re is _MARKDOWN_LINK else match.group(0)
        if url not in urls:
            urls.append(url)
    if not urls:
        raise ToolInputError("no URL given; write <crawl_page>url_1 | url_2</crawl_page>")
    if len(urls) > max_urls:
        raise ToolInputError(f"{len(urls)} URLs given; crawl at most {max_urls} at once")
    return urls


def format_pages(pages: list[dict], max_chars_per_page: int) -> str:
    """The observation for the crawl server's ``pages`` list."""
    blocks = []
    for i, page in enumerate(pages, 1):
        url = page["url"]
        if page.get("error"):
            blocks.append(f"Page {i} [{url}]: [Page content not accessible: {page['error']}]")
        elif page.get("summary"):
            blocks.append(f"Page {i} [{url}] Summary:\n{page['summary'].strip()}")
        else:
            text = page.get("text") or ""
            if len(text) > max_chars_per_page:
                text = text[:max_chars_per_page] + f"\n[... page truncated at {max_chars_per_page} characters ...]"
            blocks.append(f"Page {i} [{url}] Title: {page.get('title') or ''}\n{text}")
    return "\n\n".join(blocks)


class CrawlPageTool(Tool):
    """Client of a crawl server's ``POST /crawl_page``.

    Args:
        base_url: the crawl server, e.g. ``http://127.0.0.1:9000``.
        summarize: ask the server for LLM summaries toward ``context["task"]`` (needs its LLM endpoint).
        max_urls: URLs accepted in one call.
        max_chars_per_page: main-text characters kept per page when not summarising.
    """

    name = "crawl_page"
    duplicate_observation = REPEATED_CRAWL

    def __init__(
        self, base_url: str, summarize: bool = False, max_urls: int = 10, max_chars_per_page: int = 8000
    ) -> None:
        self.url = base_url.rstrip("/") + "/crawl_page"
        self.summarize, self.max_urls, self.max_chars_per_page = summarize, max_urls, max_chars_per_page

    def parse(self, content: str) -> list[str]:
        return parse_urls(content, self.max_urls)

    def cache_key(self, args: list[str], context: Mapping[str, str]) -> str:
        task = context.get("task", "") if self.summarize else ""
        return json.dumps(
            {"urls": args, "task": task, "summarize": self.summarize, "chars": self.max_chars_per_page},
            ensure_ascii=False,
        )

    async def call(self, args: list[str], http: ToolHttp, context: Mapping[str, str]) -> str:
        pages = await self.crawl(args, http, context.get("task", ""))
        if all(page.get("blocked") for page in pages):
            raise ToolError("blocked_url", "; ".join(page["error"] for page in pages))
        return format_pages(pages, self.max_chars_per_page)

    async def crawl(self, urls: list[str], http: ToolHttp, task: str = "") -> list[dict]:
        """The crawl server's per-page records ``{"url", "title", "text", "summary", "error"}``.

        Raises:
            ToolError: ``bad_response`` when the answer has no ``pages`` list of the right length.
        """
        body = {"urls": urls, "task": task, "summarize": self.summarize}
        answer = await http.request_json("POST", self.url, json_body=body)
        pages = answer.get("pages") if isinstance(answer, dict) else None
        if (
            not isinstance(pages, list)
            or len(pages) != len(urls)
            or not all(isinstance(p, dict) and "url" in p for p in pages)
        ):
            raise ToolError(
                "bad_response", f"crawl answer has no 'pages' list for {len(urls)} URLs: {str(answer)[:200]}"
            )
        return pages
