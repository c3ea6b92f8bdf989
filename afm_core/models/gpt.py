"""The Megatron-core ``GPTModel`` of an HF Llama, Qwen2 or Qwen3 config: its ``TransformerConfig``, its layer spec,
and the model class whose output layer computes the loss or the logits of selected rows only.

GQA, q/k/v bias (Qwen2), QK-norm (Qwen3: an RMSNorm over each head's q and k before RoPE, megatron's
``qk_layernorm``), a ``head_dim`` independent of ``hidden_size / num_attention_heads`` (megatron's ``kv_channels``),
tied or untied embeddings, RMSNorm, SwiGLU and RoPE (base from the HF config). The config and the model are built
here, not by mbridge (its builders hard-code the transformer-engine layer spec and read ``hf_config.rope_theta``,
which transformers 5.x moved to ``rope_parameters``); the weights are read and written by
:mod:`afm_core.models.hf_weights`.

- on the local (non-TE) layer spec the RMSNorms are fused into ``linear_qkv`` / ``linear_fc1`` as on the TE spec
  (:mod:`afm_core.models.local_spec`), so both specs have the same parameter names and mbridge's mapping;
- on the local spec, :class:`~afm_core.models.attention.SDPAttention` as ``core_attention`` (fused SDPA, packed
  documents by ``cu_seqlens``), the lean norm/SwiGLU modules of :mod:`afm_core.models.local_spec`, and at TP=1
  the output layer and per-token loss fused, in chunks of rows (:class:`_GPTModel`).

TP ranks hold whole query groups, so TP must divide both the attention heads and the KV heads
(:func:`check_model_parallel_sizes`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.common.language_module import language_module
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.transformer import TransformerConfig

from afm_core.models.arch import ModelArch, arch_from_hf_config, mcore_config_fields, mcore_model_args
from afm_core.models.attention import SDPAttention
from afm_core.models.cross_entropy import linear_cross_entropy
from afm_core.models.local_spec import local_layer_spec

# The local spec's core attention (SDPAttention) reads packed_seq_params: packed micro batches need no dense mask.
LOCAL_ATTENTION_READS_CU_SEQLENS = True


def transformer_engine_available() -> bool:
    """Whether ``transformer_engine.pytorch`` is importable (then the TE layer spec is used)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401  (the probe itself: TE may be absent or broken)
    except (ImportError, OSError, RuntimeError):  # a broken TE install (e.g. no CUDA) behaves as absent
        return False
    return True


def check_model_parallel_sizes(arch: ModelArch, tp: int) -> None:
    """Check that tensor parallel size ``tp`` splits the model evenly.

    Raises:
        ValueError: ``tp`` does not divide the attention heads, KV heads (query groups), FFN size or vocab.
    """
    sizes = {
        "num_attention_heads": arch.num_attention_heads,
        "num_query_groups (KV heads)": arch.num_query_groups,
        "ffn_hidden_size": arch.ffn_hidden_size,
        "vocab_size": arch.vocab_size,
    }
    bad = [f"{name}={size}" for name, size in sizes.items() if size % tp]
    if bad:
        valid = [t for t in range(1, arch.num_query_groups + 1) if all(s % t == 0 for s in sizes.values())]
        raise ValueError(
            f"tensor parallel size tp={tp} does not divide {', '.join(bad)} of this {arch.family} model; "
            f"valid tp: {', '.join(map(str, valid))}"
        )


def platform_fusions() -> dict[str, Any]:
    """The ``TransformerConfig`` kernel-fusion fields, each on when this machine can run it.

    On CPU every fusion is off (they are CUDA kernels or ``torch.jit`` fusers megatron only enables on CUDA).
    With CUDA: bias+SwiGLU, bias+dropout+add and the masked-softmax fusion (megatron's own jit/CUDA kernels);
    fused cross entropy (transformer-engine's when its version has it, else megatron's ``native`` one); RoPE
    fusion with transformer-engine (its ``fused_apply_rotary_pos_emb``); weight-gradient accumulation into ``main_grad``
    when apex's ``fused_weight_gradient_mlp_cuda`` is importable (megatron's ``ColumnParallelLinear`` output layer
    raises without it); persistent layer norm never (apex-only, and the TE spec fuses its norms anyway).
    Which fusions exist: megatron-core ``transformer/transformer_config.py`` and Megatron-LM
    ``megatron/training/arguments.py`` (their defaults are on).
    """
    cuda = torch.cuda.is_available()
    te = cuda and transformer_engine_available()
    te_cross_entropy = False
    if te:  # defined only by TE versions that have it (megatron-core extensions/transformer_engine.py)
        te_cross_entropy = language_module.te_parallel_cross_entropy is not None
    return {
        "masked_softmax_fusion": cuda,
        "bias_activation_fusion": cuda,
        "bias_dropout_fusion": cuda,
        "apply_rope_fusion": te,
        "cross_entropy_loss_fusion": cuda,
        "cross_entropy_fusion_impl": "te" if te_cross_entropy else "native",
        "gradient_accumulation_fusion": cuda and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
        "persist_layer_norm": False,
    }


