"""LLaMA-Factory alpaca JSON and AFM/verl RL parquet: round trips on real data, and errors."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from afm_core.coa.grammar import TagGrammarError
from afm_core.coa.prompts import user_prompt
from afm_core.coa.trajectory import Step, Trajectory
from afm_core.data.converters import CONVERTERS
from afm_core.data.converters.answer_check import boxed_content
from afm_core.data.formats import (
    RLTask,
    alpaca_converter,
    read_rl_tasks,
    rl_task_from_trajectory,
    to_alpaca,
    write_alpaca,
    write_rl_tasks,
)  # fmt: skip
from afm_core.data.io import DataFormatError
from afm_core.utils.paths import shared_data_dir

SHARED = shared_data_dir()
needs_data = pytest.mark.skipif(
    not SHARED.is_dir(), reason=f"real data folder {SHARED} is absent (set AFM_SHARED_DATA)"
)


def real_trajectories():
    out = []
    for name, limit in (("gsm8k", 5), ("fireact", 5), ("r1searcher", 5), ("tora", 5)):
        converter = CONVERTERS[name]
        out += converter([SHARED / f for f in converter.files], limit=limit).trajectories
    return out


@needs_data
def test_alpaca_round_trip(tmp_path):
    trajectories = real_trajectories()
    path = tmp_path / "sft.json"
    write_alpaca(path, trajectories)
    records = json.loads(path.read_text())
    assert set(records[0]) == {"instruction", "input", "output"}
    assert records[0]["output"].count("<observation>") == trajectories[0].num_tool_calls
    conversion = alpaca_converter()([path])
    assert conversion.report.converted == len(trajectories)
    for original, imported in zip(trajectories, conversion.trajectories):
        assert imported.steps == original.steps
        assert (imported.task, imported.question, imported.prompt) == (
            original.task,
            original.question,
            original.prompt,
        )
        assert imported.answer == (boxed_content(original.final_answer) or original.final_answer)
        assert to_alpaca(imported) == to_alpaca(original)
        assert imported.source == "llamafactory" and imported.correct is None


def test_alpaca_import_foreign_records(tmp_path):
    records = [
        {"instruction": "Upstream prompt\n\nQuestion: Capital of France?", "input": "", "system": "sys",
         "output": "<think>Search.</think>\n<web_search>\ncapital of France\n</web_search>\n\n<observation>\nParis\n</observation>\n\n\n<answer>Paris</answer>"},
        {"instruction": "Q", "output": "<think>x</think><answer>\n\\boxed{3}\n</answer>", "input": "1+2"},
        {"instruction": "Q", "output": "<answer>y</answer>", "history": [["hi", "hello"]]},
        {"instruction": "Q", "output": "<think>unclosed"},
    ]  # fmt: skip
    path = tmp_path / "foreign.json"
    path.write_text(json.dumps(records))
    conversion = alpaca_converter()([path])
    assert dict(conversion.report.rejected) == {"unknown_task": 1, "has_history": 1, "grammar:unbalanced_tag": 1}
    (web,) = conversion.trajectories
    assert web.task == "web" and web.question == "Capital of France?" and web.meta["system"] == "sys"
    assert [s.tag for s in web.steps] == ["think", "web_search", "observation", "answer"] and web.answer == "Paris"
    math = alpaca_converter(task="math")([path]).trajectories
    assert [t.answer for t in math] == ["Paris", "3"] and math[1].prompt == "Q\n\n1+2"
    with pytest.raises(TagGrammarError, match=r"foreign\.json: record 3: unbalanced_tag"):
        alpaca_converter(task="math")([path], strict=True)


def test_alpaca_errors_name_file_and_record(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"instruction": "q", "output": "<answer>a</answer>"}, {"instruction": "q"}]))
    with pytest.raises(DataFormatError, match=r"bad\.json: record 1: missing field 'output'"):
        alpaca_converter(task="mhqa")([path])
    path.write_text('[{"instruction": "q",\n "output": }]')
    with pytest.raises(DataFormatError, match=r"bad\.json:2: invalid JSON"):
        alpaca_converter(task="mhqa")([path])


@needs_data
@pytest.mark.parametrize("name", ["aime24", "amc23", "math500", "livecodebench_v4"])
def test_afm_rl_parquet_round_trip(tmp_path, name):
    source = SHARED / "afm_benchmarks" / f"{name}.parquet"
    tasks = read_rl_tasks(source)
    assert len({t.index for t in tasks}) == len(tasks) > 0
    assert all(t.prompt[-1]["role"] == "user" and t.ground_truth for t in tasks)
    out = tmp_path / f"{name}.parquet"
    write_rl_tasks(out, tasks)
    assert read_rl_tasks(out) == tasks
    # Byte-for-byte the same records and the same Arrow types as upstream's file.
    assert pq.read_table(out).to_pylist() == pq.read_table(source).to_pylist()
    assert pq.read_table(out).schema.equals(pq.read_table(source).schema, check_metadata=False)


@needs_data
def test_afm_rl_typed_fields():
    (aime,) = [t for t in read_rl_tasks(SHARED / "afm_benchmarks" / "aime24.parquet") if t.index == "0"]
    assert aime.ground_truth == "204" and aime.ground_truth_value() == "204" and aime.data_source == "aime24"
    assert aime.question.startswith("Solve the given task step by step.") or "Aya" in aime.question
    code = read_rl_tasks(SHARED / "afm_benchmarks" / "livecodebench_v4.parquet")[0]
    value = code.ground_truth_value()
    assert set(value) >= {"stdin", "expected_output"} and len(value["stdin"]) == len(value["expected_output"])


def test_rl_tasks_from_trajectories(tmp_path):
    steps = [Step("wiki_search", "q"), Step("observation", "o"), Step("answer", "Nevada")]
    trajectories = [
        Trajectory(id="fireact:hotpotqa:3", task="mhqa", question="Where?", prompt=user_prompt("mhqa", "Where?"),
                   steps=steps, answer="Nevada", source="fireact"),
        Trajectory(id="gsm8k:train:1", task="math", question="2+2?", prompt=user_prompt("math", "2+2?"),
                   steps=[Step("answer", "\\boxed{4}")], answer="4", source="gsm8k"),
    ]  # fmt: skip
    tasks = [rl_task_from_trajectory(t, "train") for t in trajectories]
    path = tmp_path / "rl.parquet"
    write_rl_tasks(path, tasks)
    back = read_rl_tasks(path)
    assert back == tasks  # tools absent from a row (null in the parquet struct) are dropped on read
    assert back[0].extra_info["tools_kwargs"] == {"wiki_search": {"create_kwargs": {
        "ground_truth": "Nevada", "question": "Where?", "data_source": "fireact"}}}  # fmt: skip
    assert back[1].ability == "math" and back[1].question == "2+2?" and back[1].index == "gsm8k:train:1"
    with pytest.raises(DataFormatError, match=r"duplicate extra_info\.index"):
        write_rl_tasks(tmp_path / "dup.parquet", [tasks[0], tasks[0]])


def test_rl_parquet_errors(tmp_path):
    base = {"data_source": "x", "prompt": [{"content": "q", "role": "user"}], "ability": "math",
            "reward_model": {"ground_truth": "1", "style": "rule"}}  # fmt: skip
    path = tmp_path / "bad.parquet"
    pq.write_table(
        pa.Table.from_pylist([{**base, "extra_info": {"index": "0"}}, {**base, "extra_info": {"index": "0"}}]), path
    )
    with pytest.raises(DataFormatError, match=r"bad\.parquet: record 1: duplicate extra_info.index '0'"):
        read_rl_tasks(path)
    pq.write_table(pa.Table.from_pylist([{**base, "extra_info": {"split": "test"}}]), path)
    with pytest.raises(DataFormatError, match=r"record 0: missing field 'extra_info.index'"):
        read_rl_tasks(path)
    pq.write_table(pa.Table.from_pylist([{"data_source": "x", "prompt": [], "extra_info": {"index": 1}}]), path)
    with pytest.raises(DataFormatError, match=r"record 0: missing field 'reward_model'"):
        read_rl_tasks(path)
    task = RLTask("x", [{"role": "user", "content": "q"}], '{"target": "a"}', {"index": 1})
    assert task.ground_truth_value() == {"target": "a"} and task.index == "1"
