"""Core attention for Megatron's local (non transformer-engine) layer spec: fused SDPA, packed documents by
``cu_seqlens``, no dense mask.

Megatron-core's local ``DotProductAttention`` (``megatron/core/transformer/dot_product_attention.py``) computes
``softmax(QK^T)`` explicitly: a ``[b, heads, s, s]`` fp32 score matrix per layer, stored for backward, with packed
documents confined by a dense ``[b, 1, s, s]`` mask; it rejects ``packed_seq_params``. :class:`SDPAttention` is a
drop-in ``core_attention`` for ``SelfAttentionSubmodules`` that calls
``torch.nn.functional.scaled_dot_product_attention`` instead (on CPU the fused flash kernel
``_scaled_dot_product_flash_attention_for_cpu``: O(s) memory, no stored scores, GQA without repeating K/V), and
that reads the ``thd`` ``PackedSeqParams`` exactly like transformer-engine's ``TEDotProductAttention``: one causal
attention per document ``[cu_seqlens[i], cu_seqlens[i+1])``. With ``thd`` params, Megatron's ``Attention`` also
restarts RoPE at every document (``rope_utils._apply_rotary_pos_emb_thd``), so a packed document computes what
it computes alone (Megatron's ``GPTModel`` otherwise builds RoPE from the sequence length and ignores
``position_ids``).

Shapes (Megatron's conventions): ``thd``: query ``[t, np, hn]``, key/value ``[t, ng, hn]`` (``t`` tokens of the
packed micro batch, ``np``/``ng`` attention heads / query groups of this TP rank, ``hn`` head dim), output
``[t, np * hn]``. Otherwise (``sbhd``): query ``[s, b, np, hn]``, key/value ``[s, b, ng, hn]``, output
``[s, b, np * hn]``; causal, or the boolean ``attention_mask [b, 1, s, s]`` (True = masked out) when one is given
(a query row masked everywhere attends everywhere, never NaN).

Kernels of the ``thd`` format, by device:

* CPU: one fused flash kernel call per document (:class:`_DocumentCausalAttention`).
* CUDA: one ``torch.nn.attention.varlen.varlen_attn`` call per layer for all documents (FlashAttention-2 inside
  torch, bf16/fp16; torch >= 2.10, its signature adapted by :func:`varlen_causal_kwargs`); where torch has no
  ``varlen_attn`` (or it cannot express the call), one compiled FlexAttention call with a document mask
  (:func:`document_causal_mask_mod`); per-document SDPA otherwise (fp32, attention dropout, or torch's
  deterministic mode). Per-document SDPA on CUDA builds a kernel plan per new document length (cuDNN attention),
  which made it the slowest part of a training step whose documents change every step. Inside a compiled layer
  (``trainer.compile_layers``) these kernels read the offsets on the device only, with the micro batch's ``t`` as
  the bound on the longest document, so that a new document layout does not recompile the layer.

The document offsets come on the host with :class:`PackedDocuments` (built once per micro batch by the trainer), so
no ``thd`` kernel reads them back from the device; megatron's plain ``PackedSeqParams`` still work (their offsets
copied to the host, a device sync on CUDA).

Under ``torch.use_deterministic_algorithms(True)`` on CUDA, SDPA runs only on backends whose backward torch makes
deterministic (:func:`deterministic_sdpa_backends`): with ``warn_only=True`` that is the math backend alone, since
torch then only warns about the cuDNN, flash and memory-efficient backwards ("... defaults to a non-deterministic
algorithm") and runs them as they are; ``varlen_attn`` and FlexAttention are not used then. The CPU path is
unchanged.

One module, past 400 lines: one ``core_attention`` (:class:`SDPAttention`) and the kernels it picks between for
packed documents, which all read the same host-side document layout (:class:`PackedDocuments`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch.nn.attention import SDPBackend, sdpa_kernel

from afm_core.models.cpu_shapes import cpu_kernel_length, zero_padded


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[d, n, hn]`` -> ``[1, n, d, hn]`` (a view)."""
    return x.permute(1, 0, 2).unsqueeze(0)


