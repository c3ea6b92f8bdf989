"""The tool layer: CoA tools as clients of async HTTP services, and the pool every call goes through.

- :class:`~afm_core.tools.base.Tool`: name, tag, ``parse(content)``, ``async call(...) -> observation``.
- Tools: :class:`~afm_core.tools.code.CodeTool` (sandbox server), :class:`~afm_core.tools.wiki_search.WikiSearchTool`
  (``/retrieve``), :class:`~afm_core.tools.web_search.WebSearchTool` (Serper ``/search``),
  :class:`~afm_core.tools.crawl_page.CrawlPageTool` (crawl server).
- :class:`~afm_core.tools.pool.ToolPool`: shared sessions, limits, retries, cache, duplicate guard, metrics.
- :func:`~afm_core.tools.registry.build_tool_pool`: the pool from ``conf/tools`` and the addresses file that
  ``python -m jobs.tool_servers`` writes.
- Offline backends: :mod:`afm_core.tools.servers`.
"""

from afm_core.tools.base import ERROR_KINDS, Tool, ToolError, ToolInputError
from afm_core.tools.cache import ToolCache
from afm_core.tools.code import CodeTool
from afm_core.tools.crawl_page import CrawlPageTool
from afm_core.tools.http import ToolLimits
from afm_core.tools.pool import ToolPool
from afm_core.tools.registry import build_tool_pool, build_tools
from afm_core.tools.web_search import WebSearchTool
from afm_core.tools.wiki_search import WikiSearchTool

__all__ = [
    "ERROR_KINDS",
    "CodeTool",
    "CrawlPageTool",
    "Tool",
    "ToolCache",
    "ToolError",
    "ToolInputError",
    "ToolLimits",
    "ToolPool",
    "WebSearchTool",
    "WikiSearchTool",
    "build_tool_pool",
    "build_tools",
]
