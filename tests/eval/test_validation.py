"""``afm_core.eval.runner.validate``: benchmarks evaluated through an engine the caller already holds (what RL
validation does with its colocated engine), graded and summarised as ``metrics.json`` is, with no run dir."""

from __future__ import annotations

import asyncio
import json

from afm_core.config.sampling import SamplingConfig
from afm_core.eval.benchmarks import load_file
from afm_core.eval.runner import validate
from afm_core.rewards import Graders
from tests.rollout.replay import ReplayEngine


def test_validation_grades_every_problem_and_sample_through_the_given_engine(tmp_path):
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rollout.factory import load_tokenizer

    path = tmp_path / "val.jsonl"
    rows = [{"data_source": "gsm8k", "prompt": [{"role": "user", "content": f"q{i}"}], "ability": "math",
             "reward_model": {"ground_truth": gold}, "extra_info": {"index": str(i)}}
            for i, gold in enumerate(["4", "4", "5"])]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = load_tokenizer(ensure_hf_checkpoint("tiny-llama"))
    engine = ReplayEngine(tokenizer, ["<think>2+2</think>\n<answer>\\boxed{4}</answer>"] * 6)
    eval_cfg = SamplingConfig(k=2, temperature=1.0, top_p=1.0, max_response_tokens=64, max_tool_calls=0, limit=None,
                              max_turns=2, timeout_s=30, concurrency=4)  # fmt: skip
    metrics = asyncio.run(validate(engine, tokenizer, None, Graders(), [load_file(path)], eval_cfg))
    assert list(metrics) == ["val"] and metrics["val"]["n"] == 3 and metrics["val"]["samples"] == 6
    assert abs(metrics["val"]["avg@2"] - 2 / 3) < 1e-9 and len(engine.calls) == 6
