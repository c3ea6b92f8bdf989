"""avg@k, unbiased pass@k, maj@k and best-of-3 against closed forms and hand-computed values."""

from __future__ import annotations

import itertools
from math import comb

import pytest

from afm_core.eval.metrics import benchmark_metrics, best_of, double_check_score, majority_vote, pass_at_k


@pytest.mark.parametrize("n,c,k", [(n, c, k) for n in (1, 5, 16) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_equals_the_closed_form(n, c, k):
    expected = 1 - comb(n - c, k) / comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_correct_sample():
    scores = [1, 0, 0, 1, 0, 0]
    for k in range(1, 7):
        subsets = list(itertools.combinations(scores, k))
        assert pass_at_k(6, 2, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_majority_vote_by_hand():
    assert majority_vote(["7", "8", "7", None], [1.0, 0.0, 1.0, 0.0]) == 1.0  # 7 wins 2:1
    assert majority_vote(["8", "7", "7", "8"], [0.0, 1.0, 1.0, 0.0]) == 0.0  # 2:2 tie, 8 was seen first
    assert majority_vote([None, None], [0.0, 0.0]) == 0.0  # nobody answered
    assert majority_vote([None, "5", "6", "6"], [0.0, 0.0, 1.0, 1.0]) == 1.0  # blanks do not vote


def test_double_check_score_reads_the_last_block():
    response = (
        "<suggested_answer>3</suggested_answer>\n<double_check>\nScore: 2 - unsure\n</double_check>\n"
        "<suggested_answer>4</suggested_answer>\n<double_check>\nThe score is 4.\n</double_check>"
    )
    assert double_check_score(response) == 4
    assert double_check_score("<answer>1</answer>") is None


def test_best_of_three_picks_the_highest_double_check_first_on_ties():
    samples = [{"score": 0.0, "double_check": 2}, {"score": 1.0, "double_check": 4}, {"score": 0.0, "double_check": 4},
               {"score": 1.0, "double_check": 4}]  # fmt: skip
    assert best_of(samples, 3) == 1.0  # sample 1 (score 4) beats sample 2 (score 4, later); sample 3 is not in the pool
    assert best_of([{"score": 1.0, "double_check": None}, {"score": 0.0, "double_check": 1}], 3) == 0.0


def test_benchmark_metrics_by_hand():
    rows = []
    # problem a: 4 samples, 2 correct, answers 7,7,8,None -> maj picks 7 (correct)
    for i, (score, ans) in enumerate([(1.0, "7"), (0.0, "8"), (1.0, "7"), (0.0, None)]):
        rows.append({"problem_id": "a", "sample": i, "score": score, "answer_key": ans, "level": "1",
                     "finish_reason": "answer", "num_tool_calls": 1, "turns": 2,
                     "tool_calls": [{"name": "code", "error": "timeout" if i == 3 else None}]})  # fmt: skip
    # problem b: 4 wrong samples
    for i in range(4):
        rows.append({"problem_id": "b", "sample": i, "score": 0.0, "answer_key": "1", "level": "2",
                     "finish_reason": "length", "num_tool_calls": 0, "turns": 1, "tool_calls": []})  # fmt: skip
    # problem c: incomplete (2 of 4 samples): not counted
    rows += [{"problem_id": "c", "sample": i, "score": 1.0, "answer_key": "x"} for i in range(2)]
    m = benchmark_metrics(rows, k=4)
    assert m["n"] == 2 and m["samples"] == 8
    assert m["avg@4"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["pass@1"] == pytest.approx(0.25) and m["pass@4"] == pytest.approx(0.5)
    assert m["pass@2"] == pytest.approx((1 - comb(2, 2) / comb(4, 2)) / 2)
    assert m["maj@4"] == pytest.approx(0.5)
    assert m["tool_calls_per_problem"] == pytest.approx(4 / 8)
    assert m["tool_errors"] == {"code": {"timeout": 1}}
    assert m["finish_reasons"] == {"answer": 4, "length": 4}
    assert m["by_level"] == {"1": {"n": 1, "avg@4": 0.5}, "2": {"n": 1, "avg@4": 0.0}}
