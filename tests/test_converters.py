"""Converters on the real traces in the shared data folder, and their errors on malformed input."""

import json
import subprocess
import sys

import pytest

from afm_core.coa.grammar import TagGrammarError, validate_steps
from afm_core.coa.observations import executed_output_observation
from afm_core.coa.parse import parse_code_query, parse_steps
from afm_core.coa.render import render_response
from afm_core.data.converters import CONVERTERS
from afm_core.data.converters.gsm8k import UnsafeExpression, run_print
from afm_core.data.io import DataFormatError
from afm_core.utils.paths import shared_data_dir

SHARED = shared_data_dir()
needs_data = pytest.mark.skipif(
    not SHARED.is_dir(), reason=f"real data folder {SHARED} is absent (set AFM_SHARED_DATA)"
)


def convert(name, limit=None, **kwargs):
    converter = CONVERTERS[name]
    return converter([SHARED / f for f in converter.files], limit=limit, **kwargs)


def check_trajectories(conversion, task, tools):
    assert conversion.report.converted == len(conversion.trajectories) > 0
    assert conversion.report.read == conversion.report.converted + sum(conversion.report.rejected.values())
    ids = [t.id for t in conversion.trajectories]
    assert len(set(ids)) == len(ids)
    for trajectory in conversion.trajectories:
        assert trajectory.task == task and trajectory.correct is True
        assert validate_steps(trajectory.steps) == []
        assert {s.tag for s in trajectory.steps if s.kind == "tool"} <= set(tools)
        assert parse_steps(render_response(trajectory.steps)) == trajectory.steps
        assert trajectory.prompt.endswith("\n\nQuestion: " + trajectory.question)
        json.dumps(trajectory.to_dict())


@needs_data
def test_fireact():
    conversion = convert("fireact")
    check_trajectories(conversion, "mhqa", {"wiki_search"})
    assert conversion.report.read == 1844
    first = conversion.trajectories[0]
    assert [s.tag for s in first.steps] == ["think", "wiki_search", "observation", "think", "answer"]
    assert first.steps[1].content == "best kick boxer in the world unsportsmanlike conducts crimes of violence"
    assert first.steps[2].content.startswith("Badr Hari (born 8 December 1984)")
    assert first.answer == "Badr Hari" and first.id == "fireact:hotpotqa:1"
    assert not any(t.question.startswith("Question:") for t in conversion.trajectories)


@needs_data
def test_r1searcher_rejects_wrong_answers():
    conversion = convert("r1searcher")
    check_trajectories(conversion, "mhqa", {"wiki_search"})
    assert conversion.report.rejected["wrong_answer"] > 0
    multi = [t for t in conversion.trajectories if t.num_tool_calls >= 2]
    assert multi, "R1-Searcher has multi-search rollouts"
    for trajectory in conversion.trajectories:
        assert trajectory.meta["exact_match"] or trajectory.meta["gpt4o_judge"] == "True"
        assert all("<|begin_of" not in s.content and "</think>" not in s.content for s in trajectory.steps)
        assert all(s.content.startswith("(1)") for s in trajectory.steps if s.kind == "observation")


@needs_data
def test_tora():
    conversion = convert("tora")
    check_trajectories(conversion, "math", {"code"})
    assert conversion.report.rejected["wrong_answer"] > 0  # e.g. a decimal where gt is \sqrt{39}
    assert sum(t.num_tool_calls > 0 for t in conversion.trajectories) >= 20  # a few solutions are prose only
    for trajectory in conversion.trajectories:
        assert trajectory.final_answer.startswith("\\boxed{")
        for step in trajectory.steps:
            if step.tag == "code":
                code, stdin = parse_code_query(step.content)
                assert "print(" in code and "```" not in code and stdin is None


