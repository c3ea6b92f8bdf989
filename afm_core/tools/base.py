"""The tool interface and the errors a tool call can end with.

A tool is one CoA tag (``<web_search>``, ``<crawl_page>``, ``<wiki_search>``, ``<code>``). The CoA format
module (``afm_core.coa.parse_tool_calls``) finds ``<tag>content</tag>`` in the model's text; the tool
parses only the content (:meth:`Tool.parse`) and turns it into observation text (:meth:`Tool.call`).
Upstream passes every tool a single string argument ``query`` (``XMLToolParser`` in OPPO-PersonalAI/Agent_Foundation_Models,
``verl/verl/tools/xml_tool_parser.py``); the tools keep that contract.

Tools never retry, time out, rate-limit or cache by themselves: :class:`~afm_core.tools.pool.ToolPool` does,
through the :class:`~afm_core.tools.http.ToolHttp` it hands to :meth:`Tool.call`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from afm_core.tools.http import ToolHttp

#: Error kinds counted by the pool (``ToolPool.metrics``) and shown in error observations.
ERROR_KINDS = ("bad_input", "connect", "timeout", "http_5xx", "http_4xx", "bad_json", "bad_response")


class ToolError(Exception):
    """A tool call failed; ``kind`` is one of :data:`ERROR_KINDS`.

    Attributes:
        kind: the error class (what the metrics count).
        attempts: HTTP attempts made before giving up (0 when the input was rejected).
    """

    def __init__(self, kind: str, message: str, attempts: int = 0) -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown tool error kind {kind!r}")
        super().__init__(message)
        self.kind = kind
        self.attempts = attempts


class ToolInputError(ToolError):
    """The tag's content cannot be turned into a call (empty query, no code block, no URL, ...)."""

    def __init__(self, message: str) -> None:
        super().__init__("bad_input", message)


class Tool(ABC):
    """One tool: its name, its CoA tag, how to parse the tag's content, and the async call.

    Subclasses set :attr:`name` (the pool's key, also the metrics label) and may set :attr:`tag`
    (defaults to the name) and :attr:`duplicate_observation` (the text returned, without calling, when a
    trajectory repeats the same call; None disables the guard for this tool).
    """

    name: ClassVar[str]
    tag: ClassVar[str | None] = None
    duplicate_observation: ClassVar[str | None] = None

    @property
    def coa_tag(self) -> str:
        return self.tag or self.name

    @abstractmethod
    def parse(self, content: str) -> Any:
        """Arguments from the text between ``<tag>`` and ``</tag>``.

        Raises:
            ToolInputError: the content is not a valid call.
        """

    @abstractmethod
    async def call(self, args: Any, http: ToolHttp, context: Mapping[str, str]) -> str:
        """Run the call and return the observation text.

        Args:
            args: what :meth:`parse` returned.
            http: the pool's HTTP helper for this tool (timeouts, retries, rate limit).
            context: facts about the trajectory a tool may use, e.g. ``{"task": question}`` for
                page summaries toward the task; empty when the caller gives none.

        Raises:
            ToolError: the backend failed (after the pool's retries) or answered something unusable.
        """

    def cache_key(self, args: Any, context: Mapping[str, str]) -> str:
        """A string identifying the call for the cache and the duplicate guard (JSON of the args).

        A tool whose observation also depends on its settings (e.g. ``topk``) or on ``context`` must include
        them. The backend's URL is left out on purpose: the disk cache outlives the servers' ports.
        """
        return json.dumps(args, sort_keys=True, ensure_ascii=False, default=str)
