"""Math answers checked with math-verify (Hugging Face ``math-verify``): ``\\boxed{}``, fractions, LaTeX, units.

As upstream AFM's ``verl/verl/utils/reward_score/mathverify.py``: the prediction is the last ``<answer>``
block, the gold is parsed as ``\\boxed{gold}``, and ``math_verify.verify(gold, prediction)`` decides, with a
parsing and verification timeout. Two additions: a multiple-choice letter (``C``, ``(C)``, ``C)``) matches
the same letter, and a plain string match is tried first (cheap, and exact for non-math answers).
"""

from __future__ import annotations

import re

from afm_core.rewards.base import Grade, extract_answer

_CHOICE_RE = re.compile(r"^\(?\s*([A-Ea-e])\s*[\).:]?\s*(?:$|\s)")
_BOXED_RE = re.compile(r"\\boxed\s*\{")


def _choice_letter(text: str) -> str | None:
    stripped = _strip_boxed(text).strip().strip("$").strip()
    match = _CHOICE_RE.match(stripped)
    return match.group(1).upper() if match and len(stripped) <= 40 else None


def _strip_boxed(text: str) -> str:
    """The content of the last ``\\boxed{...}`` in ``text`` (balanced braces), or ``text`` itself."""
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    if not starts:
        return text
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return text[start:]


def _normalize(text: str) -> str:
    """Whitespace, ``$``, ``\\%``/``%``, ``\\$`` and a trailing period removed, lower case."""
    text = re.sub(r"\s+", "", _strip_boxed(text)).replace("\\%", "").replace("%", "").replace("\\$", "")
    return text.strip("$.").lower()


def math_equal(prediction: str, gold: str, timeout_s: int = 5) -> bool:
    """Whether ``prediction`` (model text, e.g. ``\\boxed{\\frac12}`` or ``0.5``) equals ``gold`` (plain answer).

    Uses ``math_verify.parse`` / ``math_verify.verify`` (LaTeX and plain expressions, sets, intervals,
    percentages, units stripped), then multiple-choice letters.
    """
    if not prediction.strip():
        return False
    if _normalize(prediction) == _normalize(gold):
        return True
    from math_verify import parse, verify  # sympy: paid by the calls past the string comparison only

    gold_text = gold if _BOXED_RE.search(gold) else f"\\boxed{{{gold}}}"
    pred_text = prediction if ("\\boxed" in prediction or "$" in prediction) else f"\\boxed{{{prediction}}}"
    try:
        gold_parsed = parse(gold_text, parsing_timeout=timeout_s)
        pred_parsed = parse(pred_text, parsing_timeout=timeout_s)
        if not pred_parsed and pred_text != prediction:
            pred_parsed = parse(prediction, parsing_timeout=timeout_s)
        if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s):
            return True
    except Exception:  # math-verify raises on pathological LaTeX; treat as not equal
        pass
    gold_letter, pred_letter = _choice_letter(gold), _choice_letter(prediction)
    return gold_letter is not None and gold_letter == pred_letter


def grade_math(response: str, gold: str) -> Grade:
    """Grade a CoA response against a plain gold answer: 1 if its last ``<answer>`` equals ``gold``.

    Falls back to the last ``\\boxed{}`` of the response when there is no ``<answer>`` block.
    """
    answer = extract_answer(response)
    if answer is None:
        if _BOXED_RE.search(response):
            answer = "\\boxed{" + _strip_boxed(response) + "}"
        else:
            return Grade(0.0, "no_answer")
    return (
        Grade(1.0, "correct") if math_equal(answer, gold) else Grade(0.0, "wrong", extra={"prediction": answer[:200]})
    )
