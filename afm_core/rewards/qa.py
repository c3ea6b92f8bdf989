"""Short-answer QA: exact match and token F1 with SQuAD normalisation, ``|``-separated answers.

Normalisation as the SQuAD v1.1 evaluation script (lower case; drop punctuation, the articles a/an/the
and extra whitespace), which upstream AFM's ``verl/verl/utils/reward_score/mhqa_eval.py`` also uses. The
prediction is the last ``<answer>`` block; like upstream's evaluation, only its first ``|``-separated piece
is scored (``eval``); ``all_pieces=True`` requires every piece to match a gold answer (upstream's training
reward, ``mhqa_train.py``).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

from afm_core.rewards.base import Grade, extract_answer

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES_RE.sub(" ", text).split())


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def f1_score(prediction: str, golds: Sequence[str]) -> float:
    """The best token-level F1 of the prediction against any gold answer (SQuAD v1.1)."""
    best = 0.0
    pred_tokens = normalize_answer(prediction).split()
    for gold in golds:
        gold_tokens = normalize_answer(gold).split()
        common = Counter(pred_tokens) & Counter(gold_tokens)
        same = sum(common.values())
        if not pred_tokens or not gold_tokens:
            best = max(best, float(pred_tokens == gold_tokens))
        elif same:
            precision, recall = same / len(pred_tokens), same / len(gold_tokens)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def split_golds(gold: str | Sequence[str]) -> list[str]:
    """Gold answers from a ``|``-separated string or a list (each item may hold ``|`` too)."""
    items = [gold] if isinstance(gold, str) else list(gold)
    return [piece.strip() for item in items for piece in str(item).split("|") if piece.strip()]


def grade_qa(response: str, gold: str | Sequence[str], *, all_pieces: bool = False) -> Grade:
    """EM of the response's last ``<answer>`` against the gold answers; F1 in ``extra``.

    Args:
        gold: ``"a|b"`` or ``["a", "b"]``: any of them is correct.
        all_pieces: require every ``|``-separated predicted piece to match (else: the first piece only).
    """
    answer = extract_answer(response)
    if answer is None or not answer.strip():
        return Grade(0.0, "no_answer", extra={"f1": 0.0})
    golds = split_golds(gold)
    pieces = [p.strip() for p in answer.split("|") if p.strip()] or [answer]
    scored = pieces if all_pieces else pieces[:1]
    em = float(all(exact_match(p, golds) for p in scored))
    f1 = max(f1_score(p, golds) for p in scored)
    return Grade(em, "correct" if em else "wrong", extra={"f1": round(f1, 4), "prediction": answer[:200]})
