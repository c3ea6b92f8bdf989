"""The decoder architecture of a model, in one vocabulary shared by presets, HF configs and Megatron-core.

``ModelArch`` holds the dozen numbers that fix a Llama/Qwen2-style decoder (GQA, RMSNorm, SwiGLU, RoPE).
``arch_from_hf_config`` reads them from a transformers config (HF names: ``num_hidden_layers``,
``intermediate_size``, ``num_key_value_heads``, ``rms_norm_eps``, ``rope_parameters``...), rejecting the
variants the Megatron conversion does not implement. transformers 5.x keeps the RoPE base in
``config.rope_parameters["rope_theta"]`` (4.x had ``config.rope_theta``); both are read. RoPE scaling
(``rope_parameters.rope_type``): ``default`` and Llama 3.1's ``llama3`` (megatron-core's ``RotaryEmbedding``
``rope_scaling`` reproduces it for ``low_freq_factor`` 1, ``high_freq_factor`` 4 and
``original_max_position_embeddings`` 8192, the values of every Llama 3.x release) convert; ``yarn`` does not yet
(megatron-core 0.16.1's ``GPTModel`` drops YaRN's attention factor, ``mscale``, that HF and vLLM apply, so the
trained and the served model would differ), nor do the others.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

FAMILIES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelArch:
    """A Llama/Qwen2 decoder. Sizes in elements; ``vocab_size`` is the padded vocabulary of the HF config
    (the embedding's row count, e.g. 151936 for Qwen2.5-0.5B while its tokenizer has 151665 tokens)."""

    family: str  # llama | qwen2 (the HF model_type)
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int  # SwiGLU inner size (HF intermediate_size)
    num_attention_heads: int
    num_query_groups: int  # key/value heads (GQA); == num_attention_heads for MHA
    vocab_size: int
    max_position_embeddings: int  # tokens
    rope_theta: float  # RoPE base
    norm_epsilon: float  # RMSNorm epsilon
    qkv_bias: bool  # bias on the q/k/v projections (Qwen2: always)
    tied_embeddings: bool  # output layer shares the input embedding matrix
    rope_scaling: dict[str, Any] | None = (
        None  # HF rope_parameters beyond rope_theta (rope_type, factor...); None: plain
    )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


ARCH_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ModelArch))

# ModelArch field -> the HF config attribute it is read from (for error messages).
HF_FIELD_NAMES = {
    "family": "model_type",
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "rope_theta": "rope_parameters.rope_theta",
    "norm_epsilon": "rms_norm_eps",
    "qkv_bias": "attention_bias",
    "tied_embeddings": "tie_word_embeddings",
    "rope_scaling": "rope_parameters",
}
# megatron-core's llama3 RoPE scaling (RotaryEmbedding._apply_scaling) has these fixed; the factor is a parameter.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
ROPE_TYPES = ("default", "llama3")


def hf_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5.x) or the 4.x ``rope_theta`` / ``rope_scaling`` attributes, as one dict."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if isinstance(legacy, dict) and not params.get("rope_type"):
        params.update(legacy)
    if "rope_theta" not in params and getattr(hf_config, "rope_theta", None) is not None:
        params["rope_theta"] = hf_config.rope_theta
    return params


def hf_rope_theta(hf_config: Any) -> float:
    """The RoPE base of an HF config: ``rope_parameters["rope_theta"]`` (transformers 5.x) or ``rope_theta``.

    Raises:
        ValueError: no RoPE base is found.
    """
    theta = hf_rope_parameters(hf_config).get("rope_theta")
    if theta is None:
        raise ValueError(f"{type(hf_config).__name__} has no rope_parameters.rope_theta (RoPE base)")
    return float(theta)


