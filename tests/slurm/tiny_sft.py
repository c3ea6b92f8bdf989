"""The real SFT job at test size, run through its CLI (``python -m jobs.sft``)."""

from __future__ import annotations

import subprocess
import sys

from afm_core.utils.paths import repo_root

TINY = [  # tiny-llama on a 114-trajectory slice of the real traces (its own cache dir, prepared once)
    "model=tiny-llama", "data.name=jobs-tests", "data.sources.gsm8k=60", "data.sources.fireact=20",
    "data.sources.r1searcher=20", "data.sources.tora=20", "trainer.global_batch_size=2",
    "trainer.eval_interval=1000", "trainer.eval_sequences=2", "trainer.save_interval=1000", "trainer.keep_last=1",
    "trainer.progress=false",
]


def jobs_sft(*overrides: str) -> str:
    """Run ``python -m jobs.sft *overrides``; its stdout (the test fails on a non-zero exit)."""
    done = subprocess.run([sys.executable, "-m", "jobs.sft", *overrides], cwd=repo_root(), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, f"jobs.sft {' '.join(overrides)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout
