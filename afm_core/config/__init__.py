"""Typed config schemas: dataclasses registered with Hydra's ConfigStore, checked before a job is built or submitted.

Each ``jobs/*.py`` app names its schema first in its primary config's defaults list (``conf/sft.yaml``:
``- sft_schema``) and calls :func:`register_schemas` before Hydra composes (importing this package registers
nothing: no import of ``afm_core`` has a side effect on Hydra's ConfigStore), so Hydra merges every YAML file and command-line override onto the dataclass: a value of the
wrong type (``trainer.seq_length=abc``) or an unknown key fails at composition, naming the key.
:func:`check_config` then instantiates the dataclasses, which runs their ``__post_init__`` range and
cross-field checks (heads and layers divisible by TP/PP/VPP, intervals >= 1, batch sizes), and rejects keys
added with ``+`` that the schema does not know. The pattern is torchtitan's component configs
(pytorch/torchtitan ``torchtitan/config/job_config.py``) on Hydra's structured configs
(hydra.cc, "Structured Configs", "Config Store API").

Adding an app's schema (eval, RL): write its dataclasses in a module here (fields typed, defaults valid, nested
groups ``MISSING``, checks in ``__post_init__`` raising :class:`ConfigError` via :func:`require`), add one
``store.store(...)`` line to :func:`register_schemas`, put ``- <name>_schema`` first in the app's defaults list,
call :func:`register_schemas` in the app's module (``jobs/<app>.py``) and let its ``main`` run the job through
:func:`afm_core.launch.submit.run_job`, whose gate (``check_job_config``) calls :func:`check_config`. Code that composes an app's config itself (tests, benchmarks, ``jobs.plan``) calls
:func:`register_schemas` first.

This package sits above ``data`` and ``models`` in the package order (``docs/architecture.md``): a schema's
checks call the validators of the package that owns the value (a model preset's, a data source's), and nothing
below ``config`` imports it.
"""

from __future__ import annotations

from typing import TypeVar

from omegaconf import DictConfig, OmegaConf

from afm_core.config.checks import ConfigError, instantiate, require

T = TypeVar("T")

__all__ = ["ConfigError", "check_config", "register_schemas", "require"]


def register_schemas() -> None:
    """Register every app schema with Hydra's ConfigStore under ``<app>_schema`` (idempotent: a second call stores
    the same nodes again).

    Called by the job entry points (``jobs/sft.py``, ``jobs/rl.py``, ``jobs/prepare_data.py``,
    ``jobs/pipeline.py``) at import, before ``@hydra.main`` composes, and by whatever composes an app's config
    with Hydra's compose API (:func:`afm_core.launch.plan.compose`, tests, benchmarks); without it, composing
    ``conf/sft.yaml`` fails with "Could not find 'sft_schema'". ``eval_schema``, ``filter_rl_schema`` and
    ``distill_schema`` are stored for configs that compose onto them; ``conf/eval.yaml``, ``conf/filter_rl.yaml``
    and ``conf/distill.yaml`` do not name them, so that a bad override there exits with status 2 at the jobs'
    gate (:func:`afm_core.launch.submit.check_job_config`) rather than in Hydra's composition.
    """
    # importing the package (ConfigError, check_config) loads neither Hydra's ConfigStore nor any schema module
    from hydra.core.config_store import ConfigStore

    from afm_core.config.data import PrepareDataConfig
    from afm_core.config.eval import DistillConfig, EvalConfig, FilterRLConfig
    from afm_core.config.rl import RLConfig
    from afm_core.config.sft import SFTConfig

    store = ConfigStore.instance()
    store.store(name="sft_schema", node=SFTConfig)
    store.store(name="rl_schema", node=RLConfig)
    store.store(name="prepare_data_schema", node=PrepareDataConfig)
    store.store(name="eval_schema", node=EvalConfig)
    store.store(name="filter_rl_schema", node=FilterRLConfig)
    store.store(name="distill_schema", node=DistillConfig)


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
