"""Experiment tracking (afm_core.utils.tracking) with the real libraries, read back from what they wrote:
TensorBoard event files through TensorBoard's EventAccumulator, W&B offline run files through W&B's own
protobuf records, MLflow runs through MlflowClient; a resumed run continues the same runs with no step twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afm_core.utils.tracking import Tracker, read_run_ids

ALL = ["console", "tensorboard", "wandb", "mlflow"]


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of a scalar tag as TensorBoard shows it (purged steps dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), purge_orphaned_data=True)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def wandb_records(path: Path):
    """The protobuf records of a W&B run file (``run-<id>.wandb``): a 7-byte header (``:W&B``, magic, version),
    then the LevelDB log format (google/leveldb ``doc/log_format.md``: 32 KiB blocks of chunks with a 7-byte
    header: crc32c, length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4), each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + chunk)
            pending = b""
            yield record
        elif kind in (2, 3):
            pending += chunk


def wandb_offline_runs(run_dir: Path) -> list[dict]:
    """Per offline run directory: its run id, config and history rows (``{key: value}`` with ``_step``)."""
    runs = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        run = {"id": None, "config": {}, "history": []}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                run["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                run["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                run["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                       for i in record.history.item})  # fmt: skip
        runs.append(run)
    return runs


def mlflow_history(run_dir: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").absolute().as_uri())
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def log_steps(tracker: Tracker, steps: range) -> None:
    for step in steps:
        tracker.write({"step": step, "split": "train", "loss": 10.0 - step, "lr": 1e-4, "note": "text"})
    tracker.close()


def test_every_backend_logs_the_steps_config_commit_and_job_id_and_a_resumed_run_continues_without_repeats(tmp_path):
    config = {"trainer": {"max_steps": 5}, "optim": {"lr": 1e-4}}
    first = Tracker(tmp_path, ALL, config=config, job_type="sft")
    ids = dict(first.run_ids)
    assert set(ids) == {"wandb", "mlflow"} and read_run_ids(tmp_path) == ids
    log_steps(first, range(1, 5))  # steps 1-4 logged; the "checkpoint" is at step 2, then the job is killed

    second = Tracker(tmp_path, ALL, config=config, job_type="sft", run_ids=ids, resume_step=2)
    assert second.run_ids == ids, "the resumed job reopened other runs"
    log_steps(second, range(3, 6))  # steps 3-4 again (bit-identical on resume), then 5

    expected = [(s, 10.0 - s) for s in range(1, 6)]
    assert tensorboard_scalars(tmp_path, "train/loss") == expected
    assert mlflow_history(tmp_path, ids["mlflow"], "train/loss") == expected
    runs = wandb_offline_runs(tmp_path)
    assert [r["id"] for r in runs] == [ids["wandb"]] * 2, "one offline dir per start, both of the same run"
    steps = [row["_step"] for r in runs for row in r["history"] if "train/loss" in row]
    assert steps == [1, 2, 3, 4, 5], "a step was logged twice to W&B"
    assert all("train/note" not in row for r in runs for row in r["history"])
    afm = runs[0]["config"]["afm"]
    assert afm["slurm_job_id"] == "4242" and len(afm["git_commit"].removesuffix("-dirty")) == 40
    assert runs[0]["config"]["trainer"] == {"max_steps": 5}

    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=(tmp_path / "mlruns").absolute().as_uri()).get_run(ids["mlflow"])
    assert run.data.params["trainer.max_steps"] == "5" and run.data.tags["afm.slurm_job_id"] == "4242"
    assert run.data.tags["afm.git_commit"] == afm["git_commit"]
    recorded = json.loads((tmp_path / "tracking.json").read_text())
    assert recorded["config"] == config and recorded["slurm_job_id"] == "4242"
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5] and lines[0]["note"] == "text"


def test_the_backends_leave_the_trainers_python_rng_as_they_found_it(tmp_path, monkeypatch):
    """MLflow's file store pads each leading zero of a fresh experiment id's UUID digits with
    ``random.randint(0, 9)`` (about one experiment in ten): the trainer seeds and checkpoints python's ``random``,
    so a tracked run would resume to another RNG state than its uninterrupted twin (tests/rl/test_driver.py). Here
    the UUID has leading zeros every time."""
    import random
    import uuid

    from mlflow.tracking import MlflowClient

    zeros = uuid.UUID(int=10**20 + 12345)  # its last 18 decimal digits, mlflow's id: 000000000000012345
    monkeypatch.setattr(uuid, "uuid4", lambda: zeros)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3's file store is opt-in (as MlflowBackend sets)
    random.seed(0)
    before = random.getstate()
    MlflowClient(tracking_uri=(tmp_path / "bare").absolute().as_uri()).create_experiment("afm")
    assert random.getstate() != before, "MLflow no longer draws from random here: this test shows nothing"

    random.seed(0)
    tracker = Tracker(tmp_path / "run", ALL, config={}, job_type="rl")
    log_steps(tracker, [1, 2])
    assert random.getstate() == before


def test_an_unknown_logger_is_refused_naming_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown 'tensorbord'; valid: console, tensorboard, wandb, mlflow"):
        Tracker(tmp_path, ["console", "tensorbord"], config={}, job_type="sft")


@pytest.mark.slow
def test_a_requeued_sft_job_continues_its_wandb_and_tensorboard_runs_and_profiles_the_chosen_steps(tmp_path):
    import shutil

    import torch

    from afm_core.engine.checkpoint_dirs import checkpoint_dir_name
    from afm_core.engine.metrics import read_metrics
    from tests.test_sft_run import OVERRIDES, run_sft_spawned

    run_dir = tmp_path / "run"
    common = [*OVERRIDES, f"run_dir={run_dir}", "trainer.save_interval=2", "trainer.eval_interval=100",
              "trainer.export_hf=false", "logger=[console,tensorboard,wandb]"]  # fmt: skip
    run_sft_spawned([*common, "trainer.max_steps=3", "profile.enabled=true", "profile.steps=[1,2]"], tmp_path / "a")
    ids = json.loads((run_dir / "tracking.json").read_text())["run_ids"]
    saved = torch.load(run_dir / "checkpoints" / checkpoint_dir_name(2) / "common.pt", weights_only=False)
    assert saved["afm"]["progress"]["run_ids"] == ids and set(ids) == {"wandb"}
    shutil.rmtree(run_dir / "checkpoints" / checkpoint_dir_name(3))  # killed after logging step 3, before its save

    second = run_sft_spawned([*common, "trainer.max_steps=4"], tmp_path / "b")
    assert second["resumed_from"].endswith(checkpoint_dir_name(2)) and second["step"] == 4
    losses = {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["split"] == "train"}
    assert list(losses) == [1, 2, 3, 4]
    board = tensorboard_scalars(run_dir, "train/loss")
    assert [s for s, _ in board] == [1, 2, 3, 4] and all(v == pytest.approx(losses[s]) for s, v in board)
    runs = wandb_offline_runs(run_dir)
    assert [r["id"] for r in runs] == [ids["wandb"]] * 2
    assert [row["_step"] for r in runs for row in r["history"] if "train/loss" in row] == [1, 2, 3, 4]
    assert [row["_step"] for r in runs for row in r["history"] if "eval/loss" in row] == [0, 3, 4]

    traces = list((run_dir / "profile").glob("rank0*.pt.trace.json"))
    assert len(traces) == 1, "one trace of steps 1-2 on rank 0"
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"step 1", "step 2"} <= names and "step 3" not in names


@pytest.mark.parametrize(
    "override, message",
    [("logger=[console,tensorbord]", "logger=\\['console', 'tensorbord'\\]: a list of console, tensorboard"),
     ("profile.steps=[3,2]", "profile.steps=\\[3, 2\\]: \\[first, last\\] optimizer steps")],
)  # fmt: skip
def test_the_sft_schema_refuses_a_bad_logger_or_profile_range_naming_the_key(override, message):
    from hydra import compose, initialize_config_dir

    from afm_core.config import ConfigError, check_config, register_schemas
    from afm_core.config.sft import SFTConfig
    from afm_core.utils.paths import repo_root

    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        cfg = compose(config_name="sft", overrides=["run_dir=/tmp/x", override])
    with pytest.raises(ConfigError, match=message):
        check_config(cfg, SFTConfig)
