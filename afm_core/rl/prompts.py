"""The RL prompts: the tasks a run trains on (:func:`load_prompts`) and the resumable, epoch-shuffled stream of
them every rank draws generation batches from (:class:`PromptStream`)."""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING

from afm_core.data.tokenize import encode_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from afm_core.config.rl import RLDataConfig
    from afm_core.rollout.types import AgentTask

log = logging.getLogger(__name__)


class PromptStream:
    """The RL prompts in a fresh seeded permutation per epoch; its state is ``(epoch, offset)``.

    Every rank holds the same stream and draws the same generation batches. A group uid is
    ``"{epoch}:{offset}"`` of the prompt, unique even when a small dataset wraps within one rollout step.
    Dynamic sampling consumes a variable number of prompts per rollout step, so a checkpoint saves this
    position (:meth:`state_dict`), not step x batch.

    Raises:
        ValueError: ``num_prompts`` < 1.
    """

    def __init__(self, num_prompts: int, seed: int):
        if num_prompts < 1:
            raise ValueError("the RL data holds no prompt")
        self.num_prompts, self.seed = num_prompts, seed
        self.epoch = self.offset = 0
        self._order: list[int] | None = None

    def _permutation(self) -> list[int]:
        if self._order is None:
            self._order = list(range(self.num_prompts))
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(self._order)
        return self._order

    def take(self, count: int) -> list[tuple[str, int]]:
        """The next ``count`` prompts as ``(uid, prompt index)``."""
        out = []
        for _ in range(count):
            if self.offset >= self.num_prompts:
                self.epoch, self.offset, self._order = self.epoch + 1, 0, None
            out.append((f"{self.epoch}:{self.offset}", self._permutation()[self.offset]))
            self.offset += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "num_prompts": self.num_prompts, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if int(state["num_prompts"]) != self.num_prompts:
            log.warning(
                "the RL data changed since the checkpoint (%s -> %s prompts): the position is kept",
                state["num_prompts"],
                self.num_prompts,
            )
        self.epoch, self.offset, self._order = int(state["epoch"]), int(state["offset"]), None


def load_prompts(data: RLDataConfig, data_dir: str | None, tokenizer: PreTrainedTokenizerBase) -> list[AgentTask]:
    """The RL tasks: eval presets (``data.presets``) and AFM/verl RL files (``data.files``) read by
    :func:`afm_core.eval.benchmarks.load_sources`, kept to GSM8K references with at most
    ``data.max_calculator_steps`` calculator annotations (when set), cut to ``data.skip`` / ``data.limit`` and
    stripped of prompts longer than ``data.max_prompt_len`` tokens; preset data paths resolve in ``data_dir``
    (None: ``$AFM_SHARED_DATA``).

    Raises:
        ValueError: no data configured, or nothing left after the length filter.
    """
    from afm_core.eval.benchmarks import load_sources  # aiohttp (graders' clients): not where jobs.rl is imported

    benches = load_sources(
        data.presets,
        data.files,
        data_dir,
        empty="data.presets / data.files: name at least one source of RL prompts",
        unique=False,
    )
    tasks = [t for b in benches for t in b.tasks][data.skip :]
    steps = data.max_calculator_steps
    if steps is not None:  # GSM8K: references with at most this many calculator annotations
        tasks = [t for t in tasks if t.meta.get("calculator_steps", 0) <= steps]
    if data.limit is not None:
        tasks = tasks[: data.limit]
    max_len = data.max_prompt_len
    kept = [t for t in tasks if len(encode_prompt(tokenizer, t.prompt, t.system)) <= max_len]
    if len(kept) < len(tasks):
        log.warning(
            "RL data: %d of %d prompts are longer than data.max_prompt_len=%d tokens and were dropped",
            len(tasks) - len(kept),
            len(tasks),
            max_len,
        )
    if not kept:
        raise ValueError(f"no RL prompt fits data.max_prompt_len={max_len}")
    return kept
