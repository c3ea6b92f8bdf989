"""oneMKL VML resolved single-threaded in every process that trains or serves (afm_core.utils.cpu_math).

The race itself (a fresh process's first multi-threaded ``cos`` inexact on one thread's chunk) shows in ~10% of
spawned processes here and needs dozens of ~1.6 s process starts to show once, so the suite checks the wiring;
the module docstring has the measurement.
"""

from importlib.metadata import entry_points

import pytest
import torch

from afm_core.engine import distributed
from afm_core.utils import cpu_math


def test_warm_vml_calls_every_listed_op_in_float32_and_float64(monkeypatch):
    if not torch.backends.mkl.is_available():
        pytest.skip("torch built without MKL: nothing to resolve")
    monkeypatch.setattr(cpu_math, "_WARMED", False)
    called = []
    for name in cpu_math.VML_OPS:
        op = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda x, op=op, name=name: called.append((name, x.dtype)) or op(x))
    cpu_math.warm_vml()
    assert set(called) == {(n, d) for n in cpu_math.VML_OPS for d in (torch.float32, torch.float64)}
    assert len(called) == 2 * len(cpu_math.VML_OPS)
    called.clear()
    cpu_math.warm_vml()  # once per process
    assert called == []


def test_every_training_rank_resolves_vml_before_it_sets_its_threads(monkeypatch):
    order = []
    monkeypatch.setattr(cpu_math, "warm_vml", lambda: order.append("warm"))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: order.append(("threads", n)))
    assert distributed.set_num_threads(2, 1) == 2
    assert order == ["warm", ("threads", 2)]


def test_every_vllm_process_calls_warm_vml_the_import_hooks_and_the_heap_freeze_as_general_plugins():
    """vLLM loads each ``vllm.general_plugins`` entry point in every process (the engine core too): VML warmed, the
    import hooks installed (the ISA-check record: tests/test_process_imports.py), the heap frozen before the
    engine is built (afm_core.utils.process_exit)."""
    from afm_core.utils import import_hooks, process_exit

    plugins = {ep.name: ep.load() for ep in entry_points(group="vllm.general_plugins")}
    assert "afm_warm_vml" in plugins, "pip install -e . registers the entry points of pyproject.toml"
    assert plugins["afm_warm_vml"] is cpu_math.warm_vml
    assert plugins["afm_import_hooks"] is import_hooks.install
    assert plugins["afm_freeze_heap"] is process_exit.freeze_heap
