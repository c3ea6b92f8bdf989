"""Import megatron-core 0.16.1, mbridge 0.15.1 and transformers 5.19 without what their package imports pull in and our
processes never use; :func:`install` (called by ``afm_core.models``, ``.engine``, ``.train`` and ``.rl``, whose modules
import them) hooks the execution of six of their modules before their first import. Why each hook is safe is said
with it below; what it saves is measured by ``benchmarks/startup.py`` (benchmarks/README.md: a training rank's and
``jobs.plan``'s imports, side by side with d3e7e1b).

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

Each hook runs only when its module is first imported after :func:`install`; a process that imported them before (a
test importing megatron first) gets them as upstream ships them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

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


HOOKS: dict[str, Callable[[ModuleType, Callable[[ModuleType], None]], None]] = {
    "megatron.core.jit": _defer_jit_fuser,
    **dict.fromkeys(BACKEND_IMPORTERS, _without_backends),
    "mbridge": _lazy_mbridge,
    "transformers.utils.auto_docstring": _config_docstrings_as_written,
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
