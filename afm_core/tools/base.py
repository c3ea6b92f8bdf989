"""The tool interface (the errors a tool call can end with are in :mod:`afm_core.tools.errors`).

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
from typing import Any, ClassVar

from afm_core.tools.errors import ERROR_KINDS, ToolError, ToolInputError
from afm_core.tools.http import ToolHttp

__all__ = ["ERROR_KINDS", "Tool", "ToolError", "ToolInputError", "search_query"]  # the errors: afm_core.tools.errors


def search_query(content: str, tag: str) -> str:
    """The query of a search call (``<wiki_search>``, ``<web_search>``): the tag's content with each run of
    whitespace, newlines included, made one space and the ends stripped (the query is also the cache key and the
    duplicate guard's, so ``"a  b"`` and ``"a\\nb"`` are one query).

    Raises:
        ToolInputError: the content is empty or only whitespace (the message shows the call to write).
    """
    query = " ".join(content.split())
    if not query:
        raise ToolInputError(f"empty {tag} query; write <{tag}>your query</{tag}>")
    return query


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
