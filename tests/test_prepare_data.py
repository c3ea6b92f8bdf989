"""jobs.prepare_data end to end on the real traces: schema, split, determinism, caching, atomicity, CLI."""

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from afm_core.coa.grammar import validate_text
from afm_core.coa.prompts import user_prompt
from afm_core.coa.trajectory import Step, Trajectory
from afm_core.data import prepare as prepare_module
from afm_core.data.converters.r1searcher import R1SEARCHER
from afm_core.data.formats import read_rl_tasks
from afm_core.data.prepare import (
    DataFilters,
    ensure_prepared,
    export_prepared,
    filter_trajectories,
    is_error_correction,
    prepare,
    read_prepared_trajectories,
    resolve_out_dir,
    split_by_task,
)  # fmt: skip
from afm_core.data.schema import PREPARED_SCHEMA, read_prepared, task_id
from afm_core.utils.paths import repo_root, shared_data_dir

SHARED = shared_data_dir()
needs_data = pytest.mark.skipif(
    not SHARED.is_dir(), reason=f"real data folder {SHARED} is absent (set AFM_SHARED_DATA)"
)
SOURCES = {"gsm8k": 40, "fireact": None, "r1searcher": 40, "tora": None}


def data_cfg(out_dir, **overrides):
    return {"name": "coa_traces", "shared_dir": None, "out_dir": str(out_dir), "sources": dict(SOURCES),
            "heldout_fraction": 0.1, "split_seed": 0, "mask_observations": True, "pack": True, **overrides}  # fmt: skip


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare(data_cfg(tmp_path_factory.mktemp("prep") / "coa"))


@needs_data
def test_schema_and_rows(prepared):
    assert sorted(p.name for p in prepared.iterdir()) == ["heldout.parquet", "report.json", "train.parquet"]
    for split in ("train", "heldout"):
        table = pq.read_table(prepared / f"{split}.parquet")
        assert table.schema.equals(PREPARED_SCHEMA, check_metadata=False)
        assert table.schema.field("num_tool_calls").type == "int32"
        rows = table.to_pylist()
        assert rows and len({r["id"] for r in rows}) == len(rows)
        for row in rows:
            trajectory = Trajectory.from_dict(json.loads(row["trajectory"]))
            assert validate_text(row["response"]) == []
            assert row["prompt"] == user_prompt(row["task"], row["question"]) == trajectory.prompt
            assert row["num_tool_calls"] == trajectory.num_tool_calls and row["answer"] == trajectory.answer
            assert row["task_id"] == task_id(row["question"]) and row["source"] == trajectory.source
            assert row["task"] in ("math", "mhqa")
    read_prepared(prepared / "train.parquet")  # the schema check passes


@needs_data
def test_report(prepared):
    report = json.loads((prepared / "report.json").read_text())
    assert set(report["sources"]) == set(SOURCES)
    assert report["sources"]["gsm8k"]["converted"] == 40
    assert report["sources"]["r1searcher"]["rejected"]["wrong_answer"] > 0
    assert report["config"]["sources"] == {name: {"limit": limit, "files": None} for name, limit in SOURCES.items()}
    assert report["config"]["filters"] == vars(DataFilters())
    converted = sum(s["converted"] for s in report["sources"].values())
    assert report["filters"]["input"] == converted
    assert report["filters"]["kept"] + sum(report["filters"]["dropped"].values()) == converted
    split = report["split"]
    rows = {s: pq.read_metadata(prepared / f"{s}.parquet").num_rows for s in ("train", "heldout")}
    assert (split["train_rows"], split["heldout_rows"]) == (rows["train"], rows["heldout"])
    assert split["train_rows"] + split["heldout_rows"] == report["filters"]["kept"]
    assert 0.05 < split["heldout_tasks"] / (split["train_tasks"] + split["heldout_tasks"]) < 0.15


@needs_data
def test_split_is_disjoint_by_question(prepared):
    train = pq.read_table(prepared / "train.parquet").to_pylist()
    heldout = pq.read_table(prepared / "heldout.parquet").to_pylist()
    assert not {r["task_id"] for r in train} & {r["task_id"] for r in heldout}
    assert not {r["question"] for r in train} & {r["question"] for r in heldout}
    # FireAct's two files share questions: such groups land on one side together.
    repeated = [r for r in train + heldout if sum(x["task_id"] == r["task_id"] for x in train + heldout) > 1]
    assert repeated


@needs_data
def test_deterministic(prepared, tmp_path):
    again = prepare(data_cfg(tmp_path / "again"))
    for name in ("train.parquet", "heldout.parquet"):
        assert pq.read_table(again / name).equals(pq.read_table(prepared / name))
    report, report_again = (json.loads((d / "report.json").read_text()) for d in (prepared, again))
    report.pop("config"), report_again.pop("config")  # out_dir differs, the rest must not
    assert report == report_again
    other_seed = prepare(data_cfg(tmp_path / "seed1", split_seed=1))
    ids = lambda d: [r["id"] for r in pq.read_table(d / "heldout.parquet").select(["id"]).to_pylist()]  # noqa: E731
    assert ids(other_seed) != ids(prepared)


