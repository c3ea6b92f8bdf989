"""Answer comparison used by the converters' correctness filters."""

from __future__ import annotations

import math
import re
import string

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)
_NUMBER_RE = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def normalize_text_answer(text: str) -> str:
    """SQuAD / HotpotQA answer normalization: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES_RE.sub(" ", text)
    return " ".join(text.split())


def text_exact_match(prediction: str, gold: str) -> bool:
    """Exact match after :func:`normalize_text_answer` (the HotpotQA EM metric)."""
    return normalize_text_answer(prediction) == normalize_text_answer(gold)


def boxed_content(text: str) -> str | None:
    """The content of the LAST ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i].strip()
            depth -= 1
    return None


def parse_number(text: str) -> float | None:
    """``text`` as a number (``"1,000"``, ``"$5"``, ``"24.0"``, ``"50%"`` -> 1000, 5, 24, 50), or None."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace("\\%", "%").rstrip("%").strip()
    return float(cleaned) if _NUMBER_RE.match(cleaned) else None


def numbers_equal(a: float, b: float) -> bool:
    """Equal up to float rounding (relative 1e-9, absolute 1e-9)."""
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def _normalize_math(text: str) -> str:
    text = text.strip().strip("$").rstrip(".")
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("dfrac", "frac"), ("tfrac", "frac")):
        text = text.replace(old, new)
    return "".join(text.split())


def math_answers_equal(prediction: str, gold: str) -> bool:
    """Two math answers are equal: numerically when both are numbers, else as LaTeX with spaces,
    ``$``, ``\\left``/``\\right`` and ``dfrac``/``tfrac`` spellings normalized away."""
    a, b = parse_number(prediction), parse_number(gold)
    if a is not None and b is not None:
        return numbers_equal(a, b)
    return _normalize_math(prediction) == _normalize_math(gold)
