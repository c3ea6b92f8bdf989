"""Tool-call parsing (upstream XMLToolParser semantics) and code-tool queries."""

from afm_core.coa.parse import (
    ToolCall,
    format_code_query,
    has_tool_call,
    parse_code_query,
    parse_tool_calls,
    stop_strings,
)


def test_parse_tool_calls():
    text = "<think>t</think>\n<wiki_search>\n  Nevada attorney general \n</wiki_search><code>print(1)</code>"
    assert parse_tool_calls(text) == [ToolCall("wiki_search", "Nevada attorney general"), ToolCall("code", "print(1)")]
    assert has_tool_call(text)


def test_empty_calls_do_not_count():
    assert parse_tool_calls("<web_search>  \n </web_search>") == []
    assert not has_tool_call("<web_search> </web_search><think>x</think>")


def test_shortest_match_without_reopened_tag():
    # Upstream regex <name>((?:(?!<name>).)*?)</name>: a re-opened tag restarts the match.
    text = "<web_search>a <web_search>b</web_search> <web_search>c</web_search>"
    assert parse_tool_calls(text) == [ToolCall("web_search", "b"), ToolCall("web_search", "c")]


def test_order_of_appearance_and_tool_subset():
    text = "<code>x</code><crawl_page>http://a | http://b</crawl_page><code>y</code>"
    assert [c.query for c in parse_tool_calls(text)] == ["x", "http://a | http://b", "y"]
    assert parse_tool_calls(text, tool_names=("crawl_page",)) == [ToolCall("crawl_page", "http://a | http://b")]
    assert not has_tool_call(text, tool_names=("wiki_search",))


def test_stop_strings():
    assert stop_strings(("wiki_search",)) == ["</wiki_search>", "</answer>"]


def test_code_query_round_trip():
    query = format_code_query("print(1 + 1)\n", stdin="3 4")
    assert query == "```py\nprint(1 + 1)\n```\n```sh\n3 4\n```"
    assert parse_code_query(query) == ("print(1 + 1)", "3 4")
    assert parse_code_query("```python\nx = 1\nprint(x)\n```") == ("x = 1\nprint(x)", None)
    assert parse_code_query("print(2)") == ("print(2)", None)
