"""The result every grader returns, and the answer extraction they share."""

from __future__ import annotations

import re
from dataclasses import dataclass

_ANSWER_RE = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)


@dataclass(frozen=True)
class Grade:
    """A grader's verdict on one response.

    Attributes:
        score: the reward in [0, 1] (1 = correct; QA F1 may be fractional in ``extra``).
        reason: a short stable code: ``correct``, ``wrong``, ``no_answer``, ``timeout``, ``runtime_error``,
            ``bad_tests``, ``grader_error``, ``judge_error``, ``format_error``...
        error: True when the GRADER failed (missing/unparsable tests, sandbox or judge unreachable): the
            score is 0 but the sample is counted as a grading error, never a silent 0.
        extra: details (F1, tests passed, the judge's rationale...), JSON-safe.
    """

    score: float
    reason: str
    error: bool = False
    extra: dict | None = None

    @property
    def correct(self) -> bool:
        return self.score >= 1.0


def extract_answer(response: str) -> str | None:
    """The content of the LAST ``<answer>`` block (an unclosed one runs to the end), stripped; None if absent.

    Upstream AFM reward functions take the last ``<answer>…</answer>`` as the prediction
    (``verl/verl/utils/reward_score/{mathverify,grm_simple,mhqa_eval}.py``).
    """
    matches = _ANSWER_RE.findall(response)
    return matches[-1].strip() if matches else None
