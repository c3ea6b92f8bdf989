"""The load benchmark runs 64 concurrent sandbox calls (warm and cold) and 1,000 wiki_search queries with no errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools.conftest import jail_unavailable

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(jail_unavailable() is not None, reason="bubblewrap cannot create namespaces here")
def test_benchmark_runs_without_errors(tmp_path, data_dir):
    out = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.tools_load", "--data-dir", str(data_dir), "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {row["phase"]: row for row in json.loads(out.read_text())}
    assert rows["sandbox warm 64 concurrent"]["calls"] == rows["sandbox cold 64 concurrent"]["calls"] == 64
    assert rows["wiki_search 1000 queries"]["calls"] == 1000 and "concurrent_throughput_ratio" in rows["warm vs cold"]
    failed = {phase: row.get("first_failure") for phase, row in rows.items() if row["failures"]}
    assert not failed, failed  # each failing phase with its first failing observation, whole
