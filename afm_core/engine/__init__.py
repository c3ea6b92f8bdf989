"""The Megatron training engine that the SFT trainer (:mod:`afm_core.train`) and the RL trainer (:mod:`afm_core.rl`)
both stand on: distributed init and the parallel layout (:mod:`~afm_core.engine.distributed`), the trainer core
(:mod:`~afm_core.engine.core`: model chunks, DDP, one optimizer step over micro batches), the optimizer
(:mod:`~afm_core.engine.optim`), the checkpoint protocol and its directories (:mod:`~afm_core.engine.checkpoint`,
:mod:`~afm_core.engine.checkpoint_dirs`) and HF export (:mod:`~afm_core.engine.export`), preemption requests
(:mod:`~afm_core.engine.preemption`), offload (:mod:`~afm_core.engine.offload`), the memory model
(:mod:`~afm_core.engine.memory`), FLOPs (:mod:`~afm_core.engine.flops`) and the metrics log
(:mod:`~afm_core.engine.metrics`); the CPU patches of megatron-core (:mod:`~afm_core.engine.cpu_shims`,
:mod:`~afm_core.engine.multi_tensor`).
"""

from afm_core.utils import import_hooks

import_hooks.install()  # before this package's modules first import megatron-core / mbridge
