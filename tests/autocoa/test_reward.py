"""AutoCoA's RL reward (arXiv 2503.06580 §3.3.1): exact match, minus a format penalty when the CoA validator
rejects the response, on real CoA texts and the real graders."""

from __future__ import annotations

import pytest

from afm_core.config.rl import RewardConfig
from afm_core.rewards import grade_format
from afm_core.rewards.qa import grade_qa
from afm_core.rl.reward_shaping import shaped_reward

VALID = (
    "<think>\nsearch\n</think>\n<wiki_search>\nHamlet\n</wiki_search>\n<observation>\nby Shakespeare\n"
    "</observation>\n\n<answer>\nShakespeare\n</answer>"
)
UNCLOSED = "<think>\nI know it\n<answer>\nShakespeare\n</answer>"


@pytest.mark.parametrize(
    ("text", "gold", "expected"),
    [(VALID, "Shakespeare", 1.0), (VALID, "Marlowe", 0.0), (UNCLOSED, "Shakespeare", 0.5), (UNCLOSED, "Marlowe", -0.5)],
)
def test_exact_match_minus_format_penalty(text, gold, expected):
    cfg = RewardConfig(mode="score_minus_format_penalty", format_penalty=0.5, overlong_buffer_len=0)
    score, fmt = grade_qa(text, gold).score, grade_format(text).score
    assert shaped_reward(score, fmt, 100, cfg, 512) == pytest.approx(expected)
    assert shaped_reward(score, fmt, 100, RewardConfig(mode="score_x_format"), 512) == pytest.approx(score * fmt)