def trajectory(i, question, steps=None, correct=True):
    steps = steps or [Step("wiki_search", f"q{i}"), Step("observation", "o"), Step("answer", "a")]
    return Trajectory(id=f"t:{i}", task="mhqa", question=question, prompt=user_prompt("mhqa", question),
                      steps=steps, answer="a", correct=correct, source="t")  # fmt: skip


def test_split_by_task_keeps_questions_together():
    items = [trajectory(i, f"Question {i % 7}?") for i in range(40)]
    train, heldout = split_by_task(items, 0.3, seed=3)
    assert len(train) + len(heldout) == 40 and heldout
    assert not {t.question for t in train} & {t.question for t in heldout}
    assert len({t.question for t in heldout}) == 2  # round(0.3 * 7) questions
    assert split_by_task(items, 0.3, seed=3) == (train, heldout)
    assert split_by_task(items[:1], 0.5, seed=0) == (items[:1], [])
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_by_task(items, 1.5, seed=0)


def test_filters_and_error_correction():
    plain = trajectory(0, "A?")
    reflective = trajectory(1, "B?", [Step("code", "x"), Step("observation", "ok"), Step("reflection", "fine"),
                                      Step("answer", "a")])  # fmt: skip
    retried = trajectory(2, "C?", [Step("wiki_search", "x"), Step("observation", "None"),
                                   Step("wiki_search", "y"), Step("observation", "y is"), Step("answer", "a")])  # fmt: skip
    failed_check = trajectory(3, "D?", [Step("suggested_answer", "a"), Step("double_check", "Score 2: weak"),
                                        Step("plan", "again"), Step("web_search", "z"), Step("observation", "z"),
                                        Step("answer", "b")])  # fmt: skip
    no_tools = trajectory(4, "E?", [Step("think", "t"), Step("answer", "a")])
    wrong = trajectory(5, "F?", correct=False)
    assert [is_error_correction(t) for t in (plain, reflective, retried, failed_check, no_tools)] == [
        False,
        True,
        True,
        True,
        False,
    ]
    items = [plain, reflective, retried, failed_check, no_tools, wrong, trajectory(0, "A?")]
    kept, dropped = filter_trajectories(items, DataFilters(min_tool_calls=1))
    assert kept == [plain, reflective, retried, failed_check]
    assert dict(dropped) == {"few_tool_calls": 1, "incorrect": 1, "duplicate": 1}
    kept, dropped = filter_trajectories(items, DataFilters(require_correct=False, require_reflection=True))
    assert kept == [reflective] and dict(dropped) == {"no_reflection": 6}
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['min_tools'\]"):
        DataFilters.from_config({"min_tools": 1})


@needs_data
def test_upsampling_only_in_train(tmp_path):
    cfg = data_cfg(tmp_path / "up", sources={"fireact": 200}, filters={"error_correction_upsample": 3})
    out = prepare(cfg)
    train = read_prepared_trajectories(out / "train.parquet")
    copies = [row_id for row_id, _ in train if "#up" in row_id]
    originals = {t.id for row_id, t in train if row_id == t.id and is_error_correction(t)}
    assert originals and len(copies) == 2 * len(originals)
    assert not any("#up" in row_id for row_id, _ in read_prepared_trajectories(out / "heldout.parquet"))
    assert json.loads((out / "report.json").read_text())["filters"]["upsampled_rows"] == len(copies)


@needs_data
def test_ensure_prepared_caches_by_config(tmp_path):
    cfg = data_cfg(tmp_path / "cache", sources={"tora": None})
    out = ensure_prepared(cfg)
    stamp = (out / "train.parquet").stat().st_mtime_ns, (out / "train.parquet").stat().st_ino
    assert ensure_prepared(cfg) == out
    assert ((out / "train.parquet").stat().st_mtime_ns, (out / "train.parquet").stat().st_ino) == stamp
    cfg["split_seed"] = 7
    ensure_prepared(cfg)
    assert (out / "train.parquet").stat().st_ino != stamp[1]
    assert json.loads((out / "report.json").read_text())["config"]["split_seed"] == 7


def test_default_out_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("AFM_CACHE", str(tmp_path))
    assert resolve_out_dir({"name": "coa_traces", "out_dir": None}) == tmp_path / "data" / "coa_traces"


