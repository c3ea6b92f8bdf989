"""``samples.jsonl``'s settings guard: a resumed eval adds samples only under the settings its log was drawn under."""

from __future__ import annotations

import json

import pytest

from afm_core.eval.samples import SETTINGS_FILE, check_sample_settings

SETTINGS = {
    "model": "runs/sft/x/hf",
    "engine": {"seed": 0, "dtype": "auto"},
    "eval": {"seed": 0, "max_turns": 4},
    "benchmarks": {"gsm8k_test": {"temperature": 0.8, "top_p": 1.0, "max_response_tokens": 512, "max_tool_calls": 3}},
}


def test_a_fresh_run_records_its_settings_and_a_resume_under_the_same_ones_passes(tmp_path):
    check_sample_settings(tmp_path, SETTINGS, resuming=False)
    assert json.loads((tmp_path / SETTINGS_FILE).read_text()) == SETTINGS
    check_sample_settings(tmp_path, SETTINGS, resuming=True)


def test_a_resume_under_other_settings_names_each_changed_field(tmp_path):
    check_sample_settings(tmp_path, SETTINGS, resuming=False)
    changed = {**SETTINGS, "model": "runs/rl/y/hf", "eval": {"seed": 1, "max_turns": 4}}
    changed["benchmarks"] = {"gsm8k_test": {**SETTINGS["benchmarks"]["gsm8k_test"], "temperature": 0.6}}
    with pytest.raises(ValueError) as err:
        check_sample_settings(tmp_path, changed, resuming=True)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / SETTINGS_FILE}: the samples in {tmp_path} were drawn under other settings")
    assert (
        "(benchmarks.gsm8k_test.temperature: 0.8 -> 0.6; eval.seed: 0 -> 1; model: 'runs/sft/x/hf' -> 'runs/rl/y/hf')"
        in message
    )
    assert json.loads((tmp_path / SETTINGS_FILE).read_text()) == SETTINGS, "a refused resume leaves the record"


def test_benchmarks_added_or_left_out_on_a_resume_keep_their_records(tmp_path):
    check_sample_settings(tmp_path, SETTINGS, resuming=False)
    other = {"temperature": 0.6, "top_p": 1.0, "max_response_tokens": 4096, "max_tool_calls": 12}
    check_sample_settings(tmp_path, {**SETTINGS, "benchmarks": {"math500": other}}, resuming=True)
    recorded = json.loads((tmp_path / SETTINGS_FILE).read_text())["benchmarks"]
    assert recorded == {**SETTINGS["benchmarks"], "math500": other}


def test_a_log_from_before_the_guard_is_adopted_and_check_only_writes_nothing(tmp_path):
    check_sample_settings(tmp_path, SETTINGS, resuming=True, record=False)
    assert not (tmp_path / SETTINGS_FILE).exists()
    check_sample_settings(tmp_path, SETTINGS, resuming=True)
    assert json.loads((tmp_path / SETTINGS_FILE).read_text()) == SETTINGS
