"""Graders on tricky answers; code graded in the real sandbox: every HumanEval and MBPP reference passes."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest

from afm_core.rewards import (
    CodeTests,
    Graders,
    SandboxClient,
    code_tests_from_ground_truth,
    extract_program,
    grade_format,
    grade_math,
    grade_qa,
    grader_kind,
    math_equal,
)
from afm_core.rewards.code import BadTestsError, humaneval_tests, mbpp_tests, run_tests
from afm_core.rewards.judge import parse_verdict
from tests.tools.conftest import sandbox_server


@pytest.mark.parametrize(
    "prediction,gold",
    [
        ("\\boxed{\\frac{1}{2}}", "0.5"),  # fraction vs decimal
        ("0.5", "\\frac12"),
        ("\\dfrac{3}{4}", "0.75"),
        ("$\\boxed{72}$", "72"),  # boxed inside math mode
        ("72.0", "72"),
        ("1,000", "1000"),
        ("10 cm", "10"),  # units
        ("50\\%", "50"),  # percent
        ("\\$10", "10"),  # currency
        ("x = 2", "2"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\frac{\\pi}{2})"),  # LaTeX tuple
        ("(C)", "C"),  # multiple-choice letters
        ("C) 12", "C"),
        ("\\text{(B)}", "B"),
    ],
)
def test_math_equivalent_answers_match(prediction, gold):
    assert math_equal(prediction, gold)


@pytest.mark.parametrize(
    "prediction,gold", [("3", "4"), ("B", "C"), ("\\frac{1}{3}", "0.33"), ("", "0"), ("12", "1,200")]
)
def test_math_different_answers_do_not_match(prediction, gold):
    assert not math_equal(prediction, gold)


def test_grade_math_takes_the_last_answer_block_and_falls_back_to_boxed():
    assert grade_math("<answer>\\boxed{3}</answer>\n<answer>\\boxed{4}</answer>", "4").score == 1.0
    assert grade_math("so the total is \\boxed{18}.", "18").reason == "correct"
    assert grade_math("<think>no idea</think>", "18").reason == "no_answer"


def test_qa_exact_match_f1_and_pipe_separated_answers():
    assert grade_qa("<answer>The Animorphs</answer>", "Animorphs|K. A. Applegate").score == 1.0  # article dropped
    assert grade_qa("<answer>k a applegate</answer>", ["Animorphs", "K. A. Applegate"]).score == 1.0
    wrong = grade_qa("<answer>Chief of Staff</answer>", "Chief of Protocol")
    assert wrong.score == 0.0 and wrong.extra["f1"] == pytest.approx(
        2 / 3, abs=1e-4
    )  # "chief of" overlaps: P = R = 2/3
    assert grade_qa("<answer>Paris|Lyon</answer>", "Paris").score == 1.0  # evaluation scores the first piece
    assert grade_qa("<answer>Paris|Lyon</answer>", "Paris", all_pieces=True).score == 0.0  # training rule
    assert grade_qa("no answer here", "Paris").reason == "no_answer"


def test_format_grade_uses_the_coa_validator():
    ok = "<think>t</think>\n<code>\nprint(1)\n</code>\n<observation>\n1\n</observation>\n\n<answer>1</answer>"
    assert grade_format(ok).score == 1.0
    bad = grade_format("text outside <answer>1</answer>")
    assert bad.score == 0.0 and bad.reason == "text_outside_tags"


def test_judge_verdicts_parse_json_and_bare_words():
    assert parse_verdict('{"rationale": "same city", "judgement": "correct"}') == (True, "same city")
    assert parse_verdict("The judgement is: incorrect.")[0] is False
    with pytest.raises(ValueError, match="no verdict"):
        parse_verdict("I cannot tell")


def test_grader_kind_from_data_source_and_ability():
    assert grader_kind("skywork_livecodebench_v4", "coding") == "code"
    assert grader_kind("MATH500", "fact-reasoning") == "math"
    assert grader_kind("aime24") == "math"
    assert grader_kind("hotpotqa") == "qa"
    assert grader_kind("gaia", "web") == "judge"
    assert grader_kind("my_set", "math") == "math"


def test_code_tests_from_ground_truth_forms_and_errors():
    stdio = code_tests_from_ground_truth('{"stdin": ["1 2\\n"], "expected_output": ["3\\n"], "question_id": "x"}')
    assert stdio.kind == "stdio" and stdio.inputs == ("1 2\n",)
    assert code_tests_from_ground_truth({"inputs": ["a"], "outputs": ["b"]}).kind == "stdio"
    assert code_tests_from_ground_truth({"functional": "assert f() == 1"}).kind == "assert"
    with pytest.raises(BadTestsError, match="no tests"):
        code_tests_from_ground_truth({"answer": "3"})
    with pytest.raises(BadTestsError, match="not JSON"):
        code_tests_from_ground_truth("{oops")
    with pytest.raises(BadTestsError, match="as many inputs as outputs"):
        code_tests_from_ground_truth({"stdin": ["1"], "expected_output": []})


def test_extract_program_takes_the_last_python_block():
    assert extract_program("```py\na=1\n```\ntext\n```python\nb=2\n```") == "b=2"
    assert extract_program("def f():\n    return 1") == "def f():\n    return 1"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    with sandbox_server(tmp_path_factory) as (url, group):
        yield url, group


def _run(coro):
    return asyncio.run(coro)


async def _grade_all(url, programs_and_tests, concurrency=8, timeout_s=20.0):
    client = SandboxClient(url, timeout_s=timeout_s)
    slots = asyncio.Semaphore(concurrency)

    async def one(program, tests):
        async with slots:
            return await run_tests(client, program, tests)

    try:
        return await asyncio.gather(*(one(p, t) for p, t in programs_and_tests))
    finally:
        await client.close()


@pytest.mark.slow
def test_every_humaneval_canonical_solution_scores_one(sandbox, data_dir):
    with gzip.open(data_dir / "code/humaneval/HumanEval.jsonl.gz", "rt") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 164
    grades = _run(
        _grade_all(sandbox[0], [(r["prompt"] + r["canonical_solution"], humaneval_tests(r)) for r in records])
    )
    failed = [(r["task_id"], g) for r, g in zip(records, grades) if g.score != 1.0]
    assert not failed, failed[:3]


@pytest.mark.slow
def test_every_mbpp_reference_solution_scores_one(sandbox, data_dir):
    records = json.loads((data_dir / "code/mbpp/sanitized-mbpp.json").read_text())
    assert len(records) == 427
    grades = _run(_grade_all(sandbox[0], [(r["code"], mbpp_tests(r)) for r in records]))
    failed = [(r["task_id"], g) for r, g in zip(records, grades) if g.score != 1.0]
    assert not failed, failed[:3]


def test_wrong_code_scores_zero_and_a_timeout_says_timeout(sandbox):
    url = sandbox[0]
    tests = CodeTests("assert", test_code="assert add(2, 3) == 5\n")
    grades = _run(_grade_all(url, [
        ("def add(a, b):\n    return a + b", tests),
        ("def add(a, b):\n    return a - b", tests),
        ("def add(a, b):\n    raise KeyError(a)", tests),
        ("import time\ntime.sleep(60)\ndef add(a, b):\n    return a + b", tests),
    ], timeout_s=5.0))  # fmt: skip
    assert [g.score for g in grades] == [1.0, 0.0, 0.0, 0.0]
    assert [g.reason for g in grades] == ["correct", "wrong", "runtime_error", "timeout"]


def test_stdio_tests_compare_output_line_by_line(sandbox):
    tests = code_tests_from_ground_truth({"stdin": ["1 2\n", "5 7\n"], "expected_output": ["3\n", "12\n"]})
    program = "a, b = map(int, input().split())\nprint(a + b)   "
    good, bad = _run(_grade_all(sandbox[0], [(program, tests), ("print(3)", tests)]))
    assert good.score == 1.0 and good.extra == {"passed": 2, "total": 2}
    assert bad.score == 0.0 and bad.reason == "wrong" and bad.extra["passed"] == 1


def test_code_grader_counts_missing_tests_and_an_unreachable_sandbox_as_errors():
    async def grade_both():
        graders = Graders(sandbox=SandboxClient("http://127.0.0.1:9", timeout_s=1, retries=0))
        meta = {"tests": CodeTests("assert", test_code="assert True").to_dict()}
        try:
            return (
                await graders.grade("code", "<answer>print(1)</answer>", gold="", meta={}),
                await graders.grade("code", "<answer>print(1)</answer>", gold="", meta=meta),
            )
        finally:
            await graders.close()

    missing, down = _run(grade_both())
    assert missing.reason == "bad_tests" and missing.error
    assert down.reason == "grader_error" and down.error