@needs_data
def test_gsm8k_observations_are_real_executions():
    conversion = convert("gsm8k", limit=40)
    check_trajectories(conversion, "math", {"code"})
    assert conversion.report.converted == 40
    first = conversion.trajectories[0]
    assert first.answer == "72" and first.final_answer == "\\boxed{72}"
    assert [s.content for s in first.steps if s.kind == "observation"] == [
        executed_output_observation("24.0"),
        executed_output_observation("72"),
    ]
    pairs = [(parse_code_query(s.content)[0], o.content) for t in conversion.trajectories
             for s, o in zip(t.steps, t.steps[1:]) if s.tag == "code"]  # fmt: skip
    assert len(pairs) > 80
    # Run every snippet again in ONE fresh interpreter, each isolated, and compare the printed text.
    script = "import contextlib, io, json, sys\nout = []\nfor code in json.load(sys.stdin):\n" \
             "    buf = io.StringIO()\n    with contextlib.redirect_stdout(buf):\n        exec(code, {})\n" \
             "    out.append(buf.getvalue())\njson.dump(out, sys.stdout)\n"  # fmt: skip
    result = subprocess.run([sys.executable, "-c", script], input=json.dumps([c for c, _ in pairs]),
                            capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert [executed_output_observation(o.removesuffix("\n")) for o in json.loads(result.stdout)] == [
        obs for _, obs in pairs
    ]
    # And a few as separate `python -c` processes, exactly as a sandbox would run them.
    for code, observation in pairs[:3]:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
        assert executed_output_observation(run.stdout.removesuffix("\n")) == observation


def test_run_print_is_restricted():
    assert run_print("48/2") == "24.0"
    assert run_print("2**10-3*(4+1)") == "1009"
    for bad in ("__import__('os').system('true')", "open('x')", "9**9**9", "1; print(2)", "1 # c", "x+1"):
        with pytest.raises(UnsafeExpression):
            run_print(bad)
    with pytest.raises(ZeroDivisionError):
        run_print("1/0")


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_malformed_line_names_file_and_line(tmp_path):
    good = json.dumps({"question": "q?", "answer": "It is 1+1 = <<1+1=2>>2.\n#### 2"})
    path = write_lines(tmp_path / "trajectories.jsonl", [good, "", good, '{"question": "broken'])
    with pytest.raises(DataFormatError, match=r"trajectories\.jsonl:4: invalid JSON"):
        CONVERTERS["gsm8k"]([path])
    path = write_lines(tmp_path / "missing.jsonl", [good, json.dumps({"question": "q"})])
    with pytest.raises(DataFormatError, match=r"missing\.jsonl:2: missing field 'answer'"):
        CONVERTERS["gsm8k"]([path])
    path = write_lines(tmp_path / "typed.jsonl", [json.dumps({"question": "q", "answer": 3})])
    with pytest.raises(DataFormatError, match=r"typed\.jsonl:1: field 'answer' must be str, got int"):
        CONVERTERS["gsm8k"]([path])
    path = write_lines(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(DataFormatError, match=r"list\.jsonl:1: expected a JSON object"):
        CONVERTERS["gsm8k"]([path])
    path = write_lines(tmp_path / "fireact.jsonl", [json.dumps({"messages": [{"role": "user"}]})])
    with pytest.raises(DataFormatError, match=r"fireact\.jsonl:1: messages\[0\]: missing field 'content'"):
        CONVERTERS["fireact"]([path])


def fireact_record(thought, action, observation="Observation: Episode finished, reward = True"):
    return json.dumps({"messages": [
        {"role": "user", "content": "Question: Who?"},
        {"role": "assistant", "content": f"Thought: {thought}\nAction: {action}"},
        {"role": "user", "content": observation},
    ]})  # fmt: skip


def test_rejections_are_counted_by_reason(tmp_path):
    path = write_lines(tmp_path / "fireact.jsonl", [
        fireact_record("I know.", "finish[Bob]"),
        fireact_record("I know.", "finish[Al]", "Observation: Episode finished, reward = False"),
        fireact_record("Hmm.", "dance[x]"),
        fireact_record("Hmm <answer>leak</answer>.", "finish[Bob]"),
        json.dumps({"messages": [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "No idea"}]}),
    ])  # fmt: skip
    conversion = CONVERTERS["fireact"]([path])
    assert conversion.report.converted == 1
    assert dict(conversion.report.rejected) == {
        "wrong_answer": 1, "unknown_action": 1, "grammar:nested_tag": 1, "missing_action": 1,
    }  # fmt: skip
    with pytest.raises(TagGrammarError, match=r"fireact\.jsonl:4: nested_tag"):
        CONVERTERS["fireact"]([path], strict=True)


def test_gsm8k_rejects_bad_calculations(tmp_path):
    path = write_lines(tmp_path / "gsm.jsonl", [
        json.dumps({"question": "a", "answer": "10/3 = <<10/3=3.33>>3.33\n#### 3.33"}),
        json.dumps({"question": "b", "answer": "<<2*x=4>>4\n#### 4"}),
        json.dumps({"question": "c", "answer": "<<1/0=0>>0\n#### 0"}),
        json.dumps({"question": "d", "answer": "no final answer"}),
        json.dumps({"question": "e", "answer": "1,000 + 1 = <<1000+1=1001>>1,001\n#### 1,001"}),
    ])  # fmt: skip
    conversion = CONVERTERS["gsm8k"]([path])
    assert dict(conversion.report.rejected) == {
        "calculation_mismatch": 1, "unsafe_expression": 1, "execution_error": 1, "no_answer": 1,
    }  # fmt: skip
    (kept,) = conversion.trajectories
    assert kept.answer == "1001" and kept.steps[-1].content == "\\boxed{1001}"


@needs_data
def test_tora_keeps_answers_that_math_verify_finds_equal_and_counts_the_rescues():
    conversion = convert("tora")
    assert conversion.report.rejected["wrong_answer"] == 1  # only '-2x - 1, 2x + 1' vs gt '-2x-1' stays wrong
    rescued = [t for t in conversion.trajectories if t.meta.get("answer_check") == "math_verify_rescued"]
    assert len(rescued) == conversion.report.answer_checks["math_verify_rescued"] == 2
    assert conversion.report.to_dict()["answer_checks"] == {"math_verify_rescued": 2}
