"""Crawl server: ``python -m afm_core.tools.servers.crawl --port N [--llm-url U --llm-model M]``.

``POST /crawl_page`` ``{"urls": [str], "task": str, "summarize": bool}`` →
``{"pages": [{"url", "title", "text", "summary", "summary_error", "error", "blocked"}, ...], "processing_time": float}``.
Each URL is fetched with aiohttp (redirects followed, at most ``max_page_bytes``), its title and main text are
extracted in a process pool (:func:`~afm_core.tools.extract.extract_page`: trafilatura, Readability's title
rules), and with ``summarize`` an OpenAI-compatible ``/chat/completions`` endpoint summarises the page toward
``task`` (the upstream server does this with Jina Reader and a hosted Qwen2.5-72B: OPPO-PersonalAI/Agent_Foundation_Models,
``AFM/tool_servers/web_server/v2/crawl_page_server_v2.py``). A page that cannot be fetched gets ``error`` and no text; a failed
summary keeps the text and sets ``summary_error``. ``GET /health``.

Pages are fetched only from public addresses (:mod:`afm_core.tools.url_guard`: checked after DNS
resolution and again at every redirect, which the server follows itself) and from ``--allow`` entries; a
refused page gets ``blocked: true`` and an ``error`` that says why, and no request leaves the server.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from afm_core.tools.extract import extract_page
from afm_core.tools.serving import serve, server_parser, string_list_field, tool_app
from afm_core.tools.url_guard import BlockedAddressError, GuardedResolver, UrlGuard

SUMMARY_SYSTEM = "You are a summary agent robot."
SUMMARY_PROMPT = (
    "Task: {task}\n\n"
    'Web page {url} titled "{title}":\n{text}\n\n'
    "Extract everything on this page that helps with the task: (1) information that answers or bears on it, "
    "(2) clues and related facts worth following up, (3) relevant links. Be concise; say so if the page is irrelevant."
)


@dataclass
class CrawlConfig:
    """Fetch, extraction and summary settings (seconds, bytes, characters as named).

    ``allow``: addresses the guard lets through although they are not public (``UrlGuard`` entries).
    """

    fetch_timeout_s: float = 20.0
    max_redirects: int = 10
    allow: tuple[str, ...] = ()
    max_page_bytes: int = 5 << 20
    max_urls: int = 10
    extract_workers: int = 2
    llm_url: str | None = None
    llm_model: str | None = None
    llm_api_key: str | None = None
    llm_timeout_s: float = 120.0
    summary_input_chars: int = 16000


class PageError(Exception):
    """The page could not be fetched or read."""


class PageBlocked(PageError):
    """The URL, or a redirect, points at an address the guard refuses."""


class Crawler:
    """Fetches, extracts and summarises pages; owns the HTTP session and the extraction process pool."""

    def __init__(self, cfg: CrawlConfig) -> None:
        self.cfg = cfg
        self.guard = UrlGuard(cfg.allow)
        self.pages: aiohttp.ClientSession | None = None  # guarded: fetches what the model asks for
        self.session: aiohttp.ClientSession | None = None  # the configured summary endpoint
        self.pool: ProcessPoolExecutor | None = None

    async def start(self) -> None:
        self.pages = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256, limit_per_host=32, resolver=GuardedResolver(self.guard)),
            headers={"User-Agent": "afm-crawl/0.1"},
        )
        self.session = aiohttp.ClientSession(headers={"User-Agent": "afm-crawl/0.1"})
        # forkserver: workers do not inherit the event loop's threads
        self.pool = ProcessPoolExecutor(self.cfg.extract_workers, mp_context=multiprocessing.get_context("forkserver"))

    async def close(self) -> None:
        for session in (self.pages, self.session):
            if session is not None:
                await session.close()
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    async def fetch(self, url: str) -> tuple[str, str]:
        """``(html or text, content type)`` of ``url``, following redirects one hop at a time.

        Raises:
            PageBlocked: the URL or a redirect target is an address the guard refuses (nothing was sent there).
            PageError: network error, timeout, HTTP status >= 400, unsupported content type, too large, or
                too many redirects.
        """
        if self.pages is None:
            raise RuntimeError("Crawler.fetch before start()")
        try:
            async with asyncio.timeout(self.cfg.fetch_timeout_s):
                target = URL(url)
                for _ in range(self.cfg.max_redirects + 1):
                    self.guard.check_url(target)
                    async with self.pages.get(target, allow_redirects=False) as resp:
                        location = resp.headers.get("Location")
                        if resp.status in (301, 302, 303, 307, 308) and location:
                            target = target.join(URL(location))
                            continue
                        return await self._read(resp)
                raise PageError(f"more than {self.cfg.max_redirects} redirects")
        except BlockedAddressError as e:
            raise PageBlocked(str(e)) from e
        except TimeoutError as e:
            raise PageError(f"timed out after {self.cfg.fetch_timeout_s:g} s") from e
        except aiohttp.ClientConnectorError as e:
            if isinstance(e.os_error, BlockedAddressError):
                raise PageBlocked(str(e.os_error)) from e
            raise PageError(f"{e.__class__.__name__}: {e}") from e
        except (aiohttp.ClientError, LookupError, ValueError) as e:  # LookupError: unknown charset
            raise PageError(f"{e.__class__.__name__}: {e}") from e

    async def _read(self, resp: aiohttp.ClientResponse) -> tuple[str, str]:
        if resp.status >= 400:
            raise PageError(f"HTTP {resp.status}")
        ctype = resp.content_type or "text/html"
        if not (ctype.startswith("text/") or ctype in ("application/xhtml+xml", "application/xml")):
            raise PageError(f"unsupported content type {ctype}")
        data = bytearray()
        async for chunk in resp.content.iter_chunked(1 << 16):
            data += chunk
            if len(data) > self.cfg.max_page_bytes:
                raise PageError(f"page larger than {self.cfg.max_page_bytes} bytes")
        return data.decode(resp.get_encoding(), errors="replace"), ctype

    async def summarize(self, task: str, url: str, title: str, text: str) -> str:
        """A summary of the page toward ``task`` from the configured ``/chat/completions`` endpoint.

        Raises:
            PageError: the endpoint failed or answered without ``choices[0].message.content``.
        """
        prompt = SUMMARY_PROMPT.format(
            task=task or "(none given)", url=url, title=title, text=text[: self.cfg.summary_input_chars]
        )
        body = {
            "model": self.cfg.llm_model,
            "messages": [{"role": "system", "content": SUMMARY_SYSTEM}, {"role": "user", "content": prompt}],
            "temperature": 0.0,
        }
        if self.session is None or self.cfg.llm_url is None:
            raise RuntimeError("Crawler.summarize before start(), or without llm_url")
        headers = {"Authorization": f"Bearer {self.cfg.llm_api_key}"} if self.cfg.llm_api_key else None
        timeout = aiohttp.ClientTimeout(total=self.cfg.llm_timeout_s)
        try:
            async with self.session.post(
                self.cfg.llm_url.rstrip("/") + "/chat/completions", json=body, headers=headers, timeout=timeout
            ) as resp:
                answer = await resp.json(content_type=None)
                if resp.status >= 400:
                    raise PageError(f"summary endpoint HTTP {resp.status}: {str(answer)[:200]}")
            return answer["choices"][0]["message"]["content"]
        except TimeoutError as e:
            raise PageError(f"summary endpoint timed out after {self.cfg.llm_timeout_s:g} s") from e
        except (aiohttp.ClientError, json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            raise PageError(f"summary endpoint failed: {e.__class__.__name__}: {e}") from e

    async def crawl_one(self, url: str, task: str, summarize: bool) -> dict[str, Any]:
        page: dict[str, Any] = {
            "url": url,
            "title": "",
            "text": "",
            "summary": None,
            "summary_error": None,
            "error": None,
            "blocked": False,
        }
        try:
            body, ctype = await self.fetch(url)
        except PageError as e:
            page["error"] = str(e)
            page["blocked"] = isinstance(e, PageBlocked)
            return page
        if ctype == "text/plain":
            page["text"] = body
        else:
            loop = asyncio.get_running_loop()
            page["title"], page["text"] = await loop.run_in_executor(self.pool, extract_page, body, url)
        if summarize:
            try:
                page["summary"] = await self.summarize(task, url, page["title"], page["text"])
            except PageError as e:
                page["summary_error"] = str(e)
        return page


def build_app(cfg: CrawlConfig) -> web.Application:
    app = web.Application()
    crawler = Crawler(cfg)

    async def lifecycle(app: web.Application):
        await crawler.start()
        yield
        await crawler.close()

    async def crawl_page(request: web.Request) -> web.Response:
        start = time.perf_counter()
        body, urls = await string_list_field(request, "urls", cfg.max_urls)
        task = body.get("task") or ""
        if not isinstance(task, str):
            return web.json_response({"error": "field 'task' must be a string"}, status=400)
        summarize = bool(body.get("summarize", False))
        if summarize and not (cfg.llm_url and cfg.llm_model):
            return web.json_response(
                {"error": "field 'summarize' is true but this server has no --llm-url/--llm-model"}, status=400
            )
        pages = await asyncio.gather(*(crawler.crawl_one(u, task, summarize) for u in urls))
        return web.json_response({"pages": pages, "processing_time": round(time.perf_counter() - start, 4)})

    return tool_app(
        app,
        {"POST /crawl_page": crawl_page},
        lambda request: {"summaries": bool(cfg.llm_url and cfg.llm_model)},
        lifecycle,
    )


def main(argv: list[str] | None = None) -> None:
    parser = server_parser("afm_core.tools.servers.crawl", __doc__)
    defaults = CrawlConfig()
    parser.add_argument("--fetch-timeout-s", type=float, default=defaults.fetch_timeout_s)
    parser.add_argument("--max-urls", type=int, default=defaults.max_urls)
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        help="a non-public address the crawler may fetch: ADDRESS[/PREFIX], IPv4:PORT or [IPv6]:PORT (repeatable)",
    )
    parser.add_argument("--extract-workers", type=int, default=defaults.extract_workers, help="extraction processes")
    parser.add_argument(
        "--llm-url", default=None, help="OpenAI-compatible base URL for summaries, e.g. http://host:8000/v1"
    )
    parser.add_argument("--llm-model", default=None, help="model name sent to the summary endpoint")
    parser.add_argument(
        "--llm-api-key-env", default="SUMMARY_OPENAI_API_KEY", help="env var holding the endpoint's key"
    )
    args = parser.parse_args(argv)
    cfg = CrawlConfig(
        fetch_timeout_s=args.fetch_timeout_s,
        max_urls=args.max_urls,
        allow=tuple(args.allow),
        extract_workers=args.extract_workers,
        llm_url=args.llm_url,
        llm_model=args.llm_model,
        llm_api_key=os.environ.get(args.llm_api_key_env),
    )
    serve(build_app(cfg), args.host, args.port, args.ready_file)


if __name__ == "__main__":
    main()
