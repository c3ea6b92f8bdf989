"""What every client of an OpenAI-compatible server shares: the endpoint URL, the API-key header, and a POST with
retries.

Used by the remote generation engine (``/v1/completions``), the LLM judge and the distillation teachers
(``/v1/chat/completions``).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import aiohttp


def endpoint(url: str, path: str) -> str:
    """``url`` + ``/v1/`` + ``path``: ``http://host:8000`` and ``http://host:8000/v1`` both give ``.../v1/<path>``."""
    base = url.rstrip("/")
    return f"{base}/{path}" if base.endswith("/v1") else f"{base}/v1/{path}"


def auth_headers(api_key_env: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <key>"}`` when the environment variable ``api_key_env`` holds a key, else ``{}``."""
    if api_key_env and os.environ.get(api_key_env):
        return {"Authorization": f"Bearer {os.environ[api_key_env]}"}
    return {}


class EndpointError(RuntimeError):
    """A request that failed for good: an HTTP status that is not worth retrying, or every attempt failed."""


async def post_json(
    session: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str], *, retries: int
) -> Any:
    """POST ``body`` as JSON to ``url`` and return the decoded JSON reply.

    Retries, like the OpenAI Python client (openai-python ``src/openai/_base_client.py``, ``_should_retry``), on
    HTTP 429 and 5xx, a dropped connection, a timeout and a reply that is not JSON: ``retries`` further attempts,
    sleeping 0.5 s, 1 s, 2 s, ... between them.

    Raises:
        EndpointError: another HTTP status (at once, with the start of the reply's text), or the last attempt's
            failure after the retries; the message names ``url``.
    """
    last = ""
    for attempt in range(retries + 1):
        try:
            async with session.post(url, json=body, headers=headers) as resp:
                if resp.status == 200:
                    return await resp.json()
                last = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                if resp.status != 429 and resp.status < 500:
                    raise EndpointError(f"{url} answered {last}")
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            last = f"{e.__class__.__name__}: {e}"
        if attempt < retries:
            await asyncio.sleep(0.5 * 2**attempt)
    raise EndpointError(f"{url}: no reply after {retries + 1} attempts ({last})")
