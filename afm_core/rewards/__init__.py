"""Graders: math (math-verify), code (sandbox tests), QA (EM/F1), an LLM judge, and CoA format.

Each returns a :class:`~afm_core.rewards.base.Grade` (score, reason, error flag). Used by evaluation and
as RL rewards.
"""

from afm_core.rewards.base import Grade, extract_answer
from afm_core.rewards.code import BadTestsError, CodeTests, SandboxClient, code_tests_from_ground_truth, extract_program
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
