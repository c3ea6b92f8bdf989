"""The code-execution server: ``python -m sandbox.server --host 127.0.0.1 --port N``.

API
- ``POST /run`` with JSON ``{"code": str, "stdin": str | null, "timeout_s": float, "memory_mb": int}``
  (``stdin``, ``timeout_s`` and ``memory_mb`` are optional; defaults from :class:`~sandbox.runner.RunnerConfig`).
  200: ``{"status", "stdout", "stderr", "exit_code", "duration_s", "truncated"}`` (:class:`~sandbox.runner.RunResult`),
  whatever the snippet did. 400: a malformed request, naming the field. 503: the queue is full (retry later).
- ``GET /health``: ``{"status": "ok", "backend", "warm", "running", "queued", "max_concurrency", "max_queue", "uids"}``
  (``uids``: the first and last host uid of the server's uid block when it runs as root, else null).

Each of the ``--max-concurrency`` slots keeps a warm jail whose zygote forks a fresh child per snippet
(:mod:`sandbox.warm`); ``--cold`` starts a new jail and interpreter per snippet instead (slower; kept for
comparison, ``benchmarks/tools_load.py``). At start-up the server starts the jails, runs ``print(1)`` in one
and exits with a clear error when that fails (no bubblewrap, user namespaces disabled, ...): it never falls
back to running code unjailed.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from aiohttp import web

from afm_core.tools.serving import serve, server_parser, tool_app
from sandbox.jail import JailConfig
from sandbox.runner import QueueFullError, RunnerConfig, SnippetRunner
from sandbox.warm import JailStartError

log = logging.getLogger(__name__)

RUNNER = web.AppKey("runner", SnippetRunner)


class BadRequest(ValueError):
    """A request field is missing, of the wrong type or out of range."""


def parse_run_request(body: object, cfg: RunnerConfig) -> tuple[str, str | None, float, int]:
    """Validate a ``POST /run`` body; returns ``(code, stdin, timeout_s, memory_mb)``.

    Raises:
        BadRequest: naming the offending field and the accepted range.
    """
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    code = body.get("code")
    if not isinstance(code, str):
        raise BadRequest("field 'code' must be a string")
    if len(code.encode("utf-8")) > cfg.max_code_bytes:
        raise BadRequest(f"field 'code' is over {cfg.max_code_bytes} bytes")
    stdin = body.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise BadRequest("field 'stdin' must be a string or null")
    if stdin is not None and len(stdin.encode("utf-8")) > cfg.max_stdin_bytes:
        raise BadRequest(f"field 'stdin' is over {cfg.max_stdin_bytes} bytes")
    timeout_s = body.get("timeout_s", cfg.default_timeout_s)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= cfg.max_timeout_s:
        raise BadRequest(f"field 'timeout_s' must be a number in (0, {cfg.max_timeout_s:g}]")
    memory_mb = body.get("memory_mb", cfg.default_memory_mb)
    if (
        isinstance(memory_mb, bool)
        or not isinstance(memory_mb, int)
        or not cfg.min_memory_mb <= memory_mb <= cfg.max_memory_mb
    ):
        raise BadRequest(f"field 'memory_mb' must be an integer in [{cfg.min_memory_mb}, {cfg.max_memory_mb}]")
    return code, stdin, float(timeout_s), memory_mb


async def handle_run(request: web.Request) -> web.Response:
    runner = request.app[RUNNER]
    try:
        body = await request.json()
    except json.JSONDecodeError as e:
        return web.json_response({"error": f"body is not valid JSON: {e}"}, status=400)
    try:
        code, stdin, timeout_s, memory_mb = parse_run_request(body, runner.cfg)
    except BadRequest as e:
        return web.json_response({"error": str(e)}, status=400)
    try:
        result = await runner.run(code, stdin, timeout_s, memory_mb)
    except QueueFullError as e:
        return web.json_response({"error": f"queue full: {e}"}, status=503, headers={"Retry-After": "1"})
    return web.json_response(result.to_json())


def health(request: web.Request) -> dict[str, Any]:
    runner = request.app[RUNNER]
    return {
        "backend": runner.cfg.jail.backend,
        "warm": runner.cfg.warm,
        "running": runner.running,
        "queued": runner.queued,
        "max_concurrency": runner.cfg.max_concurrency,
        "max_queue": runner.cfg.max_queue,
        "uids": list(runner.uids.uids) if runner.uids is not None else None,
    }


async def self_test(runner: SnippetRunner) -> None:
    """Start the warm jails and run ``print(1)`` in one.

    Raises:
        RuntimeError: the jail does not work on this host (with bubblewrap's or nsjail's message).
    """
    try:
        await runner.start()
    except JailStartError as e:
        raise RuntimeError(
            f"sandbox self-test failed ({runner.cfg.jail.backend}): a jail did not start: {str(e)[:500]}"
        ) from e
    result = await runner.run("print(1)", None, 10.0, runner.cfg.default_memory_mb)
    if result.status != "ok" or result.stdout.strip() != "1":
        raise RuntimeError(
            f"sandbox self-test failed ({runner.cfg.jail.backend}): status={result.status} "
            f"exit_code={result.exit_code} stderr={result.stderr.strip()[:500]!r}"
        )


def build_app(cfg: RunnerConfig) -> web.Application:
    """The aiohttp application; the jail is checked (self-test) when the app starts.

    Raises:
        FileNotFoundError: the backend binary or the interpreter is missing (from ``JailConfig.check``).
    """
    cfg.jail.check()
    app = web.Application(client_max_size=cfg.max_code_bytes + cfg.max_stdin_bytes + (64 << 10))

    async def lifecycle(app: web.Application):
        runner = SnippetRunner(cfg)
        app[RUNNER] = runner
        try:
            await self_test(runner)
            yield
        finally:
            await runner.aclose()

    return tool_app(app, {"POST /run": handle_run}, health, lifecycle)


def main(argv: list[str] | None = None) -> None:
    parser = server_parser("sandbox.server", __doc__)
    defaults = RunnerConfig()
    parser.add_argument("--max-concurrency", type=int, default=defaults.max_concurrency, help="snippets run at once")
    parser.add_argument(
        "--max-queue", type=int, default=defaults.max_queue, help="snippets waiting for a slot before 503"
    )
    parser.add_argument("--max-output-bytes", type=int, default=defaults.max_output_bytes, help="kept per stream")
    parser.add_argument("--max-timeout-s", type=float, default=defaults.max_timeout_s)
    parser.add_argument("--max-memory-mb", type=int, default=defaults.max_memory_mb)
    parser.add_argument("--cold", action="store_true", help="a new jail per snippet instead of a warm jail per slot")
    parser.add_argument(
        "--nsjail-path", default=None, help="use nsjail (the upstream recipe's jail) instead of bubblewrap"
    )
    parser.add_argument("--python", default=JailConfig.python, help="interpreter inside the jail")
    parser.add_argument("--ro-path", action="append", default=[], help="extra host path bound read-only (repeatable)")
    parser.add_argument(
        "--uid-lock-dir", default=JailConfig.uid_lock_dir, help="host-wide folder of the uid blocks' locks (root)"
    )
    args = parser.parse_args(argv)
    cfg = RunnerConfig(
        jail=JailConfig(
            nsjail_path=args.nsjail_path, python=args.python, ro_paths=args.ro_path, uid_lock_dir=args.uid_lock_dir
        ),
        warm=not args.cold,
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        max_output_bytes=args.max_output_bytes,
        max_timeout_s=args.max_timeout_s,
        max_memory_mb=args.max_memory_mb,
    )
    try:
        app = build_app(cfg)
    except FileNotFoundError as e:
        sys.exit(f"sandbox.server: {e}")
    serve(app, args.host, args.port, args.ready_file)


if __name__ == "__main__":
    main()
