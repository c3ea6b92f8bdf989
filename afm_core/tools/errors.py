"""The errors a tool call can end with, and their kinds (what the pool counts and the observations show)."""

from __future__ import annotations

#: Error kinds counted by the pool (``ToolPool.metrics``) and shown in error observations
#: (``[tool error: kind] ...``). ``rate_limited``: HTTP 429 after the retries; ``blocked_url``: every URL of a
#: crawl points at an address the crawl server refuses (loopback, private, link-local, metadata);
#: ``circuit_open``: the pool's circuit for the tool is open after consecutive connection failures (no
#: request was sent).
ERROR_KINDS = (
    "bad_input",
    "connect",
    "timeout",
    "http_5xx",
    "http_4xx",
    "rate_limited",
    "bad_json",
    "bad_response",
    "blocked_url",
    "circuit_open",
)


class ToolError(Exception):
    """A tool call failed; ``kind`` is one of :data:`ERROR_KINDS`.

    Attributes:
        kind: the error class (what the metrics count).
        attempts: HTTP attempts made before giving up (0 when the input was rejected).
        retry_after_s: the server's ``Retry-After`` in seconds (429/503 answers), else None.
    """

    def __init__(self, kind: str, message: str, attempts: int = 0, retry_after_s: float | None = None) -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown tool error kind {kind!r}")
        super().__init__(message)
        self.kind = kind
        self.attempts = attempts
        self.retry_after_s = retry_after_s


class ToolInputError(ToolError):
    """The tag's content cannot be turned into a call (empty query, no code block, no URL, ...)."""

    def __init__(self, message: str) -> None:
        super().__init__("bad_input", message)


class ToolCircuitOpenError(RuntimeError):
    """Raised by ``ToolPool.call`` in fail-fast mode when a tool's circuit is open (its server stopped
    accepting connections); without fail-fast the pool returns a ``circuit_open`` error observation instead.

    Attributes:
        tool: the tool's name.
    """

    def __init__(self, tool: str, message: str) -> None:
        super().__init__(message)
        self.tool = tool
