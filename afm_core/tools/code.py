"""``<code>``: run a Python snippet in the sandbox server (``sandbox/``) and report its output.

Parsing and observation formats follow the upstream code tool (``NsjailSandbox`` in OPPO-PersonalAI/Agent_Foundation_Models,
``verl/verl/tools/code_executor.py``): the code is every
```` ```py ```` / ```` ```python ```` block (joined by a blank line), stdin is every ```` ```sh ```` /
```` ```bash ```` block; without a fence, content that parses as Python is taken as the code. Observations:
:mod:`afm_core.coa.observations` (the one format, shared with the converters of recorded executions), cut in
the middle to ``max_obs_chars`` (upstream: 512 × 3).
Unlike upstream, stdin reaches the program as its real standard input (no rewriting of ``input()``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass

from afm_core.coa.observations import CODE_OBSERVATION_MAX_CHARS, format_code_observation, truncate_middle
from afm_core.tools.base import Tool, ToolError, ToolInputError
from afm_core.tools.http import ToolHttp

# Upstream wants the closing fence on a line of its own; a small model often closes it on the code's last line
# (the line reads print(1+3) followed by the three backticks), which upstream rejects as invalid; here that
# fence closes the block too.
_CODE_BLOCK = re.compile(r"```(?:py|python)\n(.*?)\n?```", re.DOTALL)
_STDIN_BLOCK = re.compile(r"```(?:sh|bash)\n(.*?)```", re.DOTALL)
_FORMAT_HINT = "<code>\n```py\n# your python code here\n```\n</code>"


@dataclass(frozen=True)
class CodeArgs:
    code: str
    stdin: str


def parse_code_blocks(content: str) -> CodeArgs:
    """Code and stdin from a ``<code>`` tag's content.

    Raises:
        ToolInputError: no ```` ```py ```` block and the content is not Python either.
    """
    blocks = _CODE_BLOCK.findall(content)
    stdin = "\n".join(_STDIN_BLOCK.findall(content))
    if blocks:
        return CodeArgs("\n\n".join(b.strip() for b in blocks), stdin)
    raw = content.strip()
    if raw:
        try:
            ast.parse(raw)
            return CodeArgs(raw, stdin)
        except SyntaxError:
            pass
    raise ToolInputError(
        "Your code snippet is invalid: no ```py block was found and the content is not valid Python. "
        f"Write code like this:\n{_FORMAT_HINT}"
    )


class CodeTool(Tool):
    """Runs ``<code>`` snippets on a sandbox server.

    Args:
        base_url: the sandbox server, e.g. ``http://127.0.0.1:8100``.
        timeout_s: wall-clock limit per snippet (the HTTP timeout of the pool must be longer).
        memory_mb: address-space limit per snippet, MiB.
        max_obs_chars: observation length cap (characters), cut in the middle.
    """

    name = "code"

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 10.0,
        memory_mb: int = 512,
        max_obs_chars: int = CODE_OBSERVATION_MAX_CHARS,
    ) -> None:
        self.url = base_url.rstrip("/") + "/run"
        self.timeout_s, self.memory_mb, self.max_obs_chars = timeout_s, memory_mb, max_obs_chars

    def parse(self, content: str) -> CodeArgs:
        return parse_code_blocks(content)

    def cache_key(self, args: CodeArgs, context: Mapping[str, str]) -> str:
        return f"{self.timeout_s}|{self.memory_mb}|{self.max_obs_chars}|{args.stdin!r}|{args.code}"

    async def call(self, args: CodeArgs, http: ToolHttp, context: Mapping[str, str]) -> str:
        body = {
            "code": args.code,
            "stdin": args.stdin or None,
            "timeout_s": self.timeout_s,
            "memory_mb": self.memory_mb,
        }
        result = await http.request_json("POST", self.url, json_body=body)
        if not isinstance(result, dict) or not {"status", "stdout", "stderr", "exit_code"} <= result.keys():
            raise ToolError("bad_response", f"sandbox answer lacks status/stdout/stderr/exit_code: {str(result)[:200]}")
        if result["status"] == "sandbox_error":
            raise ToolError("bad_response", f"the sandbox could not start a jail: {result['stderr'][:300]}")
        return truncate_middle(format_code_observation(result), self.max_obs_chars)
