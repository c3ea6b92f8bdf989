"""``runs.jsonl``'s settings guard: a resumed distillation adds runs only under the teachers, roles, sampling and
MAS limits its runs were drawn under (eval's guard, ``sample_settings.json``); ``jobs.distill`` refuses other
settings before the queue, naming each field."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from afm_core.config import register_schemas
from afm_core.config.eval import distill_config
from afm_core.distill.runner import RUNS_FILE, check_resume
from afm_core.eval.samples import SETTINGS_FILE
from afm_core.utils.paths import repo_root

CHAT = ["teachers.main.backend=chat", "teachers.main.url=http://127.0.0.1:9/v1", "teachers.main.model=teacher-a"]


def _config(run_dir, *overrides):
    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        cfg = compose(config_name="distill", overrides=[f"run_dir={run_dir}", *overrides])
    return distill_config(cfg)


def _one_run(run_dir):
    """``runs.jsonl`` holding one finished run (the keys the resume reads)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUNS_FILE).write_text(json.dumps({"benchmark": "gsm8k_train", "problem_id": "0", "sample": 0}) + "\n")


def test_a_resume_under_other_teachers_roles_or_limits_names_each_field(tmp_path):
    assert check_resume(_config(tmp_path, *CHAT), record=True) == set()  # a fresh run dir records its settings
    recorded = json.loads((tmp_path / SETTINGS_FILE).read_text())
    assert recorded["roles"]["planner"] == {"teacher": "main", "backend": "chat", "model": "teacher-a",
                                            "temperature": 0.7, "top_p": 1.0, "max_tokens": 128}  # fmt: skip
    assert recorded["mas"]["max_tool_calls"] == 8 and recorded["engine"] is None  # no role uses the job's engine
    _one_run(tmp_path)
    # how a teacher is reached and how many runs there are do not decide a run: the resume goes on
    same = _config(tmp_path, *CHAT, "teachers.main.url=http://10.0.0.2:8000/v1", "teachers.main.concurrency=4",
                   "distill.limit=40", "distill.samples=2")  # fmt: skip
    assert check_resume(same) == {("gsm8k_train", "0", 0)}

    other = _config(
        tmp_path, *CHAT, "teachers.main.model=teacher-b", "+roles.planner.temperature=0.2", "mas.max_tool_calls=4"
    )
    with pytest.raises(ValueError) as err:
        check_resume(other, record=True)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / SETTINGS_FILE}: the runs in {tmp_path} were drawn under other settings")
    assert "mas.max_tool_calls: 8 -> 4" in message and "roles.planner.temperature: 0.7 -> 0.2" in message
    assert "roles.verifier.model: 'teacher-a' -> 'teacher-b'" in message
    assert json.loads((tmp_path / SETTINGS_FILE).read_text()) == recorded, "a refused resume leaves the record"


def test_jobs_distill_refuses_other_settings_before_the_queue(tmp_path):
    run_dir = tmp_path / "run"
    check_resume(_config(run_dir), record=True)  # the defaults: the embedded model through the job's engine
    _one_run(run_dir)
    before = (run_dir / RUNS_FILE).read_bytes()
    done = subprocess.run([sys.executable, "-m", "jobs.distill", f"hydra.run.dir={run_dir}", "engine.seed=7"],
                          cwd=repo_root(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        f"jobs.distill: {run_dir / SETTINGS_FILE}: the runs in {run_dir} were drawn under other settings" in done.stderr
    )
    assert "(engine.seed: 0 -> 7); resuming would mix" in done.stderr
    assert (run_dir / RUNS_FILE).read_bytes() == before and not (run_dir / "logs").exists()  # nothing submitted
