"""The staged context length (afm_core.rl.schedule): the stages built from the typed ``rollout`` group and the
stage of each rollout step. A bad schedule is the schema's to refuse, at submit (tests/test_config.py)."""

from __future__ import annotations

from afm_core.config.rl import ContextStage, RolloutConfig
from afm_core.rl.schedule import Stage, build_stages, stage_at


def test_the_context_schedule_picks_the_stage_of_each_rollout_step():
    rollout = RolloutConfig(context_schedule=[ContextStage(16384, until_step=40), ContextStage(32768)])
    stages = build_stages(rollout)
    assert stages == [Stage(0, 16384, 40), Stage(1, 32768, None)]
    assert [stage_at(stages, s).max_response_len for s in (0, 39, 40, 500)] == [16384, 16384, 32768, 32768]


def test_no_context_schedule_is_one_stage_of_max_response_len():
    assert build_stages(RolloutConfig(max_response_len=4096)) == [Stage(0, 4096, None)]
