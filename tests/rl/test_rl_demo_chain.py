"""``make rl-demo``'s chain (conf/recipe/rl_demo_pipeline.yaml) wired end to end on tiny-llama: every stage runs as
its own job (SFT warm start, two pass-rate selections, the before-eval of the slice and the full held-out set, DAPO,
the after-eval), later stages read earlier
ones' outputs, and summary.json carries the report's keys. It checks the wiring, not the gain (a tiny random model
solves nothing, so the selection keeps every problem here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from afm_core.utils.hardware import SPEED_FLAGS
from afm_core.utils.paths import repo_root, shared_data_dir
from tests.slurm.tiny_sft import TINY

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not all((shared_data_dir() / f"math/{name}/test.jsonl").is_file() for name in ("gsm8k", "mawps")),
        reason="needs the shared GSM8K (warm start) and MAWPS (RL) data (../shared/data)",
    ),
]

SMALL_EVAL = ["eval.limit=3", "eval.k=2", "eval.max_response_tokens=48", "eval.concurrency=8", "engine.max_model_len=1024",
              "engine.cpu_kv_cache_gib=0.25", "engine.max_num_seqs=8", "engine.enforce_eager=true"]  # fmt: skip
JOB_OVERRIDES = {
    "sft": [
        *TINY[1:],
        "trainer.max_steps=2",
        "trainer.seq_length=512",
        "trainer.micro_batch_size=1",
        "trainer.precision=fp32",
    ],
    "filter_rl": [*SMALL_EVAL, "filter.min_pass_rate=null", "filter.drop_all_correct=false"],
    "eval": SMALL_EVAL,
    "rl": [
        "trainer.max_steps=1",
        "trainer.save_interval=100",
        "trainer.micro_batch_size=2",
        "trainer.precision=fp32",
        "rollout.n=2",
        "rollout.max_response_len=48",
        "rollout.concurrency=8",
        "algorithm.train_batch_size=2",
        "algorithm.gen_batch_size=2",
        "algorithm.mini_batch_size=1",
        "algorithm.filter_groups=false",
        "engine.cpu_kv_cache_gib=0.25",
        "engine.max_num_seqs=8",
        "engine.enforce_eager=true",
    ],
}


def test_the_rl_demo_chain_runs_every_stage_on_tiny_llama_and_writes_the_report(tmp_path):
    run_dir = tmp_path / "rl-demo"
    command = [sys.executable, "-m", "jobs.pipeline", "recipe=rl_demo_pipeline", f"hydra.run.dir={run_dir}",
               "overrides=['model=tiny-llama']"]  # fmt: skip
    command += [f"+job_overrides.{job}=[{','.join(repr(v) for v in values)}]" for job, values in JOB_OVERRIDES.items()]
    done = subprocess.run(command, cwd=repo_root(), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    names = [s["name"] for s in summary["stages"]]
    assert names == ["warm", "heldout_slice", "train_slice", "before", "rl", "after"]
    stages = {s["name"]: s for s in summary["stages"]}
    # each stage saw the model it should: the warm start before RL, the RL export after it
    assert stages["before"]["command"][-1] == f"model.hf_path={run_dir / '0_warm' / 'hf'}"
    assert stages["after"]["command"][-1] == f"model.hf_path={run_dir / '4_rl' / 'hf'}"
    assert f"data.files=[{run_dir / '2_train_slice'}/rl_data.parquet]" in stages["rl"]["command"]
    slice_ = summary["heldout_slice"]
    assert slice_["n_problems"] == 3 and slice_["k"] == 2 and slice_["selection"]["k"] == 2
    assert {"before", "after", "se", "z"} <= set(slice_)
    assert set(summary["full_heldout"]) == {"before", "after"}
    assert summary["median_step_s"] > 0 and summary["rl_wall_s"] > 0 and summary["max_rss_gib"] > 0
    assert summary["total_wall_s"] >= summary["rl_wall_s"]
    machine = summary["machine"]  # what ran it, for the README's table
    assert machine["cpu"] and machine["threads"] >= 1 and machine["precision"] in ("bf16", "fp32")
    assert set(machine["flags"]) <= set(SPEED_FLAGS)
    # the before-evals used another seed than the selection
    assert "eval.seed=1" in stages["before"]["command"]

    again = subprocess.run(command, cwd=repo_root(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout.count("skipped") >= 6  # idempotent: nothing runs twice
