"""The error, the one-line check every schema's ``__post_init__`` uses, and plain values -> a checked dataclass."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value cannot be used; the message names the key (``trainer.eval_interval``) and the valid values."""


def require(ok: bool, key: str, value: Any, valid: str) -> None:
    """Raise ``ConfigError("<key>=<value>: <valid>")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}={value!r}: {valid}")


def at_least_one(key: str, value: Any) -> None:
    """Raise ``ConfigError`` unless ``value`` is an integer >= 1 (a count, a size, a step number)."""
    require(isinstance(value, int) and value >= 1, key, value, "an integer >= 1")


def positive(key: str, value: Any) -> None:
    """Raise ``ConfigError`` unless ``value`` is a number > 0 (a rate, a duration, a clip range)."""
    require(value is not None and value > 0, key, value, "a positive number")


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (the valid TP/PP sizes for ``n`` heads or layers)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def instantiate(schema: type[T], plain: Any, prefix: str = "") -> T:
    """``plain`` (dicts, lists, scalars; ``${...}`` interpolations resolve in the caller's context) merged onto
    a fresh structured config of ``schema`` and turned into the dataclass, so every ``__post_init__`` runs.

    Args:
        prefix: prepended to the key in OmegaConf's messages (``"cluster."`` for a group checked on its own);
            the ``__post_init__`` checks name the full key themselves.
    Raises:
        ConfigError: an unknown key (the message lists the known ones), a value of the wrong type, or a failed
            ``__post_init__`` check.
    """
    try:
        typed = OmegaConf.merge(OmegaConf.structured(schema), plain)
        return OmegaConf.to_object(typed)  # type: ignore[return-value]
    except ConfigError:
        raise  # a __post_init__ check: its message names the full key already
    except OmegaConfBaseException as err:
        if isinstance(err.__cause__, ConfigError):
            raise err.__cause__ from None
        key = f"{prefix}{err.full_key}" if getattr(err, "full_key", None) else prefix.rstrip(".")
        message = str(err).split("\n")[0]
        owner = getattr(err, "object_type", None)
        if isinstance(err, ConfigKeyError) and owner is not None and dataclasses.is_dataclass(owner):
            message += f"; valid keys: {', '.join(f.name for f in dataclasses.fields(owner))}"
        raise ConfigError(f"{key}: {message}" if key else message) from None


def job_config(schema: type[T], cfg: DictConfig | Mapping[str, Any] | T) -> T:
    """A composed job config as the job function receives it (Hydra's ``DictConfig``, or plain dicts and lists) as
    a checked ``schema`` (interpolations resolved); an instance of ``schema`` as is. Each job's ``load_cfg``
    (:func:`afm_core.config.rl.rl_config`, :func:`afm_core.config.eval.eval_config` ...) is this on its schema.

    Raises:
        ConfigError: as :func:`afm_core.config.check_config`.
    """
    if isinstance(cfg, schema):
        return cfg
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)  # type: ignore[arg-type]
    return instantiate(schema, plain)
