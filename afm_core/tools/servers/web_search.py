"""Offline web search speaking the Serper API: ``python -m afm_core.tools.servers.web_search --corpus C ...``.

``POST /search`` ``{"q": str, "num": int}`` (header ``X-API-KEY`` checked only with ``--api-key-env``) →
``{"searchParameters": {...}, "organic": [{"title", "link", "snippet", "position"}, ...]}``, ranked by BM25
over the documents. ``GET /health``.

Documents come from a JSON-lines corpus (``--corpus``; a document's link is its ``url`` field or
``<link-base>/doc/<id>``, which :mod:`afm_core.tools.servers.pages` serves) and/or from a folder of HTML pages
(``--pages`` with ``--link-base``: title and main text extracted, linked as ``<link-base>/pages/<name>``), so
that every result can be crawled offline.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from aiohttp import web

from afm_core.tools.extract import extract_page
from afm_core.tools.retrieval import BM25Retriever, Document, load_corpus
from afm_core.tools.servers.pages import find_pages
from afm_core.tools.serving import serve, server_parser, tool_app

MAX_NUM = 100
SNIPPET_CHARS = 250


def link_documents(docs: list[Document], link_base: str | None) -> list[Document]:
    """Give every document a link (its own ``url``, else ``<link_base>/doc/<id>``).

    Raises:
        ValueError: a document has no ``url`` and no ``link_base`` was given.
    """
    linked = []
    for doc in docs:
        if doc.url:
            linked.append(doc)
        elif link_base is None:
            raise ValueError(f"document {doc.id!r} has no 'url' field; give --link-base (the pages server)")
        else:
            linked.append(Document(doc.id, doc.title, doc.contents, f"{link_base.rstrip('/')}/doc/{doc.id}"))
    return linked


def page_documents(pages_dir: Path, link_base: str) -> list[Document]:
    """One document per HTML page (title and main text by :func:`~afm_core.tools.extract.extract_page`)."""
    docs = []
    for name, path in find_pages(pages_dir).items():
        title, text = extract_page(path.read_text(encoding="utf-8", errors="replace"))
        docs.append(Document(f"page:{name}", title, f"{title}\n{text}", f"{link_base.rstrip('/')}/pages/{name}"))
    return docs


def snippet(doc: Document) -> str:
    """The first ``SNIPPET_CHARS`` characters of the body (title line dropped), cut at a word."""
    first, _, rest = doc.contents.partition("\n")
    text = " ".join((rest or first).split())
    if len(text) <= SNIPPET_CHARS:
        return text
    return text[:SNIPPET_CHARS].rsplit(" ", 1)[0] + " ..."


def build_app(retriever: BM25Retriever, api_key: str | None = None) -> web.Application:
    app = web.Application()

    async def search(request: web.Request) -> web.Response:
        if api_key is not None and request.headers.get("X-API-KEY") != api_key:
            return web.json_response(
                {"message": "Unauthorized: missing or wrong X-API-KEY", "statusCode": 403}, status=403
            )
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return web.json_response({"message": f"body is not valid JSON: {e}", "statusCode": 400}, status=400)
        query = body.get("q") if isinstance(body, dict) else None
        if not isinstance(query, str) or not query.strip():
            return web.json_response({"message": "field 'q' must be a non-empty string", "statusCode": 400}, status=400)
        num = body.get("num", 10)
        if isinstance(num, bool) or not isinstance(num, int) or not 1 <= num <= MAX_NUM:
            return web.json_response(
                {"message": f"field 'num' must be an integer in [1, {MAX_NUM}]", "statusCode": 400}, status=400
            )
        hits = retriever.search([query], num)[0]
        organic = [
            {"title": doc.title, "link": doc.url, "snippet": snippet(doc), "position": i}
            for i, (doc, _) in enumerate(hits, 1)
        ]
        params = {"q": query, "num": num, "type": "search", "engine": "afm-offline-bm25"}
        return web.json_response({"searchParameters": params, "organic": organic})

    return tool_app(app, {"POST /search": search}, lambda request: {"documents": len(retriever.docs)})


def main(argv: list[str] | None = None) -> None:
    parser = server_parser("afm_core.tools.servers.web_search", __doc__)
    parser.add_argument("--corpus", type=Path, default=None, help="JSON lines {id, title, contents, url?}")
    parser.add_argument("--pages", type=Path, default=None, help="folder of HTML pages to index (needs --link-base)")
    parser.add_argument("--link-base", default=None, help="base URL of the pages server the links point to")
    parser.add_argument(
        "--api-key-env", default=None, help="require the X-API-KEY held by this env var (default: accept any)"
    )
    args = parser.parse_args(argv)
    if args.corpus is None and args.pages is None:
        parser.error("give --corpus and/or --pages")
    if args.pages is not None and args.link_base is None:
        parser.error("--pages needs --link-base")
    api_key = None
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            parser.error(f"--api-key-env {args.api_key_env}: that environment variable is empty")
    try:
        docs = link_documents(load_corpus(args.corpus), args.link_base) if args.corpus else []
        docs += page_documents(args.pages, args.link_base) if args.pages else []
    except (OSError, ValueError) as e:
        sys.exit(f"web search server: {e}")
    serve(build_app(BM25Retriever(docs), api_key), args.host, args.port, args.ready_file)


if __name__ == "__main__":
    main()
