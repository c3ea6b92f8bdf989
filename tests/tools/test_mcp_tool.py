"""An MCP server as a tool source: a real MCP server (the ``mcp`` SDK's MCPServer over Streamable HTTP on
127.0.0.1, served by uvicorn) answers ``<wiki_search>`` through the plug-in ``afm_core.tools.mcp.mcp_tool`` in the
ToolPool; a tool error and an unreachable server become error observations."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from afm_core.tools.registry import build_tool_pool
from afm_core.utils.ports import free_port


@pytest.fixture(scope="module")
def mcp_url():
    import uvicorn
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("glossary")

    @server.tool()
    def lookup(term: str) -> str:
        """The glossary entry of a term."""
        if term == "boom":
            raise ValueError("no such term")
        return f"{term}: the organelles that make a cell's ATP."

    port = free_port()
    http = uvicorn.Server(
        uvicorn.Config(server.streamable_http_app(), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not http.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http.started, "the MCP server did not start"
    yield f"http://127.0.0.1:{port}/mcp"
    http.should_exit = True
    thread.join(timeout=10)


def test_an_mcp_server_tool_answers_a_coa_tag_through_the_tool_pool(mcp_url):
    entry = {"_target_": "afm_core.tools.mcp.mcp_tool", "tag": "wiki_search", "tool": "lookup", "argument": "term",
             "url": mcp_url, "limits": {"timeout_s": 20}}  # fmt: skip
    dead = {**entry, "tag": "web_search", "url": f"http://127.0.0.1:{free_port()}/mcp", "limits": {"timeout_s": 5}}
    pool = build_tool_pool({"tools": {"wiki_search": entry, "web_search": dead}}, addresses={})

    async def calls():
        async with pool:
            return [await pool.call("wiki_search", "mitochondria"), await pool.call("wiki_search", "boom"),
                    await pool.call("web_search", "anything")]  # fmt: skip

    answer, failed, unreachable = asyncio.run(calls())
    assert answer == "mitochondria: the organelles that make a cell's ATP."
    assert failed == "[wiki_search error: bad_response] MCP tool lookup: Error executing tool lookup"
    assert unreachable.startswith("[web_search error: connect]")
    assert pool.metrics["wiki_search"].errors["bad_response"] == 1
