"""``python -m jobs.sft`` on this machine with the real trainer: rank-0 output and the summary on the terminal,
logs in RUN_DIR/logs, and manual resume with ``resume=RUN_DIR``."""

from __future__ import annotations

import json

import pytest

from afm_core.launch.records import read_events, read_job_record
from afm_core.train.metrics import read_metrics
from afm_core.utils.paths import shared_data_dir
from tests.slurm.tiny_sft import TINY, jobs_sft

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not shared_data_dir().is_dir(), reason=f"no shared data at {shared_data_dir()}"),
]


def test_local_run_then_manual_resume(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    out = jobs_sft(*TINY, "trainer.max_steps=3", f"hydra.run.dir={first}")
    assert "[sft] done at step 3/3" in out  # rank 0's own summary, streamed while waiting
    summary = json.loads(out[out.index("\n{") + 1 :])  # then the returned summary
    assert summary["step"] == 3 and summary["stopped_early"] is False and summary["run_dir"] == str(first)
    record = read_job_record(first / "logs")
    assert record["cluster"] == "local" and record["stdout"].startswith(str(first / "logs"))
    assert [e["event"] for e in read_events(first / "logs")] == ["start", "completed"]

    out = jobs_sft(*TINY, "trainer.max_steps=5", f"resume={first}", f"hydra.run.dir={second}")
    summary = json.loads(out[out.index("\n{") + 1 :])
    assert summary["resumed_from"] == str(first / "checkpoints" / "step_00000003") and summary["step"] == 5
    steps = [r["step"] for r in read_metrics(second / "metrics.jsonl") if r["split"] == "train"]
    assert steps == [1, 2, 3, 4, 5]  # the first run's history, then the resumed steps, each once