def deterministic_sdpa_backends() -> list[SDPBackend] | None:
    """The SDPA backends allowed on CUDA under torch's deterministic mode, or None (mode off: torch's choice).

    What torch does under ``torch.use_deterministic_algorithms(True, warn_only=...)``, from its source
    (``aten/src/ATen/native/transformers/cuda/attention_backward.cu`` and ``.../cuda/sdp_utils.cpp``):

    - ``warn_only=False``: the cuDNN backend is not selected at all (``check_cudnn_deterministic``), flash
      attention's backward runs its deterministic algorithm (``deterministic=true`` to ``mha_bwd``) and the
      memory-efficient backward forces ``num_splits_key = 1``: flash, memory-efficient and math are deterministic.
    - ``warn_only=True``: the cuDNN, flash and memory-efficient backwards each warn once ("cuDNN Attention / Flash
      Attention / Memory Efficient attention defaults to a non-deterministic algorithm. To explicitly enable
      determinism call torch.use_deterministic_algorithms(True, warn_only=False).") and run their default,
      nondeterministic algorithm; only the math backend (matmuls, softmax; GQA by ``repeat_interleave``, whose
      backward the deterministic mode makes deterministic) stays deterministic.

    Megatron's ``TransformerConfig.deterministic_mode`` does not cover this attention: it switches the vocab
    embedding to indexing (``VocabParallelEmbedding``) and requires ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` for
    transformer-engine's attention only.
    """
    if not torch.are_deterministic_algorithms_enabled():
        return None
    if torch.is_deterministic_algorithms_warn_only_enabled():
        return [SDPBackend.MATH]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class PackedDocuments(PackedSeqParams):
    """Megatron's ``thd`` ``PackedSeqParams`` of one micro batch with the document offsets on the host as well.

    Attributes (beyond megatron's): ``cu_seqlens_host``: the ``[d + 1]`` offsets of ``cu_seqlens_q`` (= ``_kv``) as
    Python ints, which the per-document kernels slice with and which validate the micro batch without reading the
    device tensor back (a host sync per layer on CUDA).
    """

    cu_seqlens_host: tuple[int, ...] = ()

    @classmethod
    def from_offsets(cls, offsets: Sequence[int], device: torch.device | str) -> PackedDocuments:
        """``thd`` params of documents ``[offsets[i], offsets[i+1])``: ``cu_seqlens`` int32 on ``device`` (copied
        without waiting), ``max_seqlen`` the longest document, in tokens.

        Raises:
            ValueError: ``offsets`` has fewer than two entries or decreases.
        """
        host = tuple(int(x) for x in offsets)
        if len(host) < 2 or any(e < a for a, e in itertools.pairwise(host)):
            raise ValueError(f"document offsets must rise, at least two of them, got {list(host)}")
        cu_seqlens = torch.tensor(host, dtype=torch.int32).to(device, non_blocking=True)
        # a compiled layer (trainer.compile_layers) takes the document count as dynamic from the first micro batch
        torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
        max_len = max(e - a for a, e in itertools.pairwise(host))
        return cls(
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=max_len,
            max_seqlen_kv=max_len,
            cu_seqlens_host=host,
        )


def _offsets(params: PackedSeqParams) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The document offsets of ``thd`` params, on their device and on the host (read back unless
    :class:`PackedDocuments` carries them: a device sync on CUDA)."""
    device = _device_offsets(params)
    host = getattr(params, "cu_seqlens_host", ()) if params.cu_seqlens_q_padded is None else ()
    return device, host or tuple(device.tolist())


def _device_offsets(params: PackedSeqParams) -> torch.Tensor:
    """The document offsets of ``thd`` params on their device (the padded ones where given)."""
    return params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q


def varlen_causal_kwargs(
    varlen_attn: Callable[..., Any], *, scale: float, head_dim: int, gqa: bool
) -> dict[str, Any] | None:
    """The keyword arguments of a causal ``varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs)`` call
    with softmax scale ``scale`` (and fewer K/V heads than query heads when ``gqa``), for the signature of the
    ``torch.nn.attention.varlen.varlen_attn`` given, or None when that signature cannot express the call.

    The forms, read from torch's ``torch/nn/attention/varlen.py``: 2.13: causal is ``window_size=(-1, 0)`` (a
    tuple: torch compares it to one), ``scale=``, GQA needs ``enable_gqa=True``; 2.11: ``window_size``, ``scale=``,
    GQA without a flag (FlashAttention-2 takes fewer K/V heads as they are); 2.10: ``is_causal=True``, no
    ``scale`` (the default ``1 / sqrt(head_dim)`` only).
    """
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, Any] = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        return None
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale != 1.0 / math.sqrt(head_dim):
        return None
    if gqa and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


def _varlen_attn() -> Callable[..., Any] | None:
    """torch's ``varlen_attn`` (torch >= 2.10), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # torch >= 2.10 only
    except ImportError:
        return None
    return varlen_attn


