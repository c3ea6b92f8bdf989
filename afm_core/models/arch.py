"""The decoder architecture of a model, declared once and shared by presets, HF configs and Megatron-core.

``ModelArch`` holds the numbers that fix a Llama/Qwen-style dense decoder (GQA, RMSNorm, SwiGLU, RoPE). Each of
its fields is declared once, with the HF config attribute it maps to and its meaning (the field's ``metadata``:
``hf``, ``doc``); everything else is derived from that declaration: :data:`HF_FIELD_NAMES`,
:func:`arch_from_hf_config` (HF -> arch), :func:`hf_config_from_arch` (arch -> HF), the Megatron
``TransformerConfig`` (``models/gpt.py`` ``mcore_config_from_hf``), the preset file checks
(``models/presets.py``: the field types) and the Hydra schema ``model`` (``config/sft.py`` ``ModelConfig``).

Families (:data:`FAMILY_SPECS`, the HF ``model_type``): ``llama`` (transformers ``models/llama``; Llama 2/3.x,
SmolLM2), ``qwen2`` (``models/qwen2``: q/k/v bias) and ``qwen3`` (``models/qwen3/modeling_qwen3.py``: an RMSNorm
over each head's q and k before RoPE, ``q_norm`` / ``k_norm``, no q/k/v bias, a ``head_dim`` independent of
``hidden_size / num_attention_heads``). What a family fixes (q/k/v bias, QK-norm) is read from its spec, not from
the config.

An HF config attribute that changes the model's math and is not mapped is refused by name
(:func:`check_unmapped_hf_fields`): each attribute of the config is mapped to a field, known not to change the
forward pass (token ids, ``use_cache``, an inactive ``sliding_window`` ...), or checked to be inactive
(``use_sliding_window``, ``layer_types``, ``mlp_bias``, ``attention_bias`` of Llama/Qwen3, which also biases
``o_proj``, ``hidden_act``), and anything else is refused.

transformers 5.x keeps the RoPE base in ``config.rope_parameters["rope_theta"]`` (4.x had ``config.rope_theta``);
both are read. RoPE scaling (``rope_parameters.rope_type``): ``default`` and Llama 3.1's ``llama3``
(megatron-core's ``RotaryEmbedding`` ``rope_scaling`` reproduces it for ``low_freq_factor`` 1,
``high_freq_factor`` 4 and ``original_max_position_embeddings`` 8192, the values of every Llama 3.x release)
convert; ``yarn`` (Qwen2.5/Qwen3 long context) does not yet (megatron-core 0.16.1's ``GPTModel`` drops YaRN's
attention factor, ``mscale``, that HF and vLLM apply, so the trained and the served model would differ), nor do
the others.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class FamilySpec:
    """What an HF ``model_type`` fixes: its transformers config class, and the q/k/v bias and QK-norm every
    model of the family has (``attention_bias`` read from the config where the family has it: Llama and Qwen3
    bias ``o_proj`` with it too, which the conversion does not map, so it must be False)."""

    config_class: str  # transformers config class name
    qkv_bias: bool
    qk_layernorm: bool
    has_attention_bias: bool  # the HF config has ``attention_bias`` (q/k/v and o_proj)


FAMILY_SPECS: dict[str, FamilySpec] = {
    "llama": FamilySpec("LlamaConfig", qkv_bias=False, qk_layernorm=False, has_attention_bias=True),
    "qwen2": FamilySpec("Qwen2Config", qkv_bias=True, qk_layernorm=False, has_attention_bias=False),
    "qwen3": FamilySpec("Qwen3Config", qkv_bias=False, qk_layernorm=True, has_attention_bias=True),
}


def _meta(hf: str, mcore: str | None, doc: str) -> dict[str, Any]:
    """A :class:`ModelArch` field's metadata: the HF config attribute it maps to, the megatron-core name
    (a ``TransformerConfig`` field, or ``GPTModel.<argument>``; None: not passed on) and its meaning."""
    return {"hf": hf, "mcore": mcore, "doc": doc}


@dataclass(frozen=True)
class ModelArch:
    """A dense decoder of one of :data:`FAMILIES`. Sizes in elements; ``vocab_size`` is the padded vocabulary of
    the HF config (the embedding's row count, e.g. 151936 for Qwen2.5-0.5B while its tokenizer has 151665
    tokens). Each field's ``metadata``: ``hf`` (the HF config attribute), ``mcore`` (megatron-core's name) and
    ``doc``."""

    family: str = field(metadata=_meta("model_type", None, "llama | qwen2 | qwen3 (the HF model_type)"))
    num_layers: int = field(metadata=_meta("num_hidden_layers", "num_layers", "decoder layers"))
    hidden_size: int = field(metadata=_meta("hidden_size", "hidden_size", "residual stream width"))
    ffn_hidden_size: int = field(metadata=_meta("intermediate_size", "ffn_hidden_size", "SwiGLU inner size"))
    num_attention_heads: int = field(metadata=_meta("num_attention_heads", "num_attention_heads", "query heads"))
    num_query_groups: int = field(metadata=_meta("num_key_value_heads", "num_query_groups", "key/value heads (GQA)"))
    head_dim: int = field(
        metadata=_meta("head_dim", "kv_channels", "per-head size (Qwen3: 128 at every width; else hidden / heads)")
    )
    vocab_size: int = field(
        metadata=_meta("vocab_size", "GPTModel.vocab_size", "padded vocabulary: rows of the embedding matrix")
    )
    max_position_embeddings: int = field(
        metadata=_meta("max_position_embeddings", "GPTModel.max_sequence_length", "tokens")
    )
    rope_theta: float = field(metadata=_meta("rope_parameters.rope_theta", "GPTModel.rotary_base", "RoPE base"))
    norm_epsilon: float = field(metadata=_meta("rms_norm_eps", "layernorm_epsilon", "RMSNorm epsilon"))
    qkv_bias: bool = field(
        metadata=_meta("attention_bias", "add_qkv_bias", "bias on the q/k/v projections (fixed by the family)")
    )
    qk_layernorm: bool = field(
        metadata=_meta("(family)", "qk_layernorm", "RMSNorm on each head's q and k before RoPE (fixed by the family)")
    )
    tied_embeddings: bool = field(
        metadata=_meta(
            "tie_word_embeddings",
            "GPTModel.share_embeddings_and_output_weights",
            "output layer shares the input embedding matrix",
        )
    )
    rope_scaling: dict[str, Any] | None = field(
        default=None,
        metadata=_meta(
            "rope_parameters",
            "GPTModel.rope_scaling",
            "HF rope_parameters beyond rope_theta, e.g. {rope_type: llama3, factor: 8.0}",
        ),
    )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


ARCH_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ModelArch))
# ModelArch field -> its Python type (int, float, bool, str, or the rope_scaling union)
ARCH_FIELD_TYPES: dict[str, Any] = typing.get_type_hints(ModelArch)
# ModelArch field -> the HF config attribute it is read from (for error messages).
HF_FIELD_NAMES: dict[str, str] = {f.name: f.metadata["hf"] for f in dataclasses.fields(ModelArch)}
ARCH_FIELD_DOCS: dict[str, str] = {f.name: f.metadata["doc"] for f in dataclasses.fields(ModelArch)}
# ModelArch field -> megatron-core TransformerConfig field / GPTModel argument
MCORE_CONFIG_FIELDS: dict[str, str] = {
    f.name: f.metadata["mcore"]
    for f in dataclasses.fields(ModelArch)
    if f.metadata["mcore"] and not f.metadata["mcore"].startswith("GPTModel.")
}
MCORE_MODEL_ARGS: dict[str, str] = {
    f.name: f.metadata["mcore"].removeprefix("GPTModel.")
    for f in dataclasses.fields(ModelArch)
    if f.metadata["mcore"] and f.metadata["mcore"].startswith("GPTModel.")
}


def mcore_config_fields(arch: ModelArch) -> dict[str, Any]:
    """The megatron-core ``TransformerConfig`` fields ``arch`` sets (``kv_channels`` = ``head_dim``,
    ``add_qkv_bias``, ``qk_layernorm``, ``layernorm_epsilon``...), by the declaration's ``mcore`` names."""
    return {mcore: getattr(arch, name) for name, mcore in MCORE_CONFIG_FIELDS.items()}


