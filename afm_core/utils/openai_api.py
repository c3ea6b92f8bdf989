"""The two details every client of an OpenAI-compatible server shares: the endpoint URL and the API-key header.

Used by the remote generation engine (``/v1/completions``), the LLM judge and the distillation teachers
(``/v1/chat/completions``).
"""

from __future__ import annotations

import os


def endpoint(url: str, path: str) -> str:
    """``url`` + ``/v1/`` + ``path``: ``http://host:8000`` and ``http://host:8000/v1`` both give ``.../v1/<path>``."""
    base = url.rstrip("/")
    return f"{base}/{path}" if base.endswith("/v1") else f"{base}/v1/{path}"


def auth_headers(api_key_env: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <key>"}`` when the environment variable ``api_key_env`` holds a key, else ``{}``."""
    if api_key_env and os.environ.get(api_key_env):
        return {"Authorization": f"Bearer {os.environ[api_key_env]}"}
    return {}
