"""``python -m jobs.eval`` end to end on the real vLLM engine (tiny-llama) and real tool servers: a killed
eval resumes without recomputing or duplicating samples; malformed benchmark records are reported and
skipped; ``compare`` prints deltas with standard errors; the results go to TensorBoard and W&B (offline)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from afm_core.eval.samples import read_samples
from afm_core.utils.paths import repo_root
from tests.test_tracking import tensorboard_scalars, wandb_offline_runs

pytestmark = pytest.mark.slow


def _record(i: int, question: str, answer: str) -> dict:
    return {
        "data_source": "gsm8k",
        "prompt": [
            {
                "role": "user",
                "content": f"Solve it with <code> and give <answer>\\boxed{{}}</answer>.\n\nQuestion: {question}",
            }
        ],
        "ability": "math",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"index": str(i), "split": "test"},
    }


def _write_tasks(path: Path, n: int, bad_lines: dict[int, str] | None = None) -> None:
    lines = [json.dumps(_record(i, f"What is {i} + {i}?", str(2 * i))) for i in range(n)]
    for number, text in (bad_lines or {}).items():
        lines.insert(number - 1, text)
    path.write_text("\n".join(lines) + "\n")


def _eval_cmd(run_dir: Path, tasks: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jobs.eval", "model=tiny-llama", "benchmarks=[]", f"benchmark_files=[{tasks}]",
            "eval.k=2", "eval.max_response_tokens=48", "eval.concurrency=4", "engine.max_model_len=1024",
            f"hydra.run.dir={run_dir}", "tools.cache=null", *extra]  # fmt: skip


def _kill_tree(proc: subprocess.Popen) -> None:
    parent = psutil.Process(proc.pid)
    for child in [*parent.children(recursive=True), parent]:
        try:
            child.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=60)


def test_a_killed_eval_resumes_without_recomputing_or_duplicating_samples(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    _write_tasks(tasks, 12)
    run_dir = tmp_path / "run"
    samples = run_dir / "samples.jsonl"
    proc = subprocess.Popen(_eval_cmd(run_dir, tasks, "eval.concurrency=2"), cwd=repo_root(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and (not samples.exists() or len(samples.read_text().splitlines()) < 5):
        assert proc.poll() is None, "the eval ended before it could be killed"
        time.sleep(0.2)
    _kill_tree(proc)
    before = samples.read_bytes()
    kept = read_samples(samples)
    assert 5 <= len(kept) < 24, "killed halfway"
    per_problem = Counter(r["problem_id"] for r in kept)
    partial = [p for p, n in per_problem.items() if n < 2]
    assert len(partial) <= 2, f"problem-major: only the <= concurrency samples in flight are missing, not {partial}"

    # other sampling settings on the same run dir: refused before the queue, nothing appended (concurrency may change)
    other = subprocess.run(_eval_cmd(run_dir, tasks, "eval.temperature=0.5"), cwd=repo_root(), capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert other.returncode == 2, other.stderr[-3000:]
    assert (
        f"{run_dir / 'sample_settings.json'}: the samples in {run_dir} were drawn under other settings" in other.stderr
    )
    assert "settings (benchmarks.tasks.temperature: 0.8 -> 0.5); resuming would mix" in other.stderr, other.stderr
    assert samples.read_bytes() == before

    done = subprocess.run(_eval_cmd(run_dir, tasks), cwd=repo_root(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"24 samples, {len(kept)} already done, {24 - len(kept)} to run" in done.stdout
    after = samples.read_bytes()
    assert after.startswith(before[: before.rfind(b"\n") + 1]), "finished samples were rewritten"
    records = read_samples(samples)
    keys = [(r["problem_id"], r["sample"]) for r in records]
    assert len(after.decode().splitlines()) == len(records) == 24 == len(set(keys)), "a sample is missing or duplicated"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["tasks"]["n"] == 12 and metrics["tasks"]["samples"] == 24
    assert (run_dir / "report.md").is_file() and (run_dir / "eval.png").stat().st_size > 0


def test_benchmark_files_alone_evaluate_only_those_files_and_malformed_records_are_reported_with_file_line_and_field(
    tmp_path,
):
    """``benchmark_files`` without ``benchmarks``: only those files run (no default benchmark), listed before the
    job is submitted; two malformed records are named by file, line and field and the rest is evaluated; the
    run's metrics reach TensorBoard and W&B (offline) with the Slurm job id."""
    tasks = tmp_path / "tasks.jsonl"
    bad_field = json.dumps({k: v for k, v in _record(99, "q", "1").items() if k != "reward_model"})
    _write_tasks(tasks, 4, bad_lines={2: bad_field, 4: "{not json"})
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "SLURM_JOB_ID": "77"}
    cmd = [
        c for c in _eval_cmd(run_dir, tasks, "eval.k=1", "logger=[console,tensorboard,wandb]") if c != "benchmarks=[]"
    ]
    done = subprocess.run(cmd, cwd=repo_root(), capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = (
        "[eval] will run 1 benchmark(s), 4 problems, 4 samples:\n"
        f"  tasks: 4 problems x k=1 = 4 samples (file {tasks}, 2 malformed records skipped)"
    )
    assert plan in done.stdout, done.stdout[:1000]
    assert done.stdout.index(plan) < done.stdout.index("rank(s) on this machine"), "listed after the job started"
    assert list(json.loads((run_dir / "metrics.json").read_text())) == ["tasks"], "the default gsm8k_test ran too"
    assert {r["benchmark"] for r in read_samples(run_dir / "samples.jsonl")} == {"tasks"}
    assert "skipped records: 2" in done.stdout
    n = tensorboard_scalars(run_dir, "eval/tasks/n")
    assert n == [(0, 4.0)] and len(tensorboard_scalars(run_dir, "eval/tasks/avg@1")) == 1
    (run,) = wandb_offline_runs(run_dir)
    assert run["history"][0]["eval/tasks/n"] == 4 and run["config"]["afm"]["slurm_job_id"] == "77"
    skipped = json.loads((run_dir / "skipped_records.json").read_text())["tasks"]
    assert skipped == [f"{tasks}:2: missing field 'reward_model'",
                       f"{tasks}:4: invalid JSON (Expecting property name enclosed in double quotes at column 2)"]  # fmt: skip
    metrics = json.loads((run_dir / "metrics.json").read_text())["tasks"]
    assert metrics["n"] == 4 and metrics["skipped_records"] == 2

    compare = subprocess.run([sys.executable, "-m", "jobs.eval", "compare", str(run_dir), str(run_dir)], cwd=repo_root(),
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert compare.returncode == 0, compare.stderr
    assert "| tasks | 4 |" in compare.stdout and "+0.0" in compare.stdout