def mcore_model_args(arch: ModelArch) -> dict[str, Any]:
    """The megatron-core ``GPTModel`` arguments ``arch`` sets: vocabulary, ``max_sequence_length``, tied output
    layer, RoPE base, and the ``llama3`` RoPE scaling as ``rope_scaling`` (a bool) + ``rope_scaling_factor``
    (megatron-core's ``RotaryEmbedding``; :func:`hf_rope_scaling` refuses every other type)."""
    args = {mcore: getattr(arch, name) for name, mcore in MCORE_MODEL_ARGS.items()}
    args["rope_scaling"] = arch.rope_scaling is not None
    args["rope_scaling_factor"] = (arch.rope_scaling or {}).get("factor", 8.0)
    return args


# megatron-core's llama3 RoPE scaling (RotaryEmbedding._apply_scaling) has these fixed; the factor is a parameter.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
ROPE_TYPES = ("default", "llama3")

# HF config attributes that do not change the forward pass (read by nothing here, or only for training defaults:
# initializer_range, attention_dropout). Attributes ending in ``_token_id`` are also neutral.
NEUTRAL_HF_FIELDS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "chunk_size_feed_forward",
        "dtype",
        "torch_dtype",
        "id2label",
        "label2id",
        "is_encoder_decoder",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
        "return_dict",
        "transformers_version",
        "use_cache",
        "initializer_range",
        "attention_dropout",
        "pretraining_tp",  # Llama 2's split matmuls: the same products (transformers 5 ignores it)
        "sliding_window",  # inert unless use_sliding_window / layer_types enable it (checked below)
        "max_window_layers",  # likewise
        "rope_theta",  # 4.x spelling, read through rope_parameters
        "rope_scaling",  # likewise
        "tokenizer_class",
        "is_llama_config",  # SmolLM2's config.json: a marker for other loaders
        "transformers.js_config",  # SmolLM2's config.json: settings of transformers.js
    }
)


