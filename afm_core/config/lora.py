"""``model.lora``: low-rank adapters on the attention and MLP projections (off by default).

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3): a frozen weight ``W`` of a
linear layer plus ``(alpha / r) * B @ A`` with ``A [r, in]``, ``B [out, r]``; only ``A`` and ``B`` train. The
module names are Megatron's (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``, as
Megatron-Bridge's ``megatron/bridge/peft/lora.py`` names its targets); the adapters themselves are
:mod:`afm_core.models.lora`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from afm_core.config.checks import require

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass
class LoRAConfig:
    """Adapter settings: ``rank`` (``r``; 0 = no adapters, full fine-tuning), ``alpha`` (the scale is
    ``alpha / rank``, PEFT's ``lora_alpha``), ``dropout`` on the adapter's input (PEFT's ``lora_dropout``), and the
    ``target_modules`` of :data:`LORA_TARGETS` that get one.

    Raises:
        ConfigError: ``rank`` < 0, ``alpha`` <= 0, ``dropout`` outside [0, 1), no or an unknown target module.
    """

    rank: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))

    def __post_init__(self) -> None:
        require(self.rank >= 0, "model.lora.rank", self.rank, "0 (off) or the adapters' rank r >= 1")
        require(self.alpha > 0, "model.lora.alpha", self.alpha, "must be > 0 (the scale is alpha / rank)")
        require(0 <= self.dropout < 1, "model.lora.dropout", self.dropout, "must be in [0, 1)")
        require(bool(self.target_modules), "model.lora.target_modules", self.target_modules, "name at least one")
        for name in self.target_modules:
            require(name in LORA_TARGETS, "model.lora.target_modules", name, f"one of {', '.join(LORA_TARGETS)}")

    @property
    def enabled(self) -> bool:
        """Adapters are trained (rank > 0) and the base weights frozen."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor of ``B @ A`` (0 when off)."""
        return self.alpha / self.rank if self.rank else 0.0
