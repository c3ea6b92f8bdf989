"""jobs.pipeline: stages run in order as their own jobs, each export feeding the next; a failed (or preempted)
chain resumes at the unfinished stage in its own run dir; the shipped AutoCoA recipes compose and pass the schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from afm_core.launch.pipeline import PipelineError, parse_stages, run_pipeline
from afm_core.utils.paths import repo_root

STAND_IN = Path(__file__).with_name("stand_in_stage.py")
STAGES = [
    {"name": "s1", "job": "sft", "recipe": "autocoa_stage1", "overrides": ["trainer.max_steps=4"]},
    {"name": "s2", "job": "sft", "recipe": "autocoa_stage2", "overrides": []},
    {"name": "r1", "job": "rl", "recipe": "autocoa_rl_stage1", "overrides": ["trainer.max_steps=2"]},
]
CLUSTER = {"name": "local", "dp": 1, "timeout_min": 600, "wait": False, "setup": ["echo a b"]}


def stand_in_runner(command: list[str]) -> int:
    assert command[:2] == [sys.executable, "-m"] and command[2] in ("jobs.sft", "jobs.rl")
    return subprocess.call([sys.executable, str(STAND_IN), command[2].split(".")[1], *command[3:]])


def _calls(stage_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (stage_dir / "calls.jsonl").read_text().splitlines()]


def test_stages_chain_their_exports_and_a_failed_chain_resumes_at_its_stage(tmp_path, monkeypatch):
    cfg = {"run_dir": str(tmp_path), "stages": STAGES, "overrides": ["model=tiny-llama"], "cluster": CLUSTER}
    monkeypatch.setenv("AFM_TEST_FAIL_STAGE", "s2")
    with pytest.raises(PipelineError, match=r"stage 1 s2 failed \(exit status 3\)"):
        run_pipeline(cfg, runner=stand_in_runner)
    state = json.loads((tmp_path / "pipeline.json").read_text())
    assert list(state["stages"]) == ["s1"] and not (tmp_path / "2_r1").exists()

    summary = run_pipeline(cfg, runner=stand_in_runner)  # again, on the same run dir
    assert [(s["name"], s["skipped"]) for s in summary["stages"]] == [("s1", True), ("s2", False), ("r1", False)]
    assert len(_calls(tmp_path / "0_s1")) == 1  # the finished stage did not run again
    s2_calls = _calls(tmp_path / "1_s2")
    assert len(s2_calls) == 2 and s2_calls[0] == s2_calls[1]  # the same command in the same run dir: it resumes
    assert summary["stages"][1]["resumed"] is True

    first, second, third = (_calls(tmp_path / d)[-1]["overrides"] for d in ("0_s1", "1_s2", "2_r1"))
    assert first[:3] == [f"hydra.run.dir={tmp_path / '0_s1'}", "recipe=autocoa_stage1", "model=tiny-llama"]
    assert "trainer.max_steps=4" in first and not any(o.startswith("model.hf_path") for o in first)
    assert second[-1] == f"model.hf_path={tmp_path / '0_s1' / 'hf'}"
    assert third[-1] == f"model.hf_path={tmp_path / '1_s2' / 'hf'}" and _calls(tmp_path / "2_r1")[0]["job"] == "rl"
    for overrides in (first, second, third):
        assert {"cluster=local", "cluster.dp=1", 'cluster.setup=["echo a b"]', "cluster.wait=true"} <= set(overrides)
    assert summary["hf_dir"] == str(tmp_path / "2_r1" / "hf")
    assert summary["stages"][2]["metrics"]["accuracy"] == [0.0, 0.25]
    table = (tmp_path / "summary.md").read_text()
    assert "| s1 | sft | 4 |" in table and "eval_loss 2.0 -> 1.5" in table.replace("2.000", "2.0").replace(
        "1.500", "1.5"
    )

    done = run_pipeline(cfg, runner=stand_in_runner)  # everything finished: nothing runs
    assert all(s["skipped"] for s in done["stages"]) and len(_calls(tmp_path / "2_r1")) == 1

    changed = {**cfg, "stages": [STAGES[0], {**STAGES[1], "overrides": ["optim.lr=1e-5"]}, STAGES[2]]}
    with pytest.raises(PipelineError, match="stage 's2' finished as"):
        run_pipeline(changed, runner=stand_in_runner)


def test_a_stage_without_an_export_and_bad_stage_lists_are_errors(tmp_path):
    cfg = {"run_dir": str(tmp_path), "stages": STAGES[:1], "overrides": [], "cluster": CLUSTER}
    with pytest.raises(PipelineError, match="without an HF export"):
        run_pipeline(cfg, runner=lambda command: 0)

    def second_chain(command: list[str]) -> int:  # a second pipeline on the same run dir while the first runs
        with pytest.raises(PipelineError, match="another pipeline is running"):
            run_pipeline(cfg, runner=stand_in_runner)
        return stand_in_runner(command)

    assert run_pipeline(cfg, runner=second_chain)["stages"][0]["name"] == "s1"
    with pytest.raises(ValueError, match="no stage"):
        parse_stages([])
    with pytest.raises(ValueError, match=r"stages\[1\].name='s1': another stage"):
        parse_stages([STAGES[0], {**STAGES[1], "name": "s1"}])
    with pytest.raises(ValueError, match=r"stages\[0\].job=.serve."):
        parse_stages([{"name": "a", "job": "serve"}])
    with pytest.raises(ValueError, match="unknown key"):
        parse_stages([{"name": "a", "job": "sft", "recipes": "x"}])


def test_the_demo_recipe_composes_every_stage_and_a_bad_override_fails_before_anything_runs(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from afm_core.config import register_schemas
    from afm_core.launch.pipeline import cluster_overrides, stage_dir, stage_overrides
    from jobs.pipeline import check_stage

    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        cfg = compose(config_name="pipeline", overrides=["recipe=autocoa_demo", f"run_dir={tmp_path}"])
        specs = parse_stages(cfg.stages)
        assert [(s.job, s.recipe) for s in specs] == [
            ("sft", "autocoa_stage1"),
            ("sft", "autocoa_stage2"),
            ("sft", "autocoa_stage3"),
            ("rl", "autocoa_rl_stage1"),
            ("rl", "autocoa_rl_stage2"),
        ]
        cluster = cluster_overrides(OmegaConf.to_container(cfg.cluster))
        for i, spec in enumerate(specs):
            hf = None if i == 0 else "/x/hf"
            check_stage(spec, stage_overrides(spec, stage_dir(tmp_path, i, spec), common=list(cfg.overrides),
                                              cluster=cluster, model_hf_path=hf))  # fmt: skip
            staged = compose(config_name=spec.job, overrides=[f"recipe={spec.recipe}", *spec.overrides])
            if spec.job == "rl":
                assert staged.rollout.environment == ("simulated" if spec.recipe.endswith("1") else "real")
            else:
                assert staged.data.mask_observations == (spec.recipe != "autocoa_stage3")

    demo = [sys.executable, "-m", "jobs.pipeline", "recipe=autocoa_demo", f"hydra.run.dir={tmp_path / 'demo'}"]
    bad = subprocess.run([*demo, "overrides=['trainer.max_step=1']"], cwd=repo_root(), capture_output=True, text=True)
    assert bad.returncode == 2 and "stage 'sft_stage1' (sft)" in bad.stderr and "max_step" in bad.stderr
    assert not (tmp_path / "demo" / "pipeline.json").exists()