def _inactive_checks(family: str) -> dict[str, tuple[Callable[[Any], bool], str]]:
    """HF attribute -> (is it inactive?, what it would do): math-changing attributes the conversion does not
    implement, allowed only at their inactive value."""
    checks: dict[str, tuple[Callable[[Any], bool], str]] = {
        "hidden_act": (lambda v: v == "silu", "only SwiGLU (silu) is supported"),
        "mlp_bias": (lambda v: not v, "bias on the MLP projections is not supported"),
        "use_sliding_window": (lambda v: not v, "sliding-window attention is not supported"),
        "rope_interleaved": (lambda v: not v, "interleaved RoPE is not supported (HF rotates halves)"),
        "use_mrope": (lambda v: not v, "multimodal RoPE is not supported"),
        "layer_types": (
            lambda v: v is None or all(t == "full_attention" for t in v),
            "layers other than full_attention (sliding windows) are not supported",
        ),
    }
    if FAMILY_SPECS[family].has_attention_bias:
        checks["attention_bias"] = (lambda v: not v, "bias on q/k/v and o_proj is not supported")
    return checks


def _hf_items(hf_config: Any) -> dict[str, Any]:
    to_dict = getattr(hf_config, "to_dict", None)
    return dict(to_dict() if callable(to_dict) else vars(hf_config))