def mcore_config_from_hf(
    hf_config: Any, *, tp: int = 1, pp: int = 1, params_dtype: torch.dtype = torch.float32, **overrides: Any
) -> TransformerConfig:
    """The Megatron-core ``TransformerConfig`` of an HF Llama/Qwen2/Qwen3 config.

    Architecture from the HF config (:func:`~afm_core.models.arch.arch_from_hf_config`: layers, hidden, SwiGLU
    ffn, heads, query groups, ``head_dim`` as ``kv_channels``, RMSNorm epsilon (also of the QK-norm), q/k/v bias,
    ``qk_layernorm``, dropouts 0 as in HF). The kernel fusions the platform has are on
    (:func:`platform_fusions`: none on CPU), ``sequence_parallel=False``, and ``use_cpu_initialization`` when CUDA
    is absent. ``overrides`` set any other ``TransformerConfig`` field (``sequence_parallel``,
    ``virtual_pipeline_model_parallel_size``, ``recompute_granularity``, a fusion...).

    Args:
        hf_config: a transformers ``LlamaConfig``, ``Qwen2Config`` or ``Qwen3Config``.
        tp, pp: tensor / pipeline model parallel sizes.
        params_dtype: parameter dtype (``torch.float32`` or ``torch.bfloat16``; also the pipeline p2p dtype).

    Raises:
        ValueError: ``tp`` does not split heads, KV heads, FFN or vocab evenly; or
            ``perform_initialization=False`` with CPU initialization (megatron-core 0.16.1 then never sets the
            ``tensor_model_parallel`` / ``partition_dim`` attributes of TP weights, which silently breaks the
            TP merge on export and megatron's gradient clipping).
        NotImplementedError: an HF variant the conversion does not cover (see ``arch_from_hf_config``).
    """
    arch = arch_from_hf_config(hf_config)
    check_model_parallel_sizes(arch, tp)
    on_cpu = not torch.cuda.is_available()
    fields: dict[str, Any] = dict(
        **mcore_config_fields(arch),  # the architecture, by the ModelArch declaration (models/arch.py)
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=on_cpu,
        **platform_fusions(),
    )
    fields.update(overrides)
    if fields["use_cpu_initialization"] and not fields.get("perform_initialization", True):
        raise ValueError(
            "perform_initialization=False with use_cpu_initialization=True leaves TP weights without their "
            "tensor_model_parallel/partition_dim attributes in megatron-core 0.16.1; keep the initialization"
        )
    return TransformerConfig(**fields)


def build_gpt_model(
    hf_config: Any,
    transformer_config: TransformerConfig,
    *,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
) -> GPTModel:
    """A Megatron-core ``GPTModel`` (randomly initialised) shaped like ``hf_config``, for this PP/TP rank.

    Layer spec: :func:`gpt_layer_spec`. RoPE base and Llama 3.1 ``llama3`` RoPE scaling from the HF config
    (megatron-core's ``rope_scaling`` / ``rope_scaling_factor``); embeddings shared with the output layer
    when ``hf_config.tie_word_embeddings``. ``forward(input_ids [b, s], position_ids [b, s], attention_mask=None,
    packed_seq_params=None)`` returns logits [b, s, vocab/tp] (vocab-parallel), or per-token cross entropy
    [b, s] fp32 when ``labels`` is given. Packed documents: ``packed_seq_params`` in the ``thd`` format with
    ``b = 1`` (each document attends to itself only and its RoPE positions restart at 0; ``position_ids`` are
    ignored, as everywhere in Megatron's ``GPTModel``).

    Args:
        pre_process / post_process: this stage holds the embedding / the final norm and output layer
            (``parallel_state.is_pipeline_first_stage()`` / ``is_pipeline_last_stage()``).
        vp_stage: virtual pipeline stage index with interleaved PP.
    """
    arch = arch_from_hf_config(hf_config)
    return _GPTModel(
        config=transformer_config,
        transformer_layer_spec=gpt_layer_spec(qk_layernorm=arch.qk_layernorm),
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type="rope",
        vp_stage=vp_stage,
        **mcore_model_args(arch),  # vocabulary, positions, tied output layer, RoPE base and llama3 scaling
    )


