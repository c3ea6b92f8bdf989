"""Wiki retrieval server: ``python -m afm_core.tools.servers.wiki --corpus corpus.jsonl --port N``.

API (the Search-R1 retriever API of OPPO-PersonalAI/Agent_Foundation_Models, ``AFM/tool_servers/wiki_server/wiki_rag_server.py``):
``POST /retrieve`` ``{"queries": [str], "topk": int | null, "return_scores": bool}`` →
``{"result": [[{"document": {"id", "title", "contents"}, "score": float}, ...], ...]}`` with scores, or
``{"result": [[document, ...], ...]}`` without. ``GET /health``. Retrieval is BM25, or dense with
``--retriever dense --encoder <HF encoder folder>`` (:mod:`afm_core.tools.retrieval`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from aiohttp import web

from afm_core.tools.retrieval import BM25Retriever, DenseRetriever, Retriever, load_corpus
from afm_core.tools.serving import serve, server_parser, string_list_field, tool_app

MAX_QUERIES = 512
MAX_TOPK = 100


def build_app(retriever: Retriever, default_topk: int = 3) -> web.Application:
    """The ``/retrieve`` + ``/health`` application over ``retriever``."""
    app = web.Application()
    kind = "dense" if isinstance(retriever, DenseRetriever) else "bm25"

    async def retrieve(request: web.Request) -> web.Response:
        body, queries = await string_list_field(request, "queries", MAX_QUERIES)
        topk = body.get("topk") or default_topk
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
            return web.json_response(
                {"error": f"field 'topk' must be an integer in [1, {MAX_TOPK}] or null"}, status=400
            )
        with_scores = bool(body.get("return_scores", False))
        hits = retriever.search(queries, topk)
        if with_scores:
            result = [[{"document": d.to_json(), "score": s} for d, s in row] for row in hits]
        else:
            result = [[d.to_json() for d, _ in row] for row in hits]
        return web.json_response({"result": result})

    return tool_app(
        app, {"POST /retrieve": retrieve}, lambda request: {"documents": len(retriever.docs), "retriever": kind}
    )


def main(argv: list[str] | None = None) -> None:
    parser = server_parser("afm_core.tools.servers.wiki", __doc__)
    parser.add_argument("--corpus", type=Path, required=True, help="JSON lines {id, title, contents}")
    parser.add_argument("--topk", type=int, default=3, help="passages per query when the request gives none")
    parser.add_argument("--retriever", choices=("bm25", "dense"), default="bm25")
    parser.add_argument("--encoder", default=None, help="HF encoder folder for --retriever dense (e.g. e5-base-v2)")
    args = parser.parse_args(argv)
    if args.retriever == "dense" and not args.encoder:
        parser.error("--retriever dense needs --encoder")
    try:
        docs = load_corpus(args.corpus)
        retriever = DenseRetriever(docs, args.encoder) if args.retriever == "dense" else BM25Retriever(docs)
    except (OSError, ValueError) as e:
        sys.exit(f"wiki server: {e}")
    serve(build_app(retriever, args.topk), args.host, args.port, args.ready_file)


if __name__ == "__main__":
    main()
