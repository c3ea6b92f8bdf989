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

from afm_core.tools import CrawlPageTool, ToolLimits, ToolPool, WebSearchTool, WikiSearchTool
from afm_core.tools.base import ToolInputError, search_query
from afm_core.tools.crawl_page import REPEATED_CRAWL, parse_urls
from afm_core.tools.http import ToolHttp
from afm_core.tools.launcher import ServerGroup, allow_entry
from afm_core.tools.metrics import ToolMetrics
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
        pages_url = group.wait(["pages"])["pages"]
        group.launch("crawl", ["--extract-workers", "2", "--allow", allow_entry(pages_url)])
        search_args = [
            "--pages",
            str(folder),
            "--corpus",
            str(corpus),
            "--link-base",
            pages_url,
            "--api-key-env",
            "SEARCH_KEY",
        ]
        group.launch("web_search", search_args, env={"SEARCH_KEY": "k"})
        yield group.wait()


def test_crawl_titles_and_main_text_match_readability(servers, readability):
    folder, names = readability
    tool = CrawlPageTool(servers["crawl"], max_urls=10)

    async def main():
        async with aiohttp.ClientSession() as session:
            http = ToolHttp(session, ToolLimits(timeout_s=120), ToolMetrics())
            batches = [names[i : i + 8] for i in range(0, len(names), 8)]
            results = await asyncio.gather(
                *(tool.crawl([f"{servers['pages']}/pages/{n}" for n in b], http) for b in batches)
            )
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
    print(
        f"crawl_page on {len(names)} readability pages: titles {titles_ok}/{len(names)}, F1>=0.8 on {good_f1}/{len(names)}"
    )
    assert len(names) == 24
    assert titles_ok >= 0.9 * len(names)
    assert good_f1 >= 0.8 * len(names)


def test_search_then_crawl_offline(servers, monkeypatch):
    monkeypatch.setenv("WEB_SEARCH_SERPER_API_KEY", "k")

    async def main():
        tools = [
            WebSearchTool(servers["web_search"], num_results=3),
            CrawlPageTool(servers["crawl"], max_chars_per_page=300),
        ]
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
    assert (
        found.startswith("Found 3 results:\n\n## Web Results\n1. [Hermitian matrix](")
        and "/pages/wikipedia-3)" in found
    )
    assert crawled.startswith(f"Page 1 [{found.split('](')[1].split(')')[0]}] Title: Hermitian matrix\n")
    assert "[... page truncated at 300 characters ...]" in crawled
    assert "Page 2 [" in crawled and "[Page content not accessible: HTTP 404]" in crawled
    assert again == REPEATED_CRAWL
    assert (
        "Shirley Temple" in hotpot
        and "Title: Shirley Temple\n" in doc
        and "Shirley Temple Black (April 23, 1928" in doc
    )


def test_search_api_key_and_bad_requests(servers, monkeypatch):
    monkeypatch.delenv("WEB_SEARCH_SERPER_API_KEY", raising=False)

    async def main():
        async with ToolPool([WebSearchTool(servers["web_search"])], default_limits=ToolLimits(retries=0)) as pool:
            return await pool.call("web_search", "anything")

    assert asyncio.run(main()).startswith("[web_search error: http_4xx] HTTP 403")


def test_parsing_and_formats():
    assert parse_urls("http://a/x | [t](https://b/y) | see http://c/z now | http://a/x", 5) == [
        "http://a/x",
        "https://b/y",
        "http://c/z",
    ]
    with pytest.raises(ToolInputError, match="no http"):
        parse_urls("http://a | just words", 5)
    with pytest.raises(ToolInputError, match="at most 2"):
        parse_urls("http://a | http://b | http://c", 2)
    assert format_results("q", []) == "No results found for query: 'q'. Use a less specific query."
    one = format_results("q", [{"title": "T", "link": "http://l", "snippet": "S", "date": "2020"}])
    assert one == "Found 1 results:\n\n## Web Results\n1. [T](http://l)\nDate published: 2020\nhttp://l\nS"


def test_both_search_tools_clean_a_query_with_the_one_cleaner():
    """``<web_search>`` and ``<wiki_search>`` read their tag's content through :func:`search_query`: runs of
    whitespace (newlines too) are one space, and an empty query names the call to write."""
    assert search_query("  capital of\n France ", "web_search") == "capital of France"
    web, wiki = WebSearchTool("http://x"), WikiSearchTool("http://x")
    assert web.parse("  capital of\n France ") == wiki.parse("capital  of France") == "capital of France"
    for tool in (web, wiki):
        with pytest.raises(ToolInputError, match=f"empty {tool.name} query; write <{tool.name}>your query"):
            tool.parse(" \n ")


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
        async with (
            serve_app(llm) as llm_url,
            serve_app(pages_server.build_app(pages_server.find_pages(folder), [])) as pages_url,
        ):
            cfg = crawl_server.CrawlConfig(
                llm_url=llm_url + "/v1", llm_model="stub", extract_workers=1, allow=(allow_entry(pages_url),)
            )
            async with serve_app(crawl_server.build_app(cfg)) as crawl_url:
                async with ToolPool([CrawlPageTool(crawl_url, summarize=True)]) as pool:
                    url = f"{pages_url}/pages/wikipedia-3"
                    ok = await pool.call("crawl_page", url, context={"task": "What is a Hermitian matrix?"})
                    failed = await pool.call("crawl_page", url, context={"task": "fail please"})
        return ok, failed

    ok, failed = asyncio.run(main())
    assert ok == f"Page 1 [{ok.split('[')[1].split(']')[0]}] Summary:\nSUMMARY of the page"
    prompt = requests[0]["messages"][1]["content"]
    assert (
        requests[0]["model"] == "stub"
        and "What is a Hermitian matrix?" in prompt
        and "Hermitian" in prompt.split("titled")[1]
    )
    assert "Title: Hermitian matrix" in failed  # a failed summary falls back to the extracted text