def gpt_layer_spec(qk_layernorm: bool = False) -> Any:
    """The transformer layer spec of our GPT models (RMSNorm, SwiGLU; with ``qk_layernorm`` an RMSNorm over each
    head's q and k, Qwen3's ``q_norm`` / ``k_norm``).

    ``get_gpt_layer_with_transformer_engine_spec(qk_layernorm=...)`` when transformer-engine is importable (GPU:
    fused attention, ``thd`` packing; its QK-norm is transformer-engine's ``RMSNorm``, not run here: no GPU in CI);
    else megatron's local spec made lean in activation memory (:func:`afm_core.models.local_spec.local_layer_spec`)
    with :class:`~afm_core.models.attention.SDPAttention` as ``core_attention`` (both read ``packed_seq_params``).
    """
    if transformer_engine_available():
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    return local_layer_spec(SDPAttention, qk_layernorm=qk_layernorm)


@dataclass(frozen=True)
class OutputRows:
    """The positions of a micro batch whose output the model computes, found by the caller on the host.

    With them :class:`_GPTModel`'s output layer (the fused loss, or the row logits) reads no device value back to
    the host: the index comes from the data loader's CPU tensors, not from a ``nonzero`` of device tensors (a
    device sync) inside the model.

    Attributes:
        index: ``[n]`` int64 positions, ascending, in the micro batch's ``[b, s]`` positions read batch-first
            (``row * s + column``; in the ``thd`` format, the ``[1, b * s]`` positions), on the model's device.
        unit_grads: the loss is the plain sum of these positions' per-token losses (gradient exactly 1 on each:
            the SFT token loss with a 0/1 mask and no loss scale), which lets the fused loss skip its check of the
            upstream gradient (:func:`afm_core.models.cross_entropy.linear_cross_entropy`).
    """

    index: torch.Tensor
    unit_grads: bool = False

    @classmethod
    def of(cls, mask: torch.Tensor, device: torch.device | str, *, unit_grads: bool = False) -> OutputRows:
        """The positions where the CPU ``mask`` (``[b, s]``, any dtype) is nonzero, copied to ``device``
        without waiting."""
        index = mask.reshape(-1).nonzero().squeeze(1)
        return cls(index.to(device, non_blocking=True), unit_grads)


