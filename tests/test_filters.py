"""The SFT filters (afm_core.data.filters) on hand-made trajectories: each of the paper's four filters drops
exactly what it should and reports it per stage; grading reuses the reward graders; the defaults keep
``jobs.prepare_data``'s old behaviour; the paper preset applies to converted real traces too."""

from __future__ import annotations

import asyncio
import json

import pytest

from afm_core.coa.prompts import user_prompt
from afm_core.coa.trajectory import Step, Trajectory
from afm_core.data.filters import PAPER_PRESET, DataFilters, apply_filters, upsampled_rows
from afm_core.data.prepare import prepare
from afm_core.data.trajectory_checks import (
    double_check_score,
    format_violations,
    is_double_check_correction,
    redundant_tool_inputs,
)
from afm_core.rewards import Graders
from afm_core.utils.paths import shared_data_dir


def calls(tool, n, start=0):
    steps = []
    for i in range(start, start + n):
        steps += [Step(tool, f"query {i}"), Step("observation", f"result {i}")]
    return steps


def make(i, task="mhqa", steps=None, answer="Paris", final=None, correct=None, question=None, **meta):
    question = question or f"Question {i}?"
    final = final if final is not None else ("\\boxed{" + answer + "}" if task == "math" else answer)
    steps = (steps if steps is not None else calls("code" if task == "math" else "wiki_search", 5)) + [
        Step("answer", final)
    ]
    return Trajectory(id=f"t:{i}", task=task, question=question, prompt=user_prompt(task, question), steps=steps,
                      answer=answer, correct=correct, source="t", meta=dict(meta))  # fmt: skip


REFLECT = [Step("reflection", "Information conflict: good")]


def run(items, filters, graders=None):
    return asyncio.run(apply_filters(items, filters, graders))


def stage(result, name):
    return next(s.to_dict() for s in result.stages if s.name == name)


def test_complexity_counts_tool_interactions():
    items = [make(0, steps=calls("wiki_search", 4)), make(1), make(2, steps=calls("wiki_search", 9))]
    result = run(items, DataFilters(min_tool_calls=5))
    assert [t.id for t in result.kept] == ["t:1", "t:2"]
    assert stage(result, "complexity") == {"name": "complexity", "input": 3, "kept": 2,
                                           "dropped": {"few_tool_calls": 1}}  # fmt: skip


def test_quality_grades_answers_with_the_reward_graders():
    items = [
        make(0, task="math", answer="72"),  # math-verify: \boxed{72} == 72
        make(1, task="math", answer="72", final="\\boxed{71}"),
        make(2, answer="Chief of Protocol", final="chief of protocol"),  # EM after normalisation
        make(3, answer="the designated hitter rule", final="Designated Hitter"),  # EM no, F1 0.8
        make(4, answer="Paris", correct=True, grade={"grader": "qa", "correct": True, "error": False}),
        make(5, task="code", answer=""),  # no sandbox, no tests: cannot be graded
    ]
    result = run(items, DataFilters(grade_answers=True), Graders())
    assert [t.id for t in result.kept] == ["t:0", "t:2", "t:4"]
    assert stage(result, "quality")["dropped"] == {"grader_error": 1, "wrong_answer": 2}
    assert items[1].meta["grade"]["grader"] == "math" and items[1].correct is False
    assert items[3].meta["grade"]["f1"] == 0.8
    assert "grade" in items[4].meta and items[4].meta["grade"] == {"grader": "qa", "correct": True, "error": False}
    lenient = [make(3, answer="the designated hitter rule", final="Designated Hitter")]
    assert len(run(lenient, DataFilters(grade_answers=True, qa_min_f1=0.8), Graders()).kept) == 1


def test_quality_drops_redundant_tool_inputs_and_format_violations():
    repeated = make(0, steps=[*calls("wiki_search", 3), Step("wiki_search", "Query  1"), Step("observation", "r")])
    assert redundant_tool_inputs(repeated) == [("wiki_search", "query 1")]
    unboxed = make(1, task="math", final="72", answer="72")
    broken = make(2, steps=[Step("observation", "orphan"), *calls("wiki_search", 5)])
    repaired = make(3, format_repairs={"tags_in_think": 1})
    assert format_violations(unboxed) == ["answer_not_boxed"]
    assert format_violations(broken) == ["observation_without_tool_call"]
    assert format_violations(repaired) == ["repaired:tags_in_think"]
    items = [repeated, unboxed, broken, repaired, make(4)]
    result = run(items, DataFilters(drop_redundant_tool_inputs=True, drop_format_violations=True))
    assert [t.id for t in result.kept] == ["t:4"]
    assert stage(result, "quality")["dropped"] == {"format_violation": 3, "redundant_tool_inputs": 1}
    assert len(run(items, DataFilters()).kept) == 5  # the defaults keep them all


