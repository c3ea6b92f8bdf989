"""A CoA tool tag answered by a tool of an MCP server (Model Context Protocol), as a plug-in tool.

    tools:
      web_search: {_target_: afm_core.tools.mcp.mcp_tool, tag: web_search, url: "http://host:8000/mcp",
                   tool: search, argument: query}

Each call opens the ``mcp`` SDK's ``Client`` on the server's Streamable HTTP URL and calls ``tool`` with
``{argument: <the tag's content>}`` (modelcontextprotocol/python-sdk, ``mcp.Client.call_tool``); the text blocks of
the result are the observation. The call runs in the :class:`~afm_core.tools.pool.ToolPool` like any tool
(concurrency, cache, duplicate guard, metrics); the SDK does its own HTTP, so ``limits.timeout_s`` applies as the
read timeout and connection failures count as ``connect`` errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from afm_core.tools.base import Tool, ToolError, ToolInputError
from afm_core.tools.http import ToolHttp


class MCPTool(Tool):
    """Calls ``tool`` on the MCP server at ``url``; subclassed per tag by :func:`mcp_tool`.

    Args:
        url: the server's Streamable HTTP endpoint, e.g. ``http://127.0.0.1:8000/mcp``.
        tool: the MCP tool's name.
        argument: the tool's string argument that receives the tag's content.
        max_obs_chars: the observation is cut to this many characters.
    """

    name = "mcp"

    def __init__(self, url: str, tool: str, argument: str = "query", max_obs_chars: int = 8000):
        self.url, self.tool, self.argument, self.max_obs_chars = url, tool, argument, max_obs_chars

    def parse(self, content: str) -> str:
        query = content.strip()
        if not query:
            raise ToolInputError(f"empty {self.name} input")
        return query

    async def call(self, args: Any, http: ToolHttp, context: Mapping[str, str]) -> str:
        # the MCP SDK and its HTTP client: optional packages, needed by an MCP plug-in tool's calls only
        import httpx2
        from mcp import Client
        from mcp_types import TextContent

        try:
            async with Client(self.url, read_timeout_seconds=http.limits.timeout_s) as client:
                result = await client.call_tool(self.tool, {self.argument: args})
        except Exception as err:  # the SDK's task groups wrap transport errors in exception groups
            leaves = _leaves(err)
            if any(isinstance(e, (httpx2.TimeoutException, TimeoutError)) for e in leaves):
                raise ToolError("timeout", f"MCP tool {self.tool} at {self.url}: no answer in time") from err
            if any(isinstance(e, (httpx2.ConnectError, ConnectionError)) for e in leaves):
                raise ToolError("connect", f"MCP server {self.url}: {leaves[0]}") from err
            raise
        text = "\n".join(block.text for block in result.content if isinstance(block, TextContent))
        if result.is_error:
            raise ToolError("bad_response", f"MCP tool {self.tool}: {text[:500]}")
        return text[: self.max_obs_chars]


def _leaves(err: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, or ``[err]``."""
    if isinstance(err, BaseExceptionGroup):
        return [leaf for inner in err.exceptions for leaf in _leaves(inner)]
    return [err]


def mcp_tool(tag: str, url: str, tool: str, argument: str = "query", max_obs_chars: int = 8000) -> MCPTool:
    """An :class:`MCPTool` answering the CoA tag ``tag`` (its ``name``: the pool's key and the tag)."""
    cls = type(f"MCPTool_{tag}", (MCPTool,), {"name": tag})
    return cls(url, tool, argument, max_obs_chars)
