"""The ``trainer`` fields the SFT and the RL schemas share (``config.sft.TrainerConfig``,
``config.rl.RLTrainerConfig``): seed, micro batch, precision, gradient clipping, checkpoints, HF export, CPU threads,
the MFU's peak, with their checks. A subclass may give a field another default by declaring it again."""

from __future__ import annotations

from dataclasses import dataclass

from afm_core.config.checks import require

PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class TrainerBaseConfig:
    seed: int = 1234
    micro_batch_size: int = 1
    precision: str = "auto"
    grad_clip: float = 1.0
    save_interval: int = 1
    keep_last: int = 1
    export_hf: bool = True
    num_threads: int | None = None
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        require(self.precision in PRECISIONS, "trainer.precision", self.precision, f"one of {', '.join(PRECISIONS)}")
        for key in ("micro_batch_size", "save_interval", "keep_last"):
            require(getattr(self, key) >= 1, f"trainer.{key}", getattr(self, key), "must be >= 1")
        require(self.grad_clip >= 0, "trainer.grad_clip", self.grad_clip, "must be >= 0")
        if self.num_threads is not None:
            require(self.num_threads >= 1, "trainer.num_threads", self.num_threads, "must be >= 1, or null")
        if self.peak_tflops is not None:
            require(self.peak_tflops > 0, "trainer.peak_tflops", self.peak_tflops, "a positive TFLOP/s, or null")