def hf_rope_scaling(hf_config: Any) -> dict[str, Any] | None:
    """The RoPE scaling of an HF config (``rope_parameters`` without ``rope_theta``), None for plain RoPE.

    Raises:
        NotImplementedError: a ``rope_type`` the Megatron conversion does not reproduce (module docstring), or
            ``llama3`` with other frequency factors than megatron-core's.
    """
    params = {k: v for k, v in hf_rope_parameters(hf_config).items() if k != "rope_theta"}
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return None
    name = type(hf_config).__name__
    if rope_type not in ROPE_TYPES:
        why = " (megatron-core 0.16.1 drops YaRN's attention factor)" if rope_type == "yarn" else ""
        raise NotImplementedError(
            f"{name}: rope_parameters.rope_type={rope_type!r} is not supported{why}; supported: {', '.join(ROPE_TYPES)}"
        )
    for key, want in MEGATRON_LLAMA3_ROPE.items():
        if float(params.get(key, want)) != want:
            raise NotImplementedError(
                f"{name}: rope_parameters.{key}={params.get(key)} (llama3 RoPE scaling converts to Megatron-core only "
                f"with {key}={want})"
            )
    return {"rope_type": rope_type, "factor": float(params["factor"]), **MEGATRON_LLAMA3_ROPE}


def arch_from_hf_config(hf_config: Any) -> ModelArch:
    """Read the architecture of a transformers ``LlamaConfig`` / ``Qwen2Config``.

    Raises:
        NotImplementedError: a family other than llama/qwen2, or a variant the conversion does not cover
            (non-SiLU activation, MLP bias, Llama ``attention_bias`` (it also biases o_proj), sliding-window
            attention, RoPE scaling other than llama3 (see :func:`hf_rope_scaling`), a ``head_dim`` other than ``hidden_size / num_attention_heads``).
    """
    family = hf_config.model_type
    if family not in FAMILIES:
        raise NotImplementedError(f"model_type={family!r} is not supported (supported: {', '.join(FAMILIES)})")
    name = type(hf_config).__name__
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"{name}: hidden_act={hf_config.hidden_act!r}; only SwiGLU (silu) is supported")
    if getattr(hf_config, "mlp_bias", False):
        raise NotImplementedError(f"{name}: mlp_bias=True is not supported")
    if family == "llama" and getattr(hf_config, "attention_bias", False):
        raise NotImplementedError(f"{name}: attention_bias=True (bias on q/k/v and o_proj) is not supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise NotImplementedError(f"{name}: use_sliding_window=True is not supported")
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim is not None and head_dim * hf_config.num_attention_heads != hf_config.hidden_size:
        raise NotImplementedError(
            f"{name}: head_dim={head_dim} != hidden_size / num_attention_heads "
            f"({hf_config.hidden_size} / {hf_config.num_attention_heads})"
        )
    return ModelArch(
        family=family,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        rope_theta=hf_rope_theta(hf_config),
        norm_epsilon=float(hf_config.rms_norm_eps),
        qkv_bias=True if family == "qwen2" else bool(getattr(hf_config, "attention_bias", False)),
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        rope_scaling=hf_rope_scaling(hf_config),
    )


def hf_config_from_arch(arch: ModelArch, **extra: Any):
    """A transformers config (``LlamaConfig`` / ``Qwen2Config``) describing ``arch``; ``extra`` adds token ids
    and the like. Used to build random-weight models of a preset's shape.

    Raises:
        NotImplementedError: a Llama arch with ``qkv_bias`` (HF Llama would also bias o_proj).
    """
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        num_hidden_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_query_groups,
        vocab_size=arch.vocab_size,
        max_position_embeddings=arch.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta, **(arch.rope_scaling or {})},
        rms_norm_eps=arch.norm_epsilon,
        tie_word_embeddings=arch.tied_embeddings,
        hidden_act="silu",
        **extra,
    )
    if arch.family == "qwen2":
        return Qwen2Config(**common)
    if arch.qkv_bias:
        raise NotImplementedError(
            "a llama arch with qkv_bias=True has no HF equivalent (attention_bias also biases o_proj)"
        )
    return LlamaConfig(head_dim=arch.head_dim, attention_bias=False, mlp_bias=False, **common)
