"""``trainer.rollout_data_dir``: every rollout step's trajectories as ``<dir>/<step>.jsonl`` (verl's
``trainer.rollout_data_dir``, volcengine/verl ``verl/trainer/ppo/ray_trainer.py::_dump_generations``), written
atomically by rank 0, so a reader sees a step's file whole or not at all.

One line per generated trajectory (every generation batch of the step, also the groups dynamic sampling dropped):
``step``, ``uid`` (the prompt group), ``index`` (the sample's in its group), ``task_id``, ``prompt`` and ``response`` (decoded with special tokens; the
response holds the model's turns and the tool observations in order), ``score`` (the grader's), ``format`` (the CoA
validator's), ``reward`` (shaped), ``trained`` (the sample is in the step's train batch), ``finish_reason``,
``response_tokens``, ``tool_calls`` (``[{"name", "error"}]``), ``versions`` (the policy version of each response
token).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from afm_core.utils.atomic import atomic_write_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from afm_core.rl.grading import Sample


def dump_rollouts(directory: str | Path, step: int, generated: Sequence[Sample], trained: Sequence[Sample],
                  tokenizer: PreTrainedTokenizerBase) -> Path:  # fmt: skip
    """Write rollout step ``step``'s ``generated`` :class:`~afm_core.rl.grading.Sample` s to ``<directory>/<step>.jsonl``
    (``trained``: the ones in the train batch); returns the file's path."""
    kept = {(s.uid, s.index) for s in trained}  # the trained copies may have stale tokens masked
    lines = [
        json.dumps(
            {
                "step": step,
                "uid": s.uid,
                "task_id": s.task_id,
                "prompt": tokenizer.decode(s.prompt_ids, skip_special_tokens=False),
                "response": tokenizer.decode(s.response_ids, skip_special_tokens=False),
                "score": s.score,
                "format": s.format,
                "reward": s.reward,
                "index": s.index,
                "trained": (s.uid, s.index) in kept,
                "finish_reason": s.finish_reason,
                "response_tokens": len(s.response_ids),
                "tool_calls": [{"name": name, "error": error} for name, error in s.tool_calls],
                "versions": s.versions,
            },
            ensure_ascii=False,
        )
        + "\n"
        for s in generated
    ]
    path = Path(directory) / f"{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(lines))
    return path
