"""The text of a ``<code>`` observation: what the code tool returns and what converted traces carry.

One format for live tool calls (:class:`afm_core.tools.code.CodeTool`) and for trajectories converted from
recorded executions (the GSM8K and ToRA converters), so a model meets the same observation text in SFT as in
rollouts. It follows the upstream code tool (``NsjailSandbox`` in OPPO-PersonalAI/Agent_Foundation_Models,
``verl/verl/tools/code_executor.py``): ``[EXECUTED] Code exited with status 0.`` + ``[STDOUT:BEGIN]…[STDOUT:END]``,
or ``[FAILED] Code exited with status N.`` + stdout/stderr blocks, cut in the middle to a character budget
(upstream: 512 × 3).
"""

from __future__ import annotations

from collections.abc import Mapping

CODE_OBSERVATION_MAX_CHARS = 1536
"""The code tool's default observation budget in characters (upstream: 512 × 3)."""


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the first and last ``max_chars // 2`` characters with a marker between (upstream ``truncate_content``)."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return (
        text[:half] + f"\n..._This content has been truncated to stay below {max_chars} characters_...\n" + text[-half:]
    )


def format_code_observation(result: Mapping) -> str:
    """The upstream observation text for a sandbox result ``{status, stdout, stderr, exit_code, ...}``."""
    stdout, stderr = result["stdout"].strip(), result["stderr"].strip()
    if result["status"] == "ok":
        if not stdout:
            return "[EXECUTED] Code exited with status 0 (no output)."
        return f"[EXECUTED] Code exited with status 0.\n[STDOUT:BEGIN]\n{stdout}\n[STDOUT:END]"
    code = result["exit_code"]
    if code is None or code <= 0:  # killed by the server (timeout, output flood): upstream reports 1
        code = 1
    if not stdout and stderr:
        return f"[FAILED] Code exited with status {code}.\n[STDERR:BEGIN]\n{stderr}\n[STDERR:END]"
    if not stdout and not stderr:
        return f"[FAILED] Code exited with status {code} (no output)."
    if stdout and not stderr:
        return f"[FAILED] Code exited with status {code}.\n[STDOUT:BEGIN]\n{stdout}\n[STDOUT:END]"
    return (
        f"[FAILED] Code exited with status {code} with mixed output:\n"
        f"[STDOUT:BEGIN]\n{stdout}\n[STDOUT:END]\n[STDERR:BEGIN]\n{stderr}\n[STDERR:END]"
    )


def executed_output_observation(stdout: str, max_chars: int = CODE_OBSERVATION_MAX_CHARS) -> str:
    """The observation of a snippet that exited 0 after printing ``stdout`` (a recorded execution), exactly as
    the live code tool would write it."""
    return truncate_middle(format_code_observation({"status": "ok", "stdout": stdout, "stderr": ""}), max_chars)
