"""A local "web" for the offline crawl backend: ``python -m afm_core.tools.servers.pages --pages DIR --corpus C``.

Serves
- ``GET /pages/<name>``: the HTML file ``DIR/<name>/source.html`` (the layout of Mozilla Readability's test
  pages, e.g. ``../shared/data/webpages/readability``) or ``DIR/<name>.html``, byte for byte;
- ``GET /doc/<id>``: corpus document ``<id>`` of a JSON-lines corpus rendered as a small HTML article
  (``<title>``, ``<h1>``, one ``<p>`` per line), so web-search links over that corpus can be crawled;
- ``GET /``: ``{"pages": [names], "documents": count}``; ``GET /health``.
"""

from __future__ import annotations

import html
import sys
from pathlib import Path

from aiohttp import web

from afm_core.tools.retrieval import Document, load_corpus
from afm_core.tools.serving import serve, server_parser, tool_app


def find_pages(pages_dir: Path) -> dict[str, Path]:
    """``{name: html file}`` for ``<name>/source.html`` folders and ``<name>.html`` files in ``pages_dir``.

    Raises:
        FileNotFoundError: ``pages_dir`` is not a folder.
    """
    if not pages_dir.is_dir():
        raise FileNotFoundError(f"pages folder {pages_dir} not found")
    pages = {p.parent.name: p for p in sorted(pages_dir.glob("*/source.html"))}
    pages.update({p.stem: p for p in sorted(pages_dir.glob("*.html"))})
    return pages


def render_document(doc: Document) -> str:
    """A corpus document as a minimal HTML article (the first line of ``contents``, the title, is dropped)."""
    title = html.escape(doc.title)
    first, _, rest = doc.contents.partition("\n")
    body = rest if rest and first.strip().strip('"') == doc.title else doc.contents
    paragraphs = "\n".join(f"<p>{html.escape(line.strip())}</p>" for line in body.splitlines() if line.strip())
    return f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{title}</title></head>\n<body><article><h1>{title}</h1>\n{paragraphs}\n</article></body></html>\n'


def build_app(pages: dict[str, Path], docs: list[Document]) -> web.Application:
    app = web.Application()
    by_id = {d.id: d for d in docs}

    async def page(request: web.Request) -> web.Response:
        path = pages.get(request.match_info["name"])
        if path is None:
            raise web.HTTPNotFound(text=f"no page {request.match_info['name']!r}")
        data = path.read_bytes()
        try:
            data.decode("utf-8")
            charset = "utf-8"
        except UnicodeDecodeError:
            charset = None  # let the client sniff the <meta charset>
        return web.Response(body=data, content_type="text/html", charset=charset)

    async def document(request: web.Request) -> web.Response:
        doc = by_id.get(request.match_info["doc_id"])
        if doc is None:
            raise web.HTTPNotFound(text=f"no document {request.match_info['doc_id']!r}")
        return web.Response(text=render_document(doc), content_type="text/html")

    async def index(request: web.Request) -> web.Response:
        return web.json_response({"pages": sorted(pages), "documents": len(docs)})

    return tool_app(
        app,
        {"GET /pages/{name}": page, "GET /doc/{doc_id}": document, "GET /": index},
        lambda request: {"pages": len(pages), "documents": len(docs)},
    )


def main(argv: list[str] | None = None) -> None:
    parser = server_parser("afm_core.tools.servers.pages", __doc__)
    parser.add_argument("--pages", type=Path, default=None, help="folder of <name>/source.html or <name>.html pages")
    parser.add_argument(
        "--corpus", type=Path, default=None, help="JSON lines {id, title, contents} served at /doc/<id>"
    )
    args = parser.parse_args(argv)
    if args.pages is None and args.corpus is None:
        parser.error("give --pages and/or --corpus")
    try:
        pages = find_pages(args.pages) if args.pages else {}
        docs = load_corpus(args.corpus) if args.corpus else []
    except (OSError, ValueError) as e:
        sys.exit(f"pages server: {e}")
    serve(build_app(pages, docs), args.host, args.port, args.ready_file)


if __name__ == "__main__":
    main()