@needs_data
def test_failure_midway_leaves_no_out_dir(tmp_path, monkeypatch):
    real_write = prepare_module.write_prepared

    def failing_write(path, rows):
        if path.name == "heldout.parquet":
            raise OSError("disk full (simulated)")
        real_write(path, rows)

    monkeypatch.setattr(prepare_module, "write_prepared", failing_write)
    out = tmp_path / "coa"
    with pytest.raises(OSError, match="simulated"):
        prepare(data_cfg(out, sources={"tora": None}))
    assert list(tmp_path.iterdir()) == [] or not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".coa.")], "temporary directory left behind"
    # An existing complete directory survives a failed re-preparation untouched.
    monkeypatch.setattr(prepare_module, "write_prepared", real_write)
    prepare(data_cfg(out, sources={"tora": None}))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(prepare_module, "write_prepared", failing_write)
    with pytest.raises(OSError, match="simulated"):
        prepare(data_cfg(out, sources={"tora": 5}))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_bad_config(tmp_path):
    with pytest.raises(ValueError, match=r"data.sources.hotpot: unknown converter"):
        prepare(data_cfg(tmp_path / "x", sources={"hotpot": 3}))
    with pytest.raises(FileNotFoundError, match="missing input file"):
        prepare(data_cfg(tmp_path / "x", sources={"tora": 3}, shared_dir=str(tmp_path / "nowhere")))
    with pytest.raises(FileNotFoundError, match=r"data.sources.tora.path='nothing-\*.jsonl': no such file"):
        prepare(data_cfg(tmp_path / "x", sources={"tora": {"path": "nothing-*.jsonl"}}))
    with pytest.raises(ValueError, match=r"data.sources.tora: unknown key\(s\) \['paths'\]"):
        prepare(data_cfg(tmp_path / "x", sources={"tora": {"paths": ["a"]}}))
    assert not (tmp_path / "x").exists()


@needs_data
def test_a_source_reads_the_users_own_file_and_prepares_again_when_it_changes(tmp_path):
    default = SHARED / R1SEARCHER.files[0]
    mine = tmp_path / "my_rollouts.jsonl"
    mine.write_text("".join(default.read_text().splitlines(keepends=True)[:30]))
    cfg = data_cfg(tmp_path / "coa", sources={"r1searcher": {"limit": None, "path": str(mine)}})
    out = ensure_prepared(cfg)
    report = json.loads((out / "report.json").read_text())
    assert report["sources"]["r1searcher"]["files"] == [str(mine)] and report["sources"]["r1searcher"]["read"] == 30
    assert report["config"]["sources"]["r1searcher"]["files"][0]["path"] == str(mine)
    first = (out / "train.parquet").stat().st_mtime_ns
    assert ensure_prepared(cfg) == out and (out / "train.parquet").stat().st_mtime_ns == first  # cached
    mine.write_text("".join(default.read_text().splitlines(keepends=True)[:20]))
    ensure_prepared(cfg)
    assert json.loads((out / "report.json").read_text())["sources"]["r1searcher"]["read"] == 20


@needs_data
def test_exports(prepared, tmp_path):
    alpaca = export_prepared(prepared, "llamafactory", tmp_path / "lf")
    train = json.loads((alpaca / "train.json").read_text())
    assert len(train) == pq.read_metadata(prepared / "train.parquet").num_rows
    assert json.loads((alpaca / "dataset_info.json").read_text())["afm_coa_train"] == {"file_name": "train.json"}
    rl = export_prepared(prepared, "afm_rl")
    assert rl == prepared.with_name("coa-afm_rl")
    tasks = read_rl_tasks(rl / "heldout.parquet")
    heldout_questions = {r["task_id"] for r in pq.read_table(prepared / "heldout.parquet").to_pylist()}
    assert len(tasks) == len(heldout_questions)
    assert all(t.extra_info["split"] == "heldout" and t.prompt[0]["role"] == "user" for t in tasks)
    with pytest.raises(ValueError, match="export format"):
        export_prepared(prepared, "sharegpt")


@needs_data
def test_cli(tmp_path):
    out = tmp_path / "cli"
    args = [sys.executable, "-m", "jobs.prepare_data", f"data.out_dir={out}", "data.sources.gsm8k.limit=10",
            "data.sources.fireact.limit=10", "data.sources.r1searcher=10", "data.sources.tora.limit=5",
            "export=afm_rl"]  # fmt: skip
    result = subprocess.run(args, cwd=repo_root(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["out_dir"] == str(out) and summary["sources"]["gsm8k"]["converted"] == 10
    assert (out / "train.parquet").is_file() and (tmp_path / "cli-afm_rl" / "train.parquet").is_file()
    assert not list(tmp_path.glob(".*.tmp")), "temporary left behind"
    # Importing the exported alpaca file back gives the same responses.
    export_prepared(out, "llamafactory", tmp_path / "lf")
    imported = tmp_path / "imported"
    args = [sys.executable, "-m", "jobs.prepare_data", f"data.out_dir={imported}", "input.format=llamafactory",
            f"input.path={tmp_path / 'lf' / 'train.json'}", "data.heldout_fraction=0"]  # fmt: skip
    result = subprocess.run(args, cwd=repo_root(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    responses = lambda d, s: sorted(pq.read_table(d / f"{s}.parquet").column("response").to_pylist())  # noqa: E731
    assert responses(imported, "train") == responses(out, "train")
