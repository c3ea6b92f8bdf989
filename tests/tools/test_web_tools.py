"""web_search and crawl_page end to end on the offline backends (pages, crawl, Serper-style search servers),
with Mozilla Readability's test pages as the local web (acceptance e), and page summaries through an
OpenAI-compatible endpoint."""

from __future__ import annotations

import asyncio
import collections
import json
import re

import aiohttp
import lxml.html
import pytest
from aiohttp import web

from afm_core.tools import CrawlPageTool, ToolLimits, ToolPool, WebSearchTool
from afm_core.tools.crawl_page import REPEATED_CRAWL, parse_urls
from afm_core.tools.base import ToolInputError
from afm_core.tools.http import ToolHttp
from afm_core.tools.metrics import ToolMetrics
from afm_core.tools.launcher import ServerGroup
from afm_core.tools.servers import crawl as crawl_server
from afm_core.tools.servers import pages as pages_server
from afm_core.tools.web_search import format_results
from tests.tools.conftest import serve_app


def tokens(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def token_f1(predicted: str, expected: str) -> float:
    p, e = collections.Counter(tokens(predicted)), collections.Counter(tokens(expected))
    common = sum((p & e).values())
    return 0.0 if common == 0 else 2 * common / (sum(p.values()) + sum(e.values()))


@pytest.fixture(scope="module")
def readability(data_dir):
    folder = data_dir / "webpages" / "readability"
    pages = sorted(p.name for p in folder.iterdir() if (p / "source.html").exists())
    return folder, pages


@pytest.fixture(scope="module")
def servers(data_dir, readability, tmp_path_factory):
    folder, _ = readability
    corpus = data_dir / "mhqa" / "hotpotqa500" / "corpus.jsonl"
    with ServerGroup(log_dir=tmp_path_factory.mktemp("web")) as group:
        group.launch("pages", ["--pages", str(folder), "--corpus", str(corpus)])
        group.launch("crawl", ["--extract-workers", "2"])
        pages_url = group.wait(["pages"])["pages"]
        search_args = ["--pages", str(folder), "--corpus", str(corpus), "--link-base", pages_url, "--api-key-env", "SEARCH_KEY"]
        group.launch("web_search", search_args, env={"SEARCH_KEY": "k"})
        yield group.wait()


def test_crawl_titles_and_main_text_match_readability(servers, readability):
    folder, names = readability
    tool = CrawlPageTool(servers["crawl"], max_urls=10)

    async def main():
        async with aiohttp.ClientSession() as session:
            http = ToolHttp(session, ToolLimits(timeout_s=120), ToolMetrics())
            batches = [names[i : i + 8] for i in range(0, len(names), 8)]
            results = await asyncio.gather(*(tool.crawl([f"{servers['pages']}/pages/{n}" for n in b], http) for b in batches))
            return [page for batch in results for page in batch]

    pages = asyncio.run(main())
    titles_ok, f1s = 0, []
    for name, page in zip(names, pages):
        assert page["error"] is None, page
        expected_title = json.loads((folder / name / "expected-metadata.json").read_text())["title"]
        titles_ok += page["title"] == expected_title
        expected_text = lxml.html.fromstring((folder / name / "expected.html").read_bytes()).text_content()
        f1s.append(token_f1(page["text"], expected_text))
    good_f1 = sum(f >= 0.8 for f in f1s)
    print(f"crawl_page on {len(names)} readability pages: titles {titles_ok}/{len(names)}, F1>=0.8 on {good_f1}/{len(names)}")
    assert len(names) == 24
    assert titles_ok >= 0.9 * len(names)
    assert good_f1 >= 0.8 * len(names)


def test_search_then_crawl_offline(servers, monkeypatch):
    monkeypatch.setenv("WEB_SEARCH_SERPER_API_KEY", "k")

    async def main():
        tools = [WebSearchTool(servers["web_search"], num_results=3), CrawlPageTool(servers["crawl"], max_chars_per_page=300)]
        async with ToolPool(tools) as pool:
            found = await pool.call("web_search", "Hermitian matrix complex conjugate transpose", "t")
            link = re.search(r"\]\((http[^)]+)\)", found).group(1)
            crawled = await pool.call("crawl_page", f"[first]({link}) | {servers['pages']}/pages/no-such-page", "t")
            again = await pool.call("crawl_page", f"{link} | {servers['pages']}/pages/no-such-page", "t")
            hotpot = await pool.call("web_search", "Shirley Temple Chief of Protocol", "t")
            doc_link = re.search(r"\]\((http[^)]+/doc/[^)]+)\)", hotpot).group(1)
            doc = await pool.call("crawl_page", doc_link, "t")
        return found, crawled, again, hotpot, doc

    found, crawled, again, hotpot, doc = asyncio.run(main())
    assert found.startswith("Found 3 results:\n\n## Web Results\n1. [Hermitian matrix](") and "/pages/wikipedia-3)" in found
    assert crawled.startswith(f"Page 1 [{found.split('](')[1].split(')')[0]}] Title: Hermitian matrix\n")
    assert "[... page truncated at 300 characters ...]" in crawled
    assert "Page 2 [" in crawled and "[Page content not accessible: HTTP 404]" in crawled
    assert again == REPEATED_CRAWL
    assert "Shirley Temple" in hotpot and "Title: Shirley Temple\n" in doc and "Shirley Temple Black (April 23, 1928" in doc


def test_search_api_key_and_bad_requests(servers, monkeypatch):
    monkeypatch.delenv("WEB_SEARCH_SERPER_API_KEY", raising=False)

    async def main():
        async with ToolPool([WebSearchTool(servers["web_search"])], default_limits=ToolLimits(retries=0)) as pool:
            return await pool.call("web_search", "anything")

    assert asyncio.run(main()).startswith("[web_search error: http_4xx] HTTP 403")


def test_parsing_and_formats():
    assert parse_urls("http://a/x | [t](https://b/y) | see http://c/z now | http://a/x", 5) == ["http://a/x", "https://b/y", "http://c/z"]
    with pytest.raises(ToolInputError, match="no http"):
        parse_urls("http://a | just words", 5)
    with pytest.raises(ToolInputError, match="at most 2"):
        parse_urls("http://a | http://b | http://c", 2)
    assert format_results("q", []) == "No results found for query: 'q'. Use a less specific query."
    one = format_results("q", [{"title": "T", "link": "http://l", "snippet": "S", "date": "2020"}])
    assert one == "Found 1 results:\n\n## Web Results\n1. [T](http://l)\nDate published: 2020\nhttp://l\nS"


def test_summaries_through_an_openai_compatible_endpoint(readability):
    """The crawl server asks /chat/completions for a summary toward the task (an LLM stand-in answers)."""
    folder, _ = readability
    requests = []

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        requests.append(body)
        if "fail" in body["messages"][1]["content"].split("Task:")[1].split("\n")[0]:
            return web.json_response({"error": "overloaded"}, status=503)
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "SUMMARY of the page"}}]})

    llm = web.Application()
    llm.router.add_post("/v1/chat/completions", chat)

    async def main():
        async with serve_app(llm) as llm_url, serve_app(pages_server.build_app(pages_server.find_pages(folder), [])) as pages_url:
            cfg = crawl_server.CrawlConfig(llm_url=llm_url + "/v1", llm_model="stub", extract_workers=1)
            async with serve_app(crawl_server.build_app(cfg)) as crawl_url:
                async with ToolPool([CrawlPageTool(crawl_url, summarize=True)]) as pool:
                    url = f"{pages_url}/pages/wikipedia-3"
                    ok = await pool.call("crawl_page", url, context={"task": "What is a Hermitian matrix?"})
                    failed = await pool.call("crawl_page", url, context={"task": "fail please"})
        return ok, failed

    ok, failed = asyncio.run(main())
    assert ok == f"Page 1 [{ok.split('[')[1].split(']')[0]}] Summary:\nSUMMARY of the page"
    prompt = requests[0]["messages"][1]["content"]
    assert requests[0]["model"] == "stub" and "What is a Hermitian matrix?" in prompt and "Hermitian" in prompt.split("titled")[1]
    assert "Title: Hermitian matrix" in failed  # a failed summary falls back to the extracted text