class _GPTModel(GPTModel):
    """Megatron's ``GPTModel`` whose per-token loss at TP=1 is one fused linear + cross entropy.

    ``labels`` below 0 (``-100``) mark positions without a loss: loss 0 and no gradient here; megatron's cross
    entropy (the other paths) computes them for label 0, which the loss mask then drops.
    With labels, Megatron computes the full ``[s, b, vocab]`` logits, then ``vocab_parallel_cross_entropy``
    (``megatron/core/tensor_parallel/cross_entropy.py``): several passes over them, softmax and logits stored for
    backward, and three all-reduces over the TP group, all work for nothing at TP=1. There the output layer and
    the loss are :func:`afm_core.models.cross_entropy.linear_cross_entropy` instead (chunks of rows, logits never stored).
    With TP > 1, megatron's fused cross entropy configured (GPU), multi-token prediction or inference, the
    parent's ``_postprocess`` runs unchanged.

    Without labels and with ``loss_mask`` ``[b, s]`` (``model(tokens, position_ids, None, loss_mask=rows)``),
    the output is the logits of the selected rows only, ``[1, n, vocab / tp]`` (:meth:`_row_logits`; the RL
    losses, :mod:`afm_core.rl.logprobs`); where that cannot apply (sequence parallelism, multi-token prediction,
    inference) it is the full ``[b, s, vocab / tp]`` as without ``loss_mask``.

    ``output_rows`` (:class:`OutputRows`, a keyword of ``forward``): the labelled positions (with ``labels``) or
    the selected ones (without; instead of ``loss_mask``), found on the host, so that the output layer reads
    nothing back from the device.

    ``grad_into_main_grad`` (set by the trainer when megatron's DDP reduces gradients only after the
    backward pass, never overlapped with it): the output weight's gradient is added straight into its DDP
    ``main_grad`` (megatron's gradient-accumulation fusion, done by the fused loss), instead of a separate
    ``[vocab, h]`` fp32 tensor that autograd holds until the tied input embedding's gradient joins it at the end of
    backward.
    """

    grad_into_main_grad = False
    _output_rows: OutputRows | None = None

    def forward(self, *args: Any, output_rows: OutputRows | None = None, **kwargs: Any) -> torch.Tensor:
        self._output_rows = output_rows  # read by _postprocess, at the end of this call
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._output_rows = None

    def _postprocess(
        self, hidden_states: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        output_rows = self._output_rows
        rows = kwargs.get("loss_mask") if output_rows is None else output_rows
        if labels is None and rows is not None and self._rows_only(kwargs):
            return self._row_logits(hidden_states, rows)
        if (
            labels is None
            or not self.post_process
            or kwargs.get("mtp_in_postprocess")
            or self.config.mtp_num_layers is not None
            or kwargs.get("inference_context") is not None
            or self.config.cross_entropy_loss_fusion
            or self.pg_collection.tp.size() > 1
        ):
            labels = None if labels is None else labels.clamp(min=0)  # megatron's cross entropy: ids in [0, V)
            return super()._postprocess(hidden_states=hidden_states, labels=labels, **kwargs)
        weight = (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights
            else self.output_layer.weight
        )
        sink = getattr(weight, "main_grad", None) if self.grad_into_main_grad else None
        s, b, h = hidden_states.shape
        loss = linear_cross_entropy(
            hidden_states.reshape(s * b, h),
            weight,
            labels.transpose(0, 1).reshape(s * b),
            grad_sink=sink,
            rows=None if output_rows is None else _sequence_major(output_rows.index, s, b),
            unit_grads=output_rows is not None and output_rows.unit_grads,
        )
        return loss.view(s, b).transpose(0, 1).contiguous()  # [b, s]

    def _rows_only(self, kwargs: dict[str, Any]) -> bool:
        """Whether the output layer may run on selected rows only: last stage, no multi-token prediction, no
        inference context, and the hidden states not split over the sequence (sequence parallelism)."""
        return bool(
            self.post_process
            and not kwargs.get("mtp_in_postprocess")
            and self.config.mtp_num_layers is None
            and kwargs.get("inference_context") is None
            and not self.config.sequence_parallel
        )

    def _row_logits(self, hidden_states: torch.Tensor, rows: torch.Tensor | OutputRows) -> torch.Tensor:
        """Logits of the rows where ``rows`` ``[b, s]`` is nonzero (or of the positions of an
        :class:`OutputRows`, without boolean indexing): ``[1, n, vocab / tp]``, in row-major ``[b, s]`` order
        (``logits[0, k]`` is the ``k``-th True of ``rows.bool()`` read batch-first).

        The RL losses need the logits of the model's own response tokens only (``response_mask``: ~25% of the
        positions of a padded rollout micro batch, less with long prompts and observations), so the output layer
        (``[*, h] x [h, vocab]``, the largest matmul of a small model) and the fp32 softmax passes over
        ``[*, vocab]`` are skipped for every other row. Exact: the output layer is row-wise.
        """
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if isinstance(rows, OutputRows):
            s, b, h = hidden_states.shape
            selected = hidden_states.reshape(s * b, h).index_select(0, _sequence_major(rows.index, s, b))
        else:
            selected = hidden_states.transpose(0, 1)[rows.to(torch.bool)]  # [n, h]
        logits, _ = self.output_layer(selected.unsqueeze(1), weight=weight)  # [n, 1, vocab / tp]
        return logits.transpose(0, 1).contiguous()


def _sequence_major(index: torch.Tensor, s: int, b: int) -> torch.Tensor:
    """Positions ``row * s + column`` of a ``[b, s]`` batch as rows of megatron's ``[s, b]`` layout flattened
    (``column * b + row``), in the same order."""
    return index if b == 1 else (index % s) * b + index // s
