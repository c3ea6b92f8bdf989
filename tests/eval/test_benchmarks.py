"""Benchmark presets: the GSM8K calculator-step filter (``max_calculator_steps``) that gives the RL
learning-signal run its held-out set, the fixed-seed split of the test-only SVAMP and MAWPS into disjoint held-out
problems and RL prompts, and presets that misuse either naming the file and field."""

from __future__ import annotations

import json

import pytest

from afm_core.eval import benchmarks
from afm_core.eval.benchmarks import load_preset


def test_the_two_step_gsm8k_preset_keeps_the_test_problems_with_at_most_two_calculator_steps(data_dir):
    lines = (data_dir / "math/gsm8k/test.jsonl").read_text().splitlines()
    expected = [str(i) for i, line in enumerate(lines) if json.loads(line)["answer"].count("<<") <= 2]
    bench = load_preset("gsm8k_test_2step", data_dir)
    assert [t.meta["problem_id"] for t in bench.tasks] == expected and len(expected) == 440
    assert all(t.meta["calculator_steps"] <= 2 for t in bench.tasks)
    full = {t.meta["problem_id"]: t for t in load_preset("gsm8k_test", data_dir).tasks}
    assert all(full[t.meta["problem_id"]].prompt == t.prompt for t in bench.tasks), "same problems, same ids"


def test_max_calculator_steps_outside_gsm8k_names_the_file_and_field(tmp_path, monkeypatch):
    monkeypatch.setattr(benchmarks, "presets_dir", lambda: tmp_path)
    (tmp_path / "bad.yaml").write_text("name: bad\nloader: math_jsonl\npath: x.jsonl\ntask: math\ngrader: math\n"
                                       "max_calculator_steps: 2\n")  # fmt: skip
    with pytest.raises(ValueError, match=r"bad\.yaml: field 'max_calculator_steps'"):
        load_preset("bad")


def test_benchmark_files_replace_the_default_presets_unless_benchmarks_are_named(tmp_path, data_dir):
    from afm_core.config.sampling import SamplingConfig
    from afm_core.eval.runner import describe_plan, load_benchmarks

    tasks = tmp_path / "mine.jsonl"
    record = {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "1+1?"}], "ability": "math",
              "reward_model": {"ground_truth": "2"}, "extra_info": {"index": "0"}}  # fmt: skip
    tasks.write_text(json.dumps(record) + "\n{broken\n")
    files, data, sampling = [str(tasks)], str(data_dir), SamplingConfig(k=4)
    assert [b.name for b in load_benchmarks(None, files, data, sampling)] == ["mine"]
    assert describe_plan(sampling, load_benchmarks(None, files, data, sampling)).splitlines() == [
        "[eval] will run 1 benchmark(s), 1 problems, 4 samples:",
        f"  mine: 1 problems x k=4 = 4 samples (file {tasks}, 1 malformed records skipped)",
    ]
    assert [b.name for b in load_benchmarks(None, [], data, sampling)] == ["gsm8k_test"]
    both = load_benchmarks(["gsm8k_test"], files, data, SamplingConfig(k=1, limit=3))
    assert [(b.name, len(b.tasks)) for b in both] == [("gsm8k_test", 3), ("mine", 1)]
    with pytest.raises(ValueError, match="nothing to evaluate"):
        load_benchmarks([], [], data, sampling)


def test_jobs_eval_refuses_a_missing_benchmark_file_before_submitting(tmp_path):
    import subprocess
    import sys

    from afm_core.utils.paths import repo_root

    missing = tmp_path / "nope.jsonl"
    done = subprocess.run([sys.executable, "-m", "jobs.eval", f"benchmark_files=[{missing}]",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=repo_root(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2 and f"jobs.eval: benchmark file {missing} not found (benchmark_files)" in done.stderr
    assert not (tmp_path / "run" / "logs").exists(), "a job was submitted"


@pytest.mark.parametrize(("name", "heldout", "distinct"), [("svamp", 300, 1000), ("mawps", 400, 1890)])
def test_test_only_sets_split_into_disjoint_heldout_and_rl_sides_after_dropping_repeats(
    data_dir, name, heldout, distinct
):
    from afm_core.eval.benchmarks import question_key
    from afm_core.rewards.math import grade_math

    sides = {split: load_preset(f"{name}_{split}", data_dir).tasks for split in ("heldout", "train")}
    keys = {split: [question_key(t.question) for t in tasks] for split, tasks in sides.items()}
    assert len(sides["heldout"]) == heldout and len(sides["heldout"]) + len(sides["train"]) == distinct
    assert not set(keys["heldout"]) & set(keys["train"]), "a question on both sides"
    assert all(len(set(k)) == len(k) for k in keys.values()), "a repeated question kept"
    again = load_preset(f"{name}_heldout", data_dir).tasks
    assert [t.id for t in again] == [t.id for t in sides["heldout"]], "the split is fixed by its seed"
    task = sides["heldout"][0]
    assert task.task == "math" and task.meta["grader"] == "math"
    assert grade_math(f"<answer>\\boxed{{{task.answer}}}</answer>", task.answer).score == 1.0


def test_mawps_repeats_differ_only_in_spacing_and_svamp_joins_body_and_question(data_dir):
    from afm_core.eval.benchmarks import question_key

    assert question_key("She has 27 seashell left . How many ?") == question_key("she has 27  seashell left. How many?")
    first = json.loads((data_dir / "math/svamp/test.jsonl").read_text().splitlines()[0])
    task = next(t for t in load_preset("svamp_train", data_dir).tasks if t.meta["problem_id"] == first["ID"])
    assert task.question == f"{first['Body']} {first['Question']}" and task.answer == "145"
    assert task.meta["equation"] == first["Equation"]


def test_a_split_without_its_size_names_the_file_and_field(tmp_path, monkeypatch):
    monkeypatch.setattr(benchmarks, "presets_dir", lambda: tmp_path)
    (tmp_path / "bad.yaml").write_text(
        "name: bad\nloader: svamp\npath: x.jsonl\ntask: math\ngrader: math\nsplit: train\n"
    )
    with pytest.raises(ValueError, match=r"bad\.yaml: field 'heldout_size'"):
        load_preset("bad")