def test_reflection_enrichment_prefers_reflection_and_drops_math_and_code_without_it():
    items = [
        make(0, task="math", answer="1"),  # math without reflection: dropped
        make(1, task="math", answer="1", steps=calls("code", 5) + REFLECT),
        make(2, question="Same?"),  # QA without reflection, but its question has a reflective one: dropped
        make(3, question="Same?", steps=calls("wiki_search", 5) + REFLECT),
        make(4, question="Alone?"),  # QA without reflection and no alternative: kept
    ]
    result = run(items, DataFilters(reflection_enrichment=True))
    assert [t.id for t in result.kept] == ["t:1", "t:3", "t:4"]
    assert stage(result, "reflection")["dropped"] == {"no_reflection": 1, "reflection_preferred": 1}


def test_error_correction_upsampling_needs_a_low_first_double_check_and_a_correct_end():
    def checked(i, first, correct, again=True):
        steps = [*calls("wiki_search", 5), Step("suggested_answer", "Lyon"), Step("double_check", first)]
        if again:
            steps += [Step("plan", "search again"), *calls("wiki_search", 1, 9), Step("suggested_answer", "Paris"),
                      Step("double_check", "Score: 4")]  # fmt: skip
        return make(i, steps=steps, correct=correct)

    recovered = checked(0, "Score: 2, weak evidence", True)
    confident = checked(1, "Score: 3", True)
    still_wrong = checked(2, "Score: 1", False)
    never_retried = checked(3, "score 1", True, again=False)
    same_again = checked(4, "Score: 2", True)
    same_again.steps[-3] = Step("suggested_answer", " lyon")  # the verifier was wrong: nothing was corrected
    assert [is_double_check_correction(t) for t in (recovered, confident, still_wrong, never_retried, same_again)] == [
        True, False, False, False, False]  # fmt: skip
    filters = DataFilters(error_correction="double_check", error_correction_upsample=3)
    rows = upsampled_rows([recovered, confident], filters)
    assert [r["id"] for r in rows] == ["t:0", "t:0#up1", "t:0#up2", "t:1"]
    assert double_check_score("I read 2 pages. Score: 3") == 3 and double_check_score("none") is None


def test_dedup_runs_last_and_the_defaults_keep_the_old_behaviour():
    wrong = make(0, correct=False)
    items = [make(1), make(1), wrong, make(0, correct=False)]
    result = run(items, DataFilters())
    assert [t.id for t in result.kept] == ["t:1"]
    assert dict(result.dropped) == {"duplicate": 1, "incorrect": 2}


def test_the_paper_preset_and_bad_settings():
    assert DataFilters.from_config({"preset": "paper"}) == DataFilters(**PAPER_PRESET)
    assert DataFilters.from_config({"preset": "paper", "min_tool_calls": 3}).min_tool_calls == 3
    for bad, message in [({"preset": "nope"}, "unknown preset"), ({"min_tool": 1}, r"unknown key\(s\)"),
                         ({"error_correction": "some"}, "error_correction must be"),
                         ({"judge_url": "http://x/v1"}, "go together"), ({"qa_min_f1": 2}, "qa_min_f1")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            DataFilters.from_config(bad)


@pytest.mark.skipif(not shared_data_dir().is_dir(), reason="real data folder is absent (set AFM_SHARED_DATA)")
def test_prepare_data_applies_the_paper_filters_to_real_traces(tmp_path):
    cfg = {"name": "coa_traces", "shared_dir": None, "out_dir": str(tmp_path / "coa"),
           "sources": {"gsm8k": 60, "r1searcher": 60}, "heldout_fraction": 0.1, "split_seed": 0,
           "filters": {"preset": "paper", "reflection_enrichment": False, "qa_min_f1": 0.5}}  # fmt: skip
    report = json.loads((prepare(cfg) / "report.json").read_text())
    filters = report["filters"]
    assert [s["name"] for s in filters["stages"]] == ["complexity", "quality", "reflection", "dedup"]
    assert filters["input"] == 120 and filters["kept"] + sum(filters["dropped"].values()) == 120
    for s in filters["stages"]:
        assert s["kept"] + sum(s["dropped"].values()) == s["input"]
    complexity = filters["stages"][0]
    assert complexity["dropped"]["few_tool_calls"] > 60  # R1-Searcher traces have <= 2 searches
    assert filters["settings"]["min_tool_calls"] == 5 and report["config"]["filters"]["grade_answers"] is True