def document_causal_mask_mod(cu_seqlens: torch.Tensor, t: int) -> Callable[..., torch.Tensor]:
    """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` of causal attention inside each document
    ``[cu_seqlens[i], cu_seqlens[i+1])`` of ``t`` packed tokens (True = attend); the document of each token is
    found on the device (``searchsorted``), without reading ``cu_seqlens`` back. As attention-gym's document mask
    (``pytorch-labs/attention-gym``, ``attn_gym/masks/document_mask.py``) with the causal mask inside."""
    rows = torch.arange(t, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    document = torch.searchsorted(cu_seqlens, rows, right=True)

    def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (document[q_idx] == document[kv_idx]) & (kv_idx <= q_idx)

    return mask_mod


@functools.cache
def _compiled_flex_attention() -> Callable[..., Any] | None:
    """``torch.compile(flex_attention)`` (FlexAttention runs as one fused kernel only compiled), or None."""
    try:
        from torch.nn.attention.flex_attention import flex_attention  # loads torch's higher-order ops: where used
    except ImportError:
        return None
    return torch.compile(flex_attention)


# the last (cu_seqlens, block mask): every layer of a forward pass attends with the same documents
_BLOCK_MASK: list[tuple[torch.Tensor, tuple[int, int], Any]] = []


def _document_block_mask(cu_seqlens: torch.Tensor, t: int) -> Any:
    """FlexAttention's block mask of :func:`document_causal_mask_mod`, built once per micro batch."""
    from torch.nn.attention.flex_attention import create_block_mask  # as in _compiled_flex_attention

    key = (cu_seqlens._version, t)
    if _BLOCK_MASK and _BLOCK_MASK[0][0] is cu_seqlens and _BLOCK_MASK[0][1] == key:
        return _BLOCK_MASK[0][2]
    mask = create_block_mask(document_causal_mask_mod(cu_seqlens, t), None, None, t, t, device=cu_seqlens.device)
    _BLOCK_MASK[:] = [(cu_seqlens, key, mask)]
    return mask


def _padded(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x [d, n, hn]`` as ``[1, n, length, hn]`` (heads first), zero rows appended after the ``d`` tokens."""
    return _heads_first(zero_padded(x, length))


class _DocumentCausalAttention(torch.autograd.Function):
    """Causal attention of each document ``[offsets[i], offsets[i+1])`` of a packed micro batch on CPU, through the
    kernels ``F.scaled_dot_product_attention`` itself calls there (``aten::_scaled_dot_product_flash_attention_for_cpu``
    and its backward, GQA included). The documents' outputs are written into one ``[t, np, hn]`` tensor, which is
    both what backward reads and what ``linear_proj`` keeps: per-document SDPA calls would keep their outputs and
    ``linear_proj`` their concatenation, the same values twice.

    In bf16/fp16 each document is attended at :func:`cpu_kernel_length` with zero rows after its tokens. Causal
    attention makes that exact for the document's rows: none of them sees a later position, and in backward the
    appended rows carry a zero output gradient (and output), so they add nothing to the document's key and value
    gradients. A document computes the same values packed as alone (both padded alike), though not bit for bit
    what an unpadded call would (the kernel's blocks differ: last-bit differences in bf16)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: list[int], scale: float
    ) -> torch.Tensor:
        spans = [(a, e) for a, e in itertools.pairwise(offsets) if e > a]
        out = None if len(spans) == 1 else q.new_empty(q.shape)
        lses = []
        for a, e in spans:
            length = cpu_kernel_length(e - a, q.dtype)
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                *(_padded(x[a:e], length) for x in (q, k, v)), 0.0, True, scale=scale
            )
            lses.append(lse)  # [1, np, length] fp32: the appended rows' too, read by backward
            o = o.squeeze(0).permute(1, 0, 2)[: e - a]  # the kernel lays its output out like q: [length, np, hn]
            if out is None:
                out = o
            else:
                out[a:e] = o
        assert out is not None
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.spans, ctx.scale = spans, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, out, *lses = ctx.saved_tensors
        grads = [torch.empty_like(x) for x in (q, k, v)]
        for (a, e), lse in zip(ctx.spans, lses):
            length = lse.shape[-1]
            parts = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                *(_padded(x[a:e], length) for x in (grad_out, q, k, v, out)),
                lse,
                0.0,
                True,
                scale=ctx.scale,
            )
            for grad, part in zip(grads, parts):
                grad[a:e] = part.squeeze(0).permute(1, 0, 2)[: e - a]
        return grads[0], grads[1], grads[2], None, None