class Victim:
    """A local server standing in for the sandbox (``POST /run``) and the tool servers; counts what reaches it."""

    def __init__(self) -> None:
        self.hits = 0

    def app(self) -> web.Application:
        async def anything(request: web.Request) -> web.Response:
            self.hits += 1
            return web.Response(
                text="<html><title>secret</title><body>internal answer</body></html>", content_type="text/html"
            )

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", anything)
        return app


def redirector(target: str) -> web.Application:
    async def go(request: web.Request) -> web.Response:
        raise web.HTTPFound(target)

    app = web.Application()
    app.router.add_get("/go", go)
    return app


def test_crawl_refuses_loopback_private_and_metadata_addresses(servers, tmp_path):
    """SSRF: the sandbox-like local server, the metadata address, a host name resolving to loopback, a mapped
    IPv6 form, and an allowed URL that redirects to loopback all give error observations, and no request
    reaches the local server. Allow-listed servers (the pages server, the redirector) stay reachable."""
    from afm_core.utils.ports import free_port

    redirector_port = free_port()
    with ServerGroup(log_dir=tmp_path) as group:
        group.launch("crawl", ["--allow", allow_entry(servers["pages"]), "--allow", f"127.0.0.1:{redirector_port}"])
        crawl_url = group.wait()["crawl"]

        async def main():
            victim = Victim()
            async with serve_app(victim.app()) as victim_url:
                port = victim_url.rsplit(":", 1)[1]
                runner = web.AppRunner(redirector(f"{victim_url}/run"))
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", redirector_port).start()
                try:
                    tool = CrawlPageTool(crawl_url)
                    async with ToolPool([tool], default_limits=ToolLimits(retries=0, cache_ttl_s=None)) as pool:
                        refused = {
                            name: await pool.call("crawl_page", url)
                            for name, url in {
                                "sandbox": f"{victim_url}/run",
                                "metadata": "http://169.254.169.254/latest/meta-data/",
                                "localhost": f"http://localhost:{port}/run",
                                "mapped": f"http://[::ffff:127.0.0.1]:{port}/run",
                                "redirect": f"http://127.0.0.1:{redirector_port}/go",
                            }.items()
                        }
                        mixed = await pool.call(
                            "crawl_page", f"{servers['pages']}/pages/wikipedia-3 | {victim_url}/run"
                        )
                        snapshot = pool.metrics_snapshot()["crawl_page"]
                finally:
                    await runner.cleanup()
            return refused, mixed, snapshot, victim.hits

        refused, mixed, snapshot, hits = asyncio.run(main())
    for name, observation in refused.items():
        assert observation.startswith("[crawl_page error: blocked_url] ") and "refused" in observation, (
            name,
            observation,
        )
    assert "a loopback address" in refused["sandbox"] and "link-local" in refused["metadata"]
    assert "localhost resolves only to refused addresses" in refused["localhost"]
    assert "a loopback address" in refused["redirect"]
    assert mixed.startswith("Page 1 [") and "Title: Hermitian matrix" in mixed
    assert "Page 2 [" in mixed and "[Page content not accessible: refused to fetch 127.0.0.1" in mixed
    assert snapshot["errors"] == {"blocked_url": 5}
    assert hits == 0


def test_url_guard_addresses_and_allow_list():
    import ipaddress

    from yarl import URL

    from afm_core.tools.url_guard import BlockedAddressError, UrlGuard, refusal

    for address in (
        "127.0.0.1",
        "::1",
        "10.1.2.3",
        "192.168.0.1",
        "172.16.0.1",
        "169.254.169.254",
        "fe80::1",
        "fd00:ec2::254",
        "100.100.100.200",
        "0.0.0.0",
        "224.0.0.1",
        "::ffff:10.0.0.1",
    ):
        assert refusal(ipaddress.ip_address(address)) is not None, address
    assert refusal(ipaddress.ip_address("8.8.8.8")) is None and refusal(ipaddress.ip_address("2606:4700::1111")) is None
    guard = UrlGuard(["127.0.0.1:8080", "10.1.0.0/16", "[::1]:9000"])
    guard.check_url(URL("http://127.0.0.1:8080/x"))
    guard.check_url(URL("http://10.1.200.3:1234/"))
    guard.check_url(URL("http://[::1]:9000/"))
    guard.check_url(URL("https://example.org/"))  # a host name: checked at resolution
    for url in (
        "http://127.0.0.1:8081/",
        "http://10.2.0.1/",
        "http://[::1]:9001/",
        "file:///etc/passwd",
        "gopher://x/",
    ):
        with pytest.raises(BlockedAddressError):
            guard.check_url(URL(url))
    with pytest.raises(ValueError, match="allow-list entry 'nonsense'"):
        UrlGuard(["nonsense"])
