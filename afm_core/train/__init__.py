"""Agentic SFT: the loop (:mod:`~afm_core.train.loop`), its objectives (:mod:`~afm_core.train.objective`: SFT,
AutoCoA's contrastive stage), Megatron's SFT trainer on the engine's core (:mod:`~afm_core.train.trainer`,
:func:`~afm_core.train.sft.run_sft`) and the DeepSpeed ZeRO-3 alternative on the HF model
(:mod:`~afm_core.train.deepspeed_engine`)."""

from afm_core.utils import import_hooks

import_hooks.install()  # before this package's modules first import megatron-core / mbridge
