"""The DeepSpeed JSON of the ZeRO-3 SFT engine (``trainer.deepspeed_config``, default
``conf/deepspeed/ds_z3_config.json``): read, its ``"auto"`` values filled from the trainer settings the way HF Trainer
fills them (``transformers/integrations/deepspeed.py`` ``HfTrainerDeepSpeedConfig.trainer_config_process``), and a
set value that disagrees with them refused, naming file, line and field. The engine itself:
:mod:`afm_core.train.deepspeed_engine`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from afm_core.utils.paths import repo_root
from afm_core.utils.tracking import flatten

DEFAULT_DEEPSPEED_CONFIG = repo_root() / "conf" / "deepspeed" / "ds_z3_config.json"


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed JSON is unreadable or disagrees with the trainer settings (names file, line and field)."""


def _line_of(text: str, dotted: str) -> int | None:
    """1-based line of the key ``a.b.c`` in a JSON text (each key searched after its parent), or None."""
    offset = 0
    for key in dotted.split("."):
        found = text.find(f'"{key}"', offset)
        if found < 0:
            return None
        offset = found
    return text.count("\n", 0, offset) + 1


def deepspeed_config(
    path: str | os.PathLike[str],
    *,
    micro_batch_size: int,
    grad_accum_steps: int,
    dp: int,
    grad_clip: float,
    bf16: bool,
    hidden_size: int,
) -> dict[str, Any]:
    """Read a DeepSpeed JSON and fill its ``"auto"`` values from the trainer settings, like HF Trainer.

    Args:
        path: the DeepSpeed JSON (LLaMA-Factory's ``ds_z3_config.json`` format).
        micro_batch_size: packed sequences per micro batch per DP rank (``trainer.micro_batch_size``).
        grad_accum_steps: micro batches per optimizer step per rank (global / (micro * dp)).
        dp: data-parallel ranks.
        grad_clip: max global L2 grad norm (``trainer.grad_clip``; 0: no clipping).
        bf16: bf16 mixed precision (fp32 master weights in the optimizer) instead of fp32.
        hidden_size: the model's hidden size, for the ZeRO bucket sizes (HF Trainer's rule: reduce bucket
            ``h*h``, stage-3 prefetch ``0.9*h*h``, param persistence threshold ``10*h``).
    Returns:
        The config dict for ``deepspeed.initialize`` (no ``"auto"`` left).
    Raises:
        FileNotFoundError: ``path`` does not exist.
        DeepSpeedConfigError: not valid JSON, an ``optimizer``/``scheduler`` section (this engine owns both), or
            a set value that disagrees with the trainer (message: ``file:line: field 'x': ...``).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such DeepSpeed config file")
    text = path.read_text(encoding="utf-8")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise DeepSpeedConfigError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None

    def where(field: str) -> str:
        line = _line_of(text, field)
        return f"{path}:{line}: field '{field}'" if line else f"{path}: field '{field}'"

    for section in ("optimizer", "scheduler"):
        if section in config:
            raise DeepSpeedConfigError(
                f"{where(section)}: remove it; the engine builds AdamW and the LR schedule from optim.*"
            )

    def fill(field: str, value: Any, source: str, *, match: bool = True) -> None:
        *parents, leaf = field.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        current = node.get(leaf, "auto")
        if current == "auto":
            node[leaf] = value
        elif match and current != value:
            raise DeepSpeedConfigError(
                f'{where(field)}: {current!r} disagrees with {source} = {value!r}; set it to "auto"'
            )

    fill("train_micro_batch_size_per_gpu", micro_batch_size, "trainer.micro_batch_size")
    fill("gradient_accumulation_steps", grad_accum_steps, "trainer.global_batch_size / (micro_batch_size * dp)")
    fill("train_batch_size", micro_batch_size * grad_accum_steps * dp, "trainer.global_batch_size")
    fill("gradient_clipping", float(grad_clip), "trainer.grad_clip")
    fill("bf16.enabled", bf16, "trainer.precision")
    fill("fp16.enabled", False, "trainer.precision (fp16 is not supported: use bf16 or fp32)")
    zero = config.get("zero_optimization", {})
    for field, value in (
        ("reduce_bucket_size", hidden_size * hidden_size),
        ("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
        ("stage3_param_persistence_threshold", 10 * hidden_size),
    ):
        if zero.get(field) == "auto":
            zero[field] = value
    left = [k for k, v in flatten(config).items() if v == "auto"]
    if left:
        raise DeepSpeedConfigError(f'{where(left[0])}: "auto" is not supported for this field; set a value')
    return config


def zero_stage(config: dict[str, Any]) -> int:
    """The ZeRO stage of a DeepSpeed config (0 when it has no ``zero_optimization``)."""
    return int(config.get("zero_optimization", {}).get("stage", 0))
