"""Model presets: one key layout, published numbers, clear errors, Hydra composition."""

from __future__ import annotations

import pytest
import yaml

from afm_core.models import presets
from afm_core.models.arch import ModelArch, arch_from_hf_config, hf_config_from_arch
from afm_core.models.presets import (
    PRESET_FIELDS,
    RUN_KEYS,
    PresetError,
    available_presets,
    check_against_hf_config,
    load_preset,
)

EXPECTED = {
    "smollm2-135m",
    "tiny-llama",
    "qwen2.5-0.5b-instruct",
    "qwen2.5-1.5b-instruct",
    "qwen2.5-3b-instruct",
    "qwen2.5-7b-instruct",
    "qwen2.5-14b-instruct",
    "qwen2.5-32b-instruct",
    "qwen2.5-coder-7b-instruct",
    "qwen2.5-coder-32b-instruct",
    "tiny-qwen3",
    "tiny-llama3",
    *(f"qwen3-{size}" for size in ("0.6b", "1.7b", "4b", "8b", "14b", "32b")),
    *(f"llama-{v}-instruct" for v in ("3.1-8b", "3.2-1b", "3.2-3b", "3.3-70b")),
}


def test_every_preset_loads_with_one_key_layout():
    assert set(available_presets()) >= EXPECTED
    for name in available_presets():
        raw = yaml.safe_load(presets.preset_path(name).read_text())
        assert tuple(raw) == PRESET_FIELDS, name
        preset = load_preset(name)
        assert preset.name == name and preset.origin == f"conf/model/{name}.yaml"
        assert (preset.source == "hf_path") == name.startswith(("qwen", "llama"))


def test_published_numbers():
    smol = load_preset("smollm2-135m")
    assert smol.source == "gguf_package" and smol.arch.tied_embeddings and not smol.arch.qkv_bias
    assert (smol.arch.num_layers, smol.arch.hidden_size, smol.arch.num_attention_heads, smol.arch.num_query_groups) == (
        30,
        576,
        9,
        3,
    )
    q32 = load_preset("qwen2.5-32b-instruct").arch
    assert (q32.num_layers, q32.hidden_size, q32.ffn_hidden_size, q32.num_attention_heads, q32.num_query_groups) == (
        64,
        5120,
        27648,
        40,
        8,
    )
    assert q32.vocab_size == 152064 and not q32.tied_embeddings and q32.qkv_bias and q32.rope_theta == 1e6
    assert load_preset("qwen2.5-0.5b-instruct").arch.tied_embeddings
    assert load_preset("qwen2.5-coder-7b-instruct").arch == load_preset("qwen2.5-7b-instruct").arch
    q3 = load_preset("qwen3-32b").arch  # head_dim 128 with 64 heads: not hidden / heads (80)
    assert (q3.family, q3.num_layers, q3.hidden_size, q3.ffn_hidden_size, q3.num_attention_heads) == (
        "qwen3",
        64,
        5120,
        25600,
        64,
    )
    assert (q3.head_dim, q3.num_query_groups, q3.qk_layernorm, q3.qkv_bias, q3.tied_embeddings) == (
        128,
        8,
        True,
        False,
        False,
    )
    assert load_preset("qwen3-0.6b").arch.tied_embeddings and load_preset("qwen3-0.6b").arch.head_dim == 128
    l32 = load_preset("llama-3.2-1b-instruct").arch
    assert (l32.head_dim, l32.vocab_size, l32.rope_scaling["factor"], l32.tied_embeddings) == (64, 128256, 32.0, True)


def test_preset_round_trips_through_an_hf_config():
    for name in available_presets():
        arch = load_preset(name).arch
        assert arch_from_hf_config(hf_config_from_arch(arch)) == arch


