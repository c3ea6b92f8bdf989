"""Model presets: ``conf/model/<name>.yaml`` read, validated and checked against an HF ``config.json``.

Every preset has the same keys: ``name``, ``source``, ``hf_path`` and the :class:`~afm_core.models.arch.ModelArch`
fields (published numbers of the model). ``source`` says where the HF checkpoint comes from:

- ``gguf_package``: converted once from a GGUF file shipped in an installed Python package (SmolLM2-135M);
- ``random``: a seeded random-weight model of the preset's shape (tiny test models);
- ``hf_path``: a checkpoint directory the user provides as ``model.hf_path``.

A set ``hf_path`` always wins over ``source``. When a ``config.json`` is at hand it is authoritative:
:func:`check_against_hf_config` fails on any field where the preset disagrees with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from afm_core.models.arch import (
    ARCH_FIELD_TYPES,
    ARCH_FIELDS,
    FAMILIES,
    HF_FIELD_NAMES,
    ModelArch,
    arch_from_hf_config,
    check_family_traits,
    hf_rope_scaling,
)
from afm_core.utils.paths import repo_root

SOURCES = ("gguf_package", "random", "hf_path")
PRESET_FIELDS = ("name", "source", "hf_path", *ARCH_FIELDS)

# the value checks follow the ModelArch field types (declared once in models/arch.py)
_INT_FIELDS = tuple(f for f in ARCH_FIELDS if ARCH_FIELD_TYPES[f] is int)
_FLOAT_FIELDS = tuple(f for f in ARCH_FIELDS if ARCH_FIELD_TYPES[f] is float)
_BOOL_FIELDS = tuple(f for f in ARCH_FIELDS if ARCH_FIELD_TYPES[f] is bool)


class PresetError(ValueError):
    """A preset file or ``model`` config is malformed, or disagrees with the HF ``config.json``."""


@dataclass(frozen=True)
class ModelPreset:
    name: str
    source: str  # gguf_package | random | hf_path
    hf_path: str | None  # user checkpoint dir; overrides source when set
    arch: ModelArch
    origin: str  # where it was read from: "conf/model/<name>.yaml" or "model config"


def presets_dir() -> Path:
    return repo_root() / "conf" / "model"


def available_presets() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def preset_path(name: str) -> Path:
    """``conf/model/<name>.yaml``.

    Raises:
        PresetError: no such preset (the message lists the available ones).
    """
    path = presets_dir() / f"{name}.yaml"
    if not path.is_file():
        raise PresetError(
            f"unknown model preset {name!r}: {path} does not exist (available: {', '.join(available_presets())})"
        )
    return path


def load_preset(name_or_cfg: str | Mapping[str, Any]) -> ModelPreset:
    """A preset by name (``conf/model/<name>.yaml``) or from an already composed ``model`` config (a Hydra
    ``DictConfig`` or a dict with the preset keys, possibly overridden on the command line).

    Raises:
        PresetError: missing/unknown keys or a bad value; the message names the file, line and field
            (for a file) or ``model.<field>`` (for a config).
    """
    if isinstance(name_or_cfg, str):
        path = preset_path(name_or_cfg)
        text = path.read_text()
        try:
            node = yaml.compose(text)
            values = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PresetError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(values, dict):
            raise PresetError(f"{path}: expected a mapping of preset fields, got {type(values).__name__}")
        lines = {key.value: key.start_mark.line + 1 for key, _ in node.value}
        origin = str(path.relative_to(repo_root())) if path.is_relative_to(repo_root()) else str(path)

        def where(field: str) -> str:
            return f"{origin}:{lines[field]}: field '{field}'" if field in lines else f"{origin}: field '{field}'"

        preset = _validate(values, where, origin)
        if preset.name != name_or_cfg:
            raise PresetError(f"{where('name')}: name {preset.name!r} differs from the file name {name_or_cfg!r}")
        return preset
    values = _to_dict(name_or_cfg)
    return _validate(values, lambda field: f"model config: field 'model.{field}'", "model config")


# Keys of a composed ``model`` group that are the run's, not the preset's: the adapters (``afm_core.config.lora``)
RUN_KEYS = ("lora",)


def _to_dict(cfg: Mapping[str, Any]) -> dict[str, Any]:
    values = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    return {key: value for key, value in values.items() if key not in RUN_KEYS}


def _validate(values: dict[str, Any], where, origin: str) -> ModelPreset:
    missing = [f for f in PRESET_FIELDS if f not in values]
    if missing:
        raise PresetError(
            f"{origin}: missing field(s) {', '.join(missing)} (every preset has: {', '.join(PRESET_FIELDS)})"
        )
    unknown = [f for f in values if f not in PRESET_FIELDS]
    if unknown:
        raise PresetError(f"{where(unknown[0])}: unknown field (preset fields: {', '.join(PRESET_FIELDS)})")

    def fail(field: str, expected: str) -> None:
        raise PresetError(f"{where(field)}: expected {expected}, got {values[field]!r}")

    if not isinstance(values["name"], str) or not values["name"]:
        fail("name", "a non-empty string")
    if values["source"] not in SOURCES:
        fail("source", f"one of {', '.join(SOURCES)}")
    if values["hf_path"] is not None and not isinstance(values["hf_path"], str):
        fail("hf_path", "null or a directory path")
    if values["family"] not in FAMILIES:
        fail("family", f"one of {', '.join(FAMILIES)}")
    for field in _INT_FIELDS:
        if isinstance(values[field], bool) or not isinstance(values[field], int) or values[field] <= 0:
            fail(field, "a positive integer")
    for field in _FLOAT_FIELDS:
        value = values[field]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            fail(field, "a positive number")
    for field in _BOOL_FIELDS:
        if not isinstance(values[field], bool):
            fail(field, "true or false")
    scaling = values["rope_scaling"]
    if scaling is not None:
        if not isinstance(scaling, dict) or "rope_type" not in scaling:
            fail("rope_scaling", "null or a mapping with rope_type (HF rope_parameters), e.g. {rope_type: llama3}")
        try:
            values["rope_scaling"] = hf_rope_scaling(SimpleNamespace(rope_parameters=dict(scaling)))
        except NotImplementedError as err:
            raise PresetError(f"{where('rope_scaling')}: {err}") from None
    arch = ModelArch(**{f: values[f] for f in ARCH_FIELDS})
    if arch.num_attention_heads % arch.num_query_groups:
        raise PresetError(
            f"{where('num_query_groups')}: num_attention_heads ({arch.num_attention_heads}) must divide by "
            f"num_query_groups ({arch.num_query_groups})"
        )
    if arch.head_dim % 2:
        raise PresetError(f"{where('head_dim')}: expected an even head_dim (RoPE rotates pairs), got {arch.head_dim}")
    try:
        check_family_traits(arch)
    except ValueError as err:
        field = "qkv_bias" if str(err).startswith("qkv_bias") else "qk_layernorm"
        raise PresetError(f"{where(field)}: {err}") from None
    return ModelPreset(
        name=values["name"], source=values["source"], hf_path=values["hf_path"], arch=arch, origin=origin
    )


def check_against_hf_config(preset: ModelPreset, hf_config: Any, config_path: str | Path) -> None:
    """Check that ``preset`` describes the model of ``hf_config`` (read from ``config_path``).

    Floats compare with a relative tolerance of 1e-6 (GGUF files store ``rms_norm_eps`` as float32).

    Raises:
        PresetError: the first field that differs, naming the preset field, the HF field and both values.
        NotImplementedError: the HF config describes a variant the conversion does not support
            (see :func:`~afm_core.models.arch.arch_from_hf_config`).
    """
    actual = arch_from_hf_config(hf_config)
    for field in ARCH_FIELDS:
        want, got = getattr(preset.arch, field), getattr(actual, field)
        same = math.isclose(want, got, rel_tol=1e-6) if field in _FLOAT_FIELDS else want == got
        if not same:
            raise PresetError(
                f"model preset {preset.name!r} ({preset.origin}) field '{field}' = {want!r}, but {config_path} has "
                f"{HF_FIELD_NAMES[field]} = {got!r}; the HF config is authoritative: point model.hf_path at the "
                f"matching checkpoint or pick the matching preset"
            )
