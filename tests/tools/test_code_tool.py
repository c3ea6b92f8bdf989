"""The code tool: parsing the <code> content as upstream, observation formats, truncation, and calls to a real sandbox."""

from __future__ import annotations

import asyncio

import pytest

from afm_core.coa.observations import format_code_observation, truncate_middle
from afm_core.tools import CodeTool, ToolLimits, ToolPool
from afm_core.tools.base import ToolInputError
from afm_core.tools.code import parse_code_blocks


def test_parse_blocks_stdin_and_fallback():
    args = parse_code_blocks("think first\n```py\na = 1\n```\ntext\n```python\nprint(a)\n```\n```sh\n3 4\n```")
    assert args.code == "a = 1\n\nprint(a)" and args.stdin == "3 4\n"
    assert parse_code_blocks("print('bare')").code == "print('bare')"
    # the closing fence on the code's last line (a small model's habit) still closes the block
    assert parse_code_blocks("\n```py\nprint(8.5)\nprint(1+3)```\n").code == "print(8.5)\nprint(1+3)"
    with pytest.raises(ToolInputError, match="no ```py block"):
        parse_code_blocks("this is not python at all")
    with pytest.raises(ToolInputError):
        parse_code_blocks("   ")


def test_observation_formats_follow_upstream():
    def obs(status, out="", err="", code=0):
        return format_code_observation({"status": status, "stdout": out, "stderr": err, "exit_code": code})

    assert obs("ok", "6\n") == "[EXECUTED] Code exited with status 0.\n[STDOUT:BEGIN]\n6\n[STDOUT:END]"
    assert obs("ok") == "[EXECUTED] Code exited with status 0 (no output)."
    assert obs("error", err="Boom", code=2) == "[FAILED] Code exited with status 2.\n[STDERR:BEGIN]\nBoom\n[STDERR:END]"
    assert obs("error", code=3) == "[FAILED] Code exited with status 3 (no output)."
    assert obs("error", out="x", code=1) == "[FAILED] Code exited with status 1.\n[STDOUT:BEGIN]\nx\n[STDOUT:END]"
    assert obs("error", "x", "y", 1).startswith(
        "[FAILED] Code exited with status 1 with mixed output:\n[STDOUT:BEGIN]\nx"
    )
    assert obs("timeout", err="Timed out", code=-9).startswith(
        "[FAILED] Code exited with status 1.\n[STDERR:BEGIN]\nTimed out"
    )


def test_truncate_middle_keeps_head_and_tail():
    text = "a" * 100 + "b" * 100
    cut = truncate_middle(text, 50)
    assert cut.startswith("a" * 25) and cut.endswith("b" * 25) and "truncated to stay below 50 characters" in cut
    assert truncate_middle("short", 50) == "short"


def test_code_tool_on_the_sandbox(sandbox_url):
    async def main():
        tool = CodeTool(sandbox_url, timeout_s=2, max_obs_chars=300)
        async with ToolPool([tool], {"code": ToolLimits(cache_ttl_s=None)}) as pool:
            return await pool.call_many(
                [
                    ("code", "```py\nn = int(input())\nprint(n * 2)\n```\n```sh\n21\n```"),
                    ("code", "```py\nimport time\ntime.sleep(10)\n```"),
                    ("code", "```py\nprint('z' * 5000)\n```"),
                ],
                trajectory_id="t",
            )

    doubled, slept, long = asyncio.run(main())
    assert doubled == "[EXECUTED] Code exited with status 0.\n[STDOUT:BEGIN]\n42\n[STDOUT:END]"
    assert slept.startswith("[FAILED] Code exited with status 1.\n[STDERR:BEGIN]\nTimed out after 2 s.")
    assert len(long) < 400 and "truncated to stay below 300 characters" in long


def test_calls_parsed_from_a_coa_step(sandbox_url):
    """The CoA parser finds the calls; the pool runs them by tag name (what the rollout loop does)."""
    from afm_core.coa.parse import parse_tool_calls

    step = "<think>Compute both.</think>\n<code>\n```py\nprint(3 * 3)\n```\n</code>\n<code>\n```py\nprint(input()[::-1])\n```\n```sh\nabc\n```\n</code>"
    calls = parse_tool_calls(step)

    async def main():
        async with ToolPool([CodeTool(sandbox_url)]) as pool:
            return await pool.call_many([(c.name, c.query) for c in calls], trajectory_id="t")

    nine, reversed_ = asyncio.run(main())
    assert [c.name for c in calls] == ["code", "code"]
    assert "[STDOUT:BEGIN]\n9\n[STDOUT:END]" in nine and "[STDOUT:BEGIN]\ncba\n[STDOUT:END]" in reversed_
