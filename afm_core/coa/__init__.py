"""The Chain-of-Agents (CoA) trajectory format: tags, the Trajectory type, grammar, parsing, rendering, prompts."""

from afm_core.coa.grammar import GrammarIssue, TagGrammarError, validate_steps, validate_text
from afm_core.coa.parse import ToolCall, has_tool_call, parse_steps, parse_tool_calls, stop_strings
from afm_core.coa.prompts import TASKS, user_prompt
from afm_core.coa.render import observation_spans, render_observation, render_response
from afm_core.coa.tags import ALL_TAGS, OBSERVATION_TAG, ROLE_TAGS, TOOL_TAGS
from afm_core.coa.trajectory import Step, Trajectory

__all__ = [
    "ALL_TAGS", "OBSERVATION_TAG", "ROLE_TAGS", "TASKS", "TOOL_TAGS", "GrammarIssue", "Step",
    "TagGrammarError", "ToolCall", "Trajectory", "has_tool_call", "observation_spans", "parse_steps",
    "parse_tool_calls", "render_observation", "render_response", "stop_strings", "user_prompt",
    "validate_steps", "validate_text",
]  # fmt: skip