def check_unmapped_hf_fields(hf_config: Any) -> None:
    """Refuse an HF config attribute that is neither mapped to a :class:`ModelArch` field, nor neutral
    (:data:`NEUTRAL_HF_FIELDS`, ``*_token_id``), nor at the inactive value of a math-changing attribute the
    conversion does not implement (module docstring).

    Raises:
        NotImplementedError: naming the attribute and its value.
    """
    name = type(hf_config).__name__
    family = hf_config.model_type
    mapped = {hf.split(".")[0] for hf in HF_FIELD_NAMES.values()} | {"model_type"}
    checks = _inactive_checks(family)
    for key, value in _hf_items(hf_config).items():
        if key in checks:
            inactive, why = checks[key]
            if not inactive(value):
                raise NotImplementedError(f"{name}: {key}={value!r}: {why}")
            continue
        if key == "attention_bias" and not FAMILY_SPECS[family].has_attention_bias:
            continue  # not an attribute of the family's config class: inert
        if key in mapped or key in NEUTRAL_HF_FIELDS or key.endswith("_token_id"):
            continue
        raise NotImplementedError(
            f"{name}: {key}={value!r} is not mapped to Megatron (it may change the model's math); "
            f"mapped: {', '.join(sorted(mapped))}"
        )


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
        NotImplementedError: a ``rope_type`` the Megatron conversion does not reproduce (module docstring),
            ``llama3`` with other frequency factors than megatron-core's, or another RoPE parameter (e.g.
            ``partial_rotary_factor``) that plain RoPE does not have.
    """
    params = {k: v for k, v in hf_rope_parameters(hf_config).items() if k != "rope_theta"}
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    name = type(hf_config).__name__
    if rope_type == "default":
        if params:
            raise NotImplementedError(
                f"{name}: rope_parameters.{next(iter(params))}={next(iter(params.values()))!r} is not supported "
                "with plain RoPE"
            )
        return None
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


# Fields not read as the plain HF attribute HF_FIELD_NAMES names: hf_config -> value.
_HF_READERS: dict[str, Callable[[Any], Any]] = {
    "num_query_groups": lambda c: getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
    "head_dim": lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
    "rope_theta": hf_rope_theta,
    "norm_epsilon": lambda c: float(c.rms_norm_eps),
    "qkv_bias": lambda c: FAMILY_SPECS[c.model_type].qkv_bias,
    "qk_layernorm": lambda c: FAMILY_SPECS[c.model_type].qk_layernorm,
    "tied_embeddings": lambda c: bool(getattr(c, "tie_word_embeddings", False)),
    "rope_scaling": hf_rope_scaling,
}


def arch_from_hf_config(hf_config: Any) -> ModelArch:
    """Read the architecture of a transformers ``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config``.

    Raises:
        NotImplementedError: a family other than :data:`FAMILIES`, or a variant the conversion does not cover,
            named: an unmapped or active math-changing attribute (:func:`check_unmapped_hf_fields`: non-SiLU
            activation, MLP bias, Llama/Qwen3 ``attention_bias`` (it also biases o_proj), sliding-window
            attention), or RoPE scaling other than llama3 (:func:`hf_rope_scaling`).
    """
    family = hf_config.model_type
    if family not in FAMILIES:
        raise NotImplementedError(f"model_type={family!r} is not supported (supported: {', '.join(FAMILIES)})")
    check_unmapped_hf_fields(hf_config)
    values = {
        f: _HF_READERS[f](hf_config) if f in _HF_READERS else getattr(hf_config, HF_FIELD_NAMES[f]) for f in ARCH_FIELDS
    }
    return ModelArch(**values)


def check_family_traits(arch: ModelArch) -> None:
    """Check that the fields a family fixes (:data:`FAMILY_SPECS`: ``qkv_bias``, ``qk_layernorm``) have its values.

    Raises:
        ValueError: naming the field, the family and the value it must have.
    """
    spec = FAMILY_SPECS[arch.family]
    for name in ("qkv_bias", "qk_layernorm"):
        if getattr(arch, name) != getattr(spec, name):
            raise ValueError(
                f"{name}={getattr(arch, name)} but every {arch.family} model has {name}={getattr(spec, name)}"
            )


def hf_config_from_arch(arch: ModelArch, **extra: Any):
    """A transformers config (``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config``) describing ``arch``; ``extra``
    adds token ids and the like. Used to build random-weight models of a preset's shape, and by ``jobs.plan``.

    Raises:
        ValueError: ``qkv_bias`` / ``qk_layernorm`` other than the family's (:func:`check_family_traits`).
    """
    import transformers  # 1-2 s: the job layer reads presets and checks configs without it

    check_family_traits(arch)
    spec = FAMILY_SPECS[arch.family]
    derived = {"family", "rope_theta", "rope_scaling", "qkv_bias", "qk_layernorm"}
    kwargs = {HF_FIELD_NAMES[f]: getattr(arch, f) for f in ARCH_FIELDS if f not in derived}
    kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": arch.rope_theta, **(arch.rope_scaling or {})}
    kwargs["hidden_act"] = "silu"
    if spec.has_attention_bias:
        kwargs["attention_bias"] = False
    if arch.family == "llama":
        kwargs["mlp_bias"] = False
    return getattr(transformers, spec.config_class)(**kwargs, **extra)
