"""Run an aiohttp tool server until SIGTERM/SIGINT, and announce where it listens.

Every server (sandbox, wiki retrieval, web search, crawl, pages) is started the same way:
``python -m <module> --host 127.0.0.1 --port N [--ready-file F]``. Port 0 picks a free port; the bound
URL is printed and, with ``--ready-file``, written atomically as ``{"url": ...}`` once the socket listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from afm_core.utils.atomic import atomic_write_json

log = logging.getLogger(__name__)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def tool_app(
    app: web.Application,
    routes: Mapping[str, Handler],
    health: Callable[[web.Request], Mapping[str, Any]],
    lifecycle: Callable[[web.Application], AsyncIterator[None]] | None = None,
) -> web.Application:
    """The tool-server base: ``app`` with its ``routes`` (``"POST /retrieve"`` / ``"GET /doc/{id}"`` -> handler),
    ``GET /health`` answering ``{"status": "ok", **health(request)}``, and ``lifecycle`` (an aiohttp cleanup
    context: start before the first request, stop at shutdown) when given."""

    async def health_handler(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **health(request)})

    if lifecycle is not None:
        app.cleanup_ctx.append(lifecycle)
    for route, handler in routes.items():
        method, path = route.split(" ", 1)
        app.router.add_route(method, path, handler)
    app.router.add_get("/health", health_handler)
    return app


def bad_request(message: str) -> web.HTTPBadRequest:
    """HTTP 400 with the JSON body ``{"error": message}`` (raise it from a handler)."""
    return web.HTTPBadRequest(text=json.dumps({"error": message}), content_type="application/json")


async def string_list_field(request: web.Request, field: str, max_items: int) -> tuple[dict[str, Any], list[str]]:
    """The request's JSON object and its ``field``: a non-empty list of at most ``max_items`` strings.

    Raises:
        aiohttp.web.HTTPBadRequest: (:func:`bad_request`) a body that is not JSON, or a bad ``field``.
    """
    try:
        body = await request.json()
    except json.JSONDecodeError as e:
        raise bad_request(f"body is not valid JSON: {e}") from None
    items = body.get(field) if isinstance(body, dict) else None
    if not isinstance(items, list) or not items or not all(isinstance(item, str) for item in items):
        raise bad_request(f"field {field!r} must be a non-empty list of strings")
    if len(items) > max_items:
        raise bad_request(f"field {field!r} has over {max_items} entries")
    return body, items


def server_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The command line of the tool server ``python -m module`` (the first line of its ``doc`` as description),
    with :func:`add_server_args`."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=(doc or "").split("\n")[0])
    add_server_args(parser)
    return parser


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """``--host``, ``--port`` and ``--ready-file``, shared by every server's command line."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    parser.add_argument("--ready-file", type=Path, default=None, help='write {"url": ...} here once listening')


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Start ``app`` on ``host:port``; returns the runner and the base URL actually bound."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=2048)
    await site.start()
    bound_port = runner.addresses[0][1]
    return runner, f"http://{host}:{bound_port}"


def serve(app: web.Application, host: str, port: int, ready_file: Path | None = None) -> None:
    """Serve ``app`` until SIGTERM or SIGINT, then shut down cleanly (blocking)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def main() -> None:
        runner, url = await start_site(app, host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if ready_file is not None:
            atomic_write_json(ready_file, {"url": url})
        log.info("serving on %s", url)
        print(f"serving on {url}", flush=True)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(main())