class SDPAttention(MegatronModule):
    """``core_attention`` of the local layer spec on ``F.scaled_dot_product_attention`` (see the module docstring).

    Constructor arguments are those Megatron's ``SelfAttention`` passes to any ``core_attention``.

    Raises:
        NotImplementedError: context parallelism, sliding-window attention or a non-vanilla softmax (those need
            transformer-engine), or an ``attention_bias`` at forward time.
        ValueError: ``packed_seq_params`` with a format other than ``thd``, or ``cu_seqlens`` that do not cover
            the ``t`` tokens of the micro batch.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("context parallelism needs transformer-engine attention (TE layer spec)")
        if config.window_size is not None:
            raise NotImplementedError("sliding-window attention needs transformer-engine attention (TE layer spec)")
        if config.softmax_type != "vanilla":
            raise NotImplementedError(f"softmax_type={config.softmax_type!r} needs transformer-engine attention")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.attn_mask_type = attn_mask_type
        self.num_heads = divide(config.num_attention_heads, tp)
        self.num_groups = divide(config.num_query_groups, tp)
        head_dim = divide(config.kv_channels * config.num_attention_heads, config.num_attention_heads)
        # Megatron's DotProductAttention: 1/sqrt(hn), divided by the layer number with query-key layer scaling.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        if config.apply_query_key_layer_scaling:
            self.softmax_scale /= max(1, layer_number)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        varlen = self._varlen = _varlen_attn()
        self._varlen_kwargs = (
            None
            if varlen is None
            else varlen_causal_kwargs(
                varlen, scale=self.softmax_scale, head_dim=head_dim, gqa=self.num_heads != self.num_groups
            )
        )

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``[b, np, sq, hn]`` attention of ``q`` over ``k``/``v`` ``[b, ng, sk, hn]``; causal when ``mask`` is None.

        On CUDA under torch's deterministic mode, restricted to :func:`deterministic_sdpa_backends` (the backward
        runs the kernel the forward picked, so restricting the forward is enough)."""
        dropout = self.dropout_p if self.training else 0.0
        kwargs = {
            "attn_mask": mask,
            "is_causal": mask is None,
            "dropout_p": dropout,
            "scale": self.softmax_scale,
            "enable_gqa": self.num_heads != self.num_groups,
        }
        with contextlib.ExitStack() as stack:
            if q.is_cuda and (backends := deterministic_sdpa_backends()):
                stack.enter_context(sdpa_kernel(backends))
            if dropout and not self.config.sequence_parallel:
                stack.enter_context(tensor_parallel.get_cuda_rng_tracker().fork())  # as Megatron's DotProductAttention
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by SDPAttention")
        if packed_seq_params is not None:
            return self._forward_thd(query, key, value, packed_seq_params)
        # [s, b, n, hn] -> [b, n, s, hn]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask = None
        if attention_mask is not None:
            # SDPA: True = attend. A row masked everywhere (e.g. left padding) attends everywhere instead of giving
            # NaN, as Megatron's -10000 fill (transformer/utils.py attention_mask_func) makes it near uniform.
            masked = attention_mask.to(torch.bool)
            mask = ~masked | masked.all(dim=-1, keepdim=True)
        out = self._sdpa(q, k, v, mask)  # [b, np, s, hn]
        s, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def thd_kernel(self, query: torch.Tensor) -> str:
        """Which kernel attends over the documents of a ``thd`` micro batch (module docstring): ``"cpu"``,
        ``"varlen"``, ``"flex"`` or ``"sdpa"`` (per document)."""
        dropout = bool(self.training and self.dropout_p)
        if query.device.type == "cpu":
            return "sdpa" if dropout else "cpu"
        if query.device.type != "cuda" or dropout or torch.are_deterministic_algorithms_enabled():
            return "sdpa"
        if self._varlen_kwargs is not None:
            return "varlen" if query.dtype in (torch.float16, torch.bfloat16) else "sdpa"
        return "flex" if _compiled_flex_attention() is not None else "sdpa"

    def _forward_thd(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: PackedSeqParams
    ) -> torch.Tensor:
        if params.qkv_format != "thd":
            raise ValueError(f"SDPAttention reads packed_seq_params in the 'thd' format, got {params.qkv_format!r}")
        t = query.shape[0]
        # value is a view into megatron's fused [t, ng * (np/ng + 2) * hn] QKV output: saved as it is for
        # backward, it would keep that whole buffer alive (query and key are RoPE outputs of their own)
        value = value.contiguous()
        kernel = self.thd_kernel(query)
        if kernel in ("varlen", "flex") and torch.compiler.is_compiling():
            # a compiled layer (trainer.compile_layers) reads no host offsets: their values would be guarded, a
            # recompilation for every new document layout (the micro batch was checked when it was packed)
            return self._forward_thd_device(query, key, value, _device_offsets(params), t, t, kernel)
        cu_seqlens, offsets = _offsets(params)
        if offsets[0] != 0 or offsets[-1] != t:
            raise ValueError(
                f"cu_seqlens must run from 0 to the {t} tokens of the micro batch, got {offsets[0]}..{offsets[-1]}"
            )
        if kernel == "cpu":
            out = _DocumentCausalAttention.apply(query, key, value, list(offsets), self.softmax_scale)
            return out.reshape(t, -1)
        if kernel in ("varlen", "flex"):
            longest = params.max_seqlen_q or max(e - a for a, e in itertools.pairwise(offsets))
            return self._forward_thd_device(query, key, value, cu_seqlens, longest, t, kernel)
        # [t, n, hn] -> [1, n, t, hn]; each document is a causal attention of its own
        q, k, v = (_heads_first(x) for x in (query, key, value))
        # the CPU kernel's output [1, np, d, hn] is laid out [1, d, np, hn]: as [d, np, hn] it needs no copy
        outs = [
            self._sdpa(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], None).squeeze(0).permute(1, 0, 2)
            for a, e in itertools.pairwise(offsets)
            if e > a
        ]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)  # [t, np, hn]
        return out.reshape(t, -1)

    def _forward_thd_device(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens: torch.Tensor,
        longest: int,
        t: int,
        kernel: str,
    ) -> torch.Tensor:
        """The ``varlen`` / ``flex`` kernels: all documents in one call, their offsets read on the device only.
        ``longest``: the longest document's length in tokens, or any bound on it (a compiled layer passes ``t``:
        FlashAttention sizes its grid by it, and the blocks past a document's end return at once)."""
        if kernel == "varlen":
            assert self._varlen is not None and self._varlen_kwargs is not None
            cu = cu_seqlens.to(torch.int32)
            out = self._varlen(query, key, value, cu, cu, longest, longest, **self._varlen_kwargs)  # [t, np, hn]
            return out.reshape(t, -1)
        q, k, v = (_heads_first(x) for x in (query, key, value))  # [1, n, t, hn]
        gqa = self.num_heads != self.num_groups
        if torch.compiler.is_compiling():  # traced into the compiled layer, its block mask built there
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # as above

            mask_mod = document_causal_mask_mod(cu_seqlens, t)
            block_mask = create_block_mask(mask_mod, None, None, t, t, device=cu_seqlens.device)
            out = flex_attention(q, k, v, block_mask=block_mask, scale=self.softmax_scale, enable_gqa=gqa)
        else:
            flex = _compiled_flex_attention()
            assert flex is not None
            block_mask = _document_block_mask(cu_seqlens, t)
            out = flex(q, k, v, block_mask=block_mask, scale=self.softmax_scale, enable_gqa=gqa)
        return out.squeeze(0).permute(1, 0, 2).reshape(t, -1)
