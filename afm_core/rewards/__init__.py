"""Graders: math (math-verify), code (sandbox tests), QA (EM/F1), an LLM judge, and CoA format.

Each returns a :class:`~afm_core.rewards.base.Grade` (score, reason, error flag). Used by evaluation and
as RL rewards.

The names below are imported from their modules on first access (PEP 562), so that a process needing one grader
(the data converters use :mod:`afm_core.rewards.math`) does not import the others' HTTP clients (aiohttp).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: ``name: the module of this package that defines it`` for each name of ``__all__``.
EXPORTS = {
    "Grade": "base",
    "extract_answer": "base",
    "BadTestsError": "code",
    "CodeTests": "code",
    "SandboxClient": "code",
    "code_tests_from_ground_truth": "code",
    "extract_program": "code",
    "grade_format": "format",
    "GRADER_KINDS": "grader",
    "Graders": "grader",
    "grader_kind": "grader",
    "LLMJudge": "judge",
    "grade_math": "math",
    "math_equal": "math",
    "exact_match": "qa",
    "f1_score": "qa",
    "grade_qa": "qa",
    "normalize_answer": "qa",
}

if TYPE_CHECKING:
    from afm_core.rewards.base import Grade, extract_answer
    from afm_core.rewards.code import (
        BadTestsError,
        CodeTests,
        SandboxClient,
        code_tests_from_ground_truth,
        extract_program,
    )
    from afm_core.rewards.format import grade_format
    from afm_core.rewards.grader import GRADER_KINDS, Graders, grader_kind
    from afm_core.rewards.judge import LLMJudge
    from afm_core.rewards.math import grade_math, math_equal
    from afm_core.rewards.qa import exact_match, f1_score, grade_qa, normalize_answer

__all__ = [
    "GRADER_KINDS",
    "BadTestsError",
    "CodeTests",
    "Grade",
    "Graders",
    "LLMJudge",
    "SandboxClient",
    "code_tests_from_ground_truth",
    "exact_match",
    "extract_answer",
    "extract_program",
    "f1_score",
    "grade_format",
    "grade_math",
    "grade_qa",
    "grader_kind",
    "math_equal",
    "normalize_answer",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name not in EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{EXPORTS[name]}"), name)
    globals()[name] = value
    return value
