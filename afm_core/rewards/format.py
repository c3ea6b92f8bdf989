"""Format: is the response a valid CoA trajectory under the tag grammar (:func:`afm_core.coa.validate_text`)?"""

from __future__ import annotations

from afm_core.coa.grammar import validate_text
from afm_core.rewards.base import Grade


def grade_format(response: str) -> Grade:
    """1.0 when the response passes the CoA validator (blocks only, balanced tags, tool → observation, one
    final answer), else 0.0 with the first issue code as the reason and all codes in ``extra``."""
    issues = validate_text(response)
    if not issues:
        return Grade(1.0, "valid")
    return Grade(0.0, issues[0].code, extra={"issues": sorted({issue.code for issue in issues})})