def test_bad_preset_file_names_file_line_and_field(tmp_path, monkeypatch):
    monkeypatch.setattr(presets, "presets_dir", lambda: tmp_path)
    text = presets.repo_root().joinpath("conf/model/tiny-llama.yaml").read_text()
    (tmp_path / "tiny-llama.yaml").write_text(text.replace("num_layers: 2", "num_layers: two"))
    line = text.splitlines().index("num_layers: 2") + 1
    with pytest.raises(
        PresetError, match=rf"tiny-llama.yaml:{line}: field 'num_layers': expected a positive integer, got 'two'"
    ):
        load_preset("tiny-llama")
    (tmp_path / "tiny-llama.yaml").write_text(text + "dropout: 0.1\n")
    with pytest.raises(PresetError, match=r"field 'dropout': unknown field"):
        load_preset("tiny-llama")
    (tmp_path / "tiny-llama.yaml").write_text(text.replace("source: random", "source: hub"))
    with pytest.raises(PresetError, match=r"field 'source': expected one of gguf_package, random, hf_path"):
        load_preset("tiny-llama")
    with pytest.raises(PresetError, match="unknown model preset 'nope'"):
        load_preset("nope")


def test_mismatch_with_hf_config_names_both_fields():
    preset = load_preset("qwen2.5-7b-instruct")
    wrong = ModelArch(**{**preset.arch.as_dict(), "num_query_groups": 8})
    with pytest.raises(
        PresetError, match=r"field 'num_query_groups' = 4, but /x/config.json has num_key_value_heads = 8"
    ):
        check_against_hf_config(preset, hf_config_from_arch(wrong), "/x/config.json")
    check_against_hf_config(preset, hf_config_from_arch(preset.arch), "/x/config.json")


def test_hydra_composes_the_model_group():
    from hydra import compose, initialize_config_dir

    from afm_core.config import register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=str(presets.repo_root() / "conf"), version_base="1.3"):
        cfg = compose(config_name="sft", overrides=["model=tiny-llama", "model.hf_path=/some/dir"])
    preset = load_preset(cfg.model)
    assert preset.name == "tiny-llama" and preset.hf_path == "/some/dir" and preset.origin == "model config"
    with initialize_config_dir(config_dir=str(presets.repo_root() / "conf"), version_base="1.3"):
        cfg = compose(config_name="sft", overrides=["model=tiny-llama", "model.num_layers=0"])
    with pytest.raises(PresetError, match=r"field 'model.num_layers': expected a positive integer"):
        load_preset(cfg.model)


def test_each_architecture_field_is_declared_once_and_everything_else_derives_from_it():
    """ModelArch's declaration (HF name, megatron-core name, meaning) yields the HF names, the TransformerConfig
    fields and GPTModel arguments, the preset keys and the Hydra ``model`` schema."""
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    from afm_core.config.sft import ModelConfig
    from afm_core.models.arch import (
        ARCH_FIELDS,
        HF_FIELD_NAMES,
        MCORE_CONFIG_FIELDS,
        MCORE_MODEL_ARGS,
        mcore_config_fields,
        mcore_model_args,
    )

    assert tuple(f.name for f in dataclasses.fields(ModelConfig)) == (*PRESET_FIELDS, *RUN_KEYS)  # + model.lora
    assert tuple(HF_FIELD_NAMES) == ARCH_FIELDS
    assert set(MCORE_CONFIG_FIELDS) | set(MCORE_MODEL_ARGS) == set(ARCH_FIELDS) - {"family"}
    assert set(MCORE_CONFIG_FIELDS.values()) <= {f.name for f in dataclasses.fields(TransformerConfig)}
    q3 = load_preset("qwen3-32b").arch
    assert mcore_config_fields(q3) == {
        "num_layers": 64,
        "hidden_size": 5120,
        "ffn_hidden_size": 25600,
        "num_attention_heads": 64,
        "num_query_groups": 8,
        "kv_channels": 128,
        "layernorm_epsilon": 1e-6,
        "add_qkv_bias": False,
        "qk_layernorm": True,
    }
    args = mcore_model_args(load_preset("llama-3.1-8b-instruct").arch)
    assert (args["vocab_size"], args["max_sequence_length"], args["rotary_base"]) == (128256, 131072, 500000.0)
    assert args["rope_scaling"] is True and args["rope_scaling_factor"] == 8.0
    assert not args["share_embeddings_and_output_weights"]
