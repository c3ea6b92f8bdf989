"""Typed config schemas: dataclasses registered with Hydra's ConfigStore, checked before a job is built or submitted.

Each ``jobs/*.py`` app names its schema first in its primary config's defaults list (``conf/sft.yaml``:
``- sft_schema``), so Hydra merges every YAML file and command-line override onto the dataclass: a value of the
wrong type (``trainer.seq_length=abc``) or an unknown key fails at composition, naming the key.
:func:`check_config` then instantiates the dataclasses, which runs their ``__post_init__`` range and
cross-field checks (heads and layers divisible by TP/PP/VPP, intervals >= 1, batch sizes), and rejects keys
added with ``+`` that the schema does not know. The pattern is torchtitan's component configs
(pytorch/torchtitan ``torchtitan/config/job_config.py``) on Hydra's structured configs
(hydra.cc, "Structured Configs", "Config Store API").

Adding an app's schema (eval, RL): write its dataclasses in a module here (fields typed, defaults valid, nested
groups ``MISSING``, checks in ``__post_init__`` raising :class:`ConfigError` via :func:`require`), add one
``store.store(...)`` line to :func:`register_schemas`, put ``- <name>_schema`` first in the app's defaults list,
and call :func:`check_config` at the top of the app's ``main``.
"""

from __future__ import annotations

from typing import TypeVar

from omegaconf import DictConfig, OmegaConf

from afm_core.config.checks import ConfigError, instantiate, require

T = TypeVar("T")

__all__ = ["ConfigError", "check_config", "register_schemas", "require"]


def register_schemas() -> None:
    """Register every app schema with Hydra's ConfigStore (idempotent; run on import of this package)."""
    from hydra.core.config_store import ConfigStore

    from afm_core.config.data import PrepareDataConfig
    from afm_core.config.rl import RLConfig
    from afm_core.config.sft import SFTConfig

    store = ConfigStore.instance()
    store.store(name="sft_schema", node=SFTConfig)
    store.store(name="rl_schema", node=RLConfig)
    store.store(name="prepare_data_schema", node=PrepareDataConfig)


def check_config(cfg: DictConfig, schema: type[T]) -> T:
    """``cfg`` (a composed app config) as an instance of ``schema``, every ``__post_init__`` check run.

    The plain values of ``cfg`` are merged onto a fresh structured config of ``schema``, so that keys added with
    ``+key=value`` (which Hydra lets through) are rejected too; interpolations resolve in the caller's context
    (``${hydra:...}`` inside a Hydra app).

    Raises:
        ConfigError: an unknown key, a value of the wrong type, or a failed range or cross-field check; the
            message names the key (``trainer.eval_interval``) and the valid values.
    """
    return instantiate(schema, OmegaConf.to_container(cfg, resolve=False))


register_schemas()
