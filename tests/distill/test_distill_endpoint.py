"""``jobs.distill`` end to end against a real OpenAI-compatible chat server on 127.0.0.1 (a scripted teacher), with
the real tools (sandbox, wiki_search over HotpotQA-500) started by the job: every run recorded, converted
trajectories valid, each filter's counts exactly as the scripts imply, a rerun redoes nothing, and the SFT data
config finds ``sft_data/`` ready. A user's endpoint is configured the same way (``teachers.X.backend=chat``)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from afm_core.coa.grammar import validate_text
from afm_core.config import check_config, register_schemas
from afm_core.config.eval import distill_config
from afm_core.config.sft import SFTConfig
from afm_core.data.prepare import is_prepared, recorded_config, resolve_out_dir
from afm_core.data.schema import read_prepared
from afm_core.distill.runner import run_distill
from afm_core.eval.benchmarks import load_preset
from afm_core.eval.samples import read_samples
from afm_core.utils.paths import repo_root
from tests.distill.scripted_teacher import REQUESTS, scripted_app, serve_in_thread
from tests.tools.conftest import jail_unavailable

pytestmark = pytest.mark.slow  # ~5 s alone, 18 s on the loaded machine (tool servers start)

SCRIPTS = [  # (benchmark, index) -> script; what each must do to the filters is in the comment
    ("gsm8k_train", 0, {"calls": 5, "fix_after_check": True}),  # kept, upsampled x2 (error correction)
    ("gsm8k_train", 1, {"calls": 5, "reflect": False}),  # reflection: math without reflection
    ("gsm8k_train", 2, {"calls": 2}),  # complexity: 2 < 5 tool calls
    ("hotpotqa500", 0, {"calls": 5}),  # kept
    ("hotpotqa500", 1, {"calls": 5, "wrong": True}),  # quality: wrong answer (after a re-plan)
    ("hotpotqa500", 2, {"calls": 6, "repeat": True}),  # quality: redundant tool inputs
]


def _config(run_dir, url, data_dir, *extra):
    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        cfg = compose(config_name="distill", overrides=[
            f"run_dir={run_dir}", f"data_dir={data_dir}", "distill.limit=3", "distill.concurrency=6",
            "teachers.main.backend=chat", f"teachers.main.url={url}", "teachers.main.model=scripted",
            "mas.context_events=100", "data.heldout_fraction=0", "tools.cache=null",
            "tool_servers.start=always", "+tool_servers.servers.sandbox.max_concurrency=2", *extra,
        ])  # fmt: skip
    return distill_config(cfg)


@pytest.fixture(scope="module")
def scripts(data_dir):
    found = {}
    for bench, index, script in SCRIPTS:
        task = load_preset(bench, data_dir).tasks[index]
        gold = task.answer.split("|")[0]
        found[task.question] = {"task": task.task, "gold": gold, "keyword": task.question.split()[-1], **script}
    return found


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, scripts, data_dir):
    if reason := jail_unavailable():
        pytest.skip(reason)
    run_dir = tmp_path_factory.mktemp("distill") / "run"
    app = scripted_app(scripts)
    with serve_in_thread(app) as url:
        report = run_distill(_config(run_dir, url, data_dir, "logger=[console,tensorboard]"))
        again = run_distill(_config(run_dir, url, data_dir, "logger=[console,tensorboard]"))
    return run_dir, report, again, app[REQUESTS]


def test_every_run_is_recorded_with_its_role_messages_and_tool_calls(distilled):
    run_dir, report, _, requests = distilled
    records = read_samples(run_dir / "runs.jsonl")
    assert len(records) == report["runs"] == report["total"] == 6
    for record in records:
        roles = {e["role"] for e in record["events"]}
        assert {"planner", "thinker", "verifier", "tool"} <= roles
        for event in record["events"]:
            if event["kind"] == "tool_call":
                assert event["query"] and event["observation"] and event["error"] is None, event
            else:
                assert event["teacher"] == "main" and event["messages"][0]["role"] == "system"
                assert event["error"] is None and event["seconds"] >= 0
    calls = sum(1 for r in records for e in r["events"] if e["kind"] != "tool_call")
    assert calls == len(requests) and all(r["model"] == "scripted" for r in requests)
    by_id = {r["problem_id"]: r for r in records if r["benchmark"] == "gsm8k_train"}
    assert by_id["0"]["replans"] == 1 and by_id["0"]["grade"]["correct"]
    code_calls = [e for e in by_id["0"]["events"] if e["kind"] == "tool_call"]
    assert [e["observation"].split("[STDOUT:BEGIN]\n")[1].split("\n")[0] for e in code_calls] == [
        str(n + 1) for n in range(5)
    ]  # printed by the real sandbox


def test_trajectories_pass_the_validator_and_carry_the_role_blocks(distilled):
    run_dir, report, _, _ = distilled
    lines = (run_dir / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == report["converted"] == 6 and report["failing_validator"] == 0
    for line in lines:
        trajectory = json.loads(line)
        tags = [s["tag"] for s in trajectory["steps"]]
        assert tags[0] == "plan" and tags[-1] == "answer" and "double_check" in tags
    first = json.loads(lines[0])
    tags = [s["tag"] for s in first["steps"]]
    assert tags.count("suggested_answer") == 2 and tags.count("plan") == 2 and "reflection" in tags
    assert tags.count("code") == tags.count("observation") == 5
    rows = read_prepared(run_dir / "sft_data" / "train.parquet").to_pylist()
    assert rows and all(validate_text(row["response"]) == [] for row in rows)


def test_each_filter_reports_its_counts(distilled):
    _, report, _, _ = distilled
    stages = {s["name"]: s for s in report["filters"]["stages"]}
    assert stages["complexity"] == {"name": "complexity", "input": 6, "kept": 5, "dropped": {"few_tool_calls": 1}}
    assert stages["quality"] == {"name": "quality", "input": 5, "kept": 3,
                                 "dropped": {"redundant_tool_inputs": 1, "wrong_answer": 1}}  # fmt: skip
    assert stages["reflection"] == {"name": "reflection", "input": 3, "kept": 2, "dropped": {"no_reflection": 1}}
    assert stages["dedup"] == {"name": "dedup", "input": 2, "kept": 2, "dropped": {}}
    assert report["filters"]["upsampling"]["train_trajectories_upsampled"] == 1
    assert report["filters"]["upsampled_rows"] == 1 and report["split"]["train_rows"] == 3


def test_a_rerun_redoes_nothing_and_sft_finds_the_data_ready(distilled):
    run_dir, report, again, _ = distilled
    assert again["runs"] == 6 and again["seconds_this_job"] == 0.0
    assert again["filters"] == report["filters"]
    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        sft = compose(config_name="sft", overrides=["run_dir=/tmp/x", "data=distill", "data.heldout_fraction=0",
                                                    f"data.sources.trajectories.path={run_dir / 'trajectories.jsonl'}",
                                                    f"data.out_dir={run_dir / 'sft_data'}"])  # fmt: skip
    check_config(sft, SFTConfig)  # the SFT job's own schema accepts data=distill with this run's files
    assert resolve_out_dir(sft.data) == run_dir / "sft_data"
    assert is_prepared(run_dir / "sft_data", recorded_config(sft.data))
    assert pq.read_metadata(run_dir / "sft_data" / "train.parquet").num_rows == 3


def test_the_report_goes_to_tensorboard_once_even_after_a_rerun(distilled):
    from tests.test_tracking import tensorboard_scalars

    run_dir, report, _, _ = distilled
    assert tensorboard_scalars(run_dir, "distill/runs") == [(0, 6.0)]
    kept = tensorboard_scalars(run_dir, "distill/split.train_rows")
    assert kept == [(0, float(report["split"]["train_rows"]))]
