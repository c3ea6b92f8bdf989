"""A quick exit, and a quick vLLM engine start, for processes that imported torch, vLLM or transformers.

At exit CPython tears the modules down and collects garbage over every object still alive (``Py_FinalizeEx``).
With torch, vLLM and transformers imported that is ~600,000 objects, and the exit took 2.6-9 s on a loaded 2-core
machine (0.4-0.8 s for one ``gc.collect()`` there), in each process of a job: the rank, vLLM's engine core (whose
parent waits 5 s for it, then kills it). Frozen objects (``gc.freeze``, CPython docs, "gc — Garbage Collector
interface") are left out of every later collection, so freezing them once the exit has begun leaves only the
module teardown: 0.5-1 s there.

vLLM's engine start collects garbage over the whole heap five times (its memory profiling, then
``freeze_gc_heap``: ``gc.collect`` of each generation and ``gc.freeze()``, vllm/utils/gc_utils.py): ~0.15 s each over
the objects of the imports, and of the trainer in an RL rank. :func:`freeze_heap` freezes what is alive before the
engine is built (a vLLM general plugin, ``pyproject.toml``: every vLLM process, the engine core included; and
:meth:`afm_core.rollout.vllm_inproc.InprocVLLMEngine.create`), so those collections see the engine's own objects
only; vLLM's shutdown (``cleanup_dist_env_and_memory``) unfreezes the heap again.
"""

from __future__ import annotations

import atexit
import gc

_registered = False


def skip_final_gc() -> None:
    """Freeze every object when this process exits (an ``atexit`` hook, registered once), so the interpreter's
    final garbage collections skip them. The ``atexit`` hooks registered after this one still run first (last in,
    first out), and objects are still freed by reference counting; only cyclic garbage left at exit is not
    collected (the operating system reclaims its memory with the process, but its finalizers do not run: a file
    left open in a reference cycle is not flushed, so close files explicitly)."""
    global _registered
    if not _registered:
        atexit.register(gc.freeze)
        _registered = True


def freeze_heap() -> None:
    """``gc.freeze()``: every object alive now is left out of later collections (module docstring); objects are
    still freed by reference counting, and a reference cycle among them only once the heap is unfrozen."""
    gc.freeze()
