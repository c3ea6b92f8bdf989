"""User code given in a config by ``_target_``, without forking: a reward function, a tool.

``_target_`` is a dotted path (``my_pkg.rewards.score``, importable from the job's ``PYTHONPATH``) or a file path
and a name (``/home/me/reward.py:score``, like verl's ``custom_reward_function.path`` + ``.name``); the entry's
other keys are keyword arguments. Hydra's ``instantiate`` builds it (hydra.cc, "Instantiating objects with
Hydra"), so ``_partial_: true`` and nested ``_target_`` work as in Hydra; a file is first imported as the module
``afm_plugin_<file stem>``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class PluginError(ValueError):
    """A ``_target_`` that cannot be imported or built; the message names the config key and the target."""


def _import_file(path: Path, key: str) -> str:
    """Import ``path`` once as a module; returns its module name."""
    if not path.is_file():
        raise PluginError(f"{key}._target_: no file {path}")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    name = f"afm_plugin_{path.stem}_{digest}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[name]
            raise PluginError(f"{key}._target_: importing {path} failed: {type(err).__name__}: {err}") from err
    return name


def dotted_target(target: str, key: str) -> str:
    """``target`` as an importable dotted path (a ``file.py:name`` target is imported first)."""
    if ":" in target or target.endswith(".py"):
        file, _, attr = target.rpartition(":") if ":" in target else (target, "", "")
        if not attr:
            raise PluginError(f"{key}._target_={target!r}: a file target is FILE.py:NAME")
        return f"{_import_file(Path(file).expanduser(), key)}.{attr}"
    return target


def is_plugin(entry: Any) -> bool:
    """Whether a config entry names user code (a mapping with ``_target_``)."""
    return isinstance(entry, Mapping) and "_target_" in entry


def build_plugin(entry: Mapping[str, Any], key: str, **kwargs: Any) -> Any:
    """Build the entry's ``_target_`` with its other keys (and ``kwargs``) as keyword arguments.

    Args:
        entry: ``{"_target_": ..., **arguments}``.
        key: the config key, for messages (``reward_fn``, ``tools.tools.wiki_search``).
    Raises:
        PluginError: the target cannot be imported, or calling it with those arguments failed.
    """
    from hydra.errors import InstantiationException  # hydra only when a plug-in is built (a rank needs none)
    from hydra.utils import instantiate

    spec = {**dict(entry), "_target_": dotted_target(str(entry["_target_"]), key)}
    try:
        return instantiate(spec, **kwargs)
    except InstantiationException as err:
        raise PluginError(f"{key}: {err}") from err


def check_plugins(cfg: Mapping[str, Any]) -> None:
    """Import every plug-in a job's config names (``reward_fn``, the ``tools.tools`` entries with ``_target_``)
    without building it: run where the job is submitted, so a target that does not import fails before the
    queue. The tool's ``server``, ``url`` and ``limits`` keys are the pool's, not the target's.

    Raises:
        PluginError: naming the key (``reward_fn``, ``tools.<tag>``) and the target.
    """
    tools: Mapping[str, Any] = (cfg.get("tools") or {}).get("tools") or {}
    entries = {"reward_fn": cfg.get("reward_fn"), **{f"tools.{tag}": entry for tag, entry in tools.items()}}
    for key, entry in entries.items():
        if is_plugin(entry):
            build_plugin({k: v for k, v in entry.items() if k not in ("server", "url", "limits")}, key, _partial_=True)
