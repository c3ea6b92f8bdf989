"""Packed documents on Megatron's GPTModel: SDPA core attention reading cu_seqlens (afm_core.models.attention),
RoPE restarting per document, per-document losses equal to each document alone, at TP=1 and TP=2 (gloo); a packed
training forward + backward that reads nothing back from the device; the CUDA kernels' pure parts (varlen_attn's
signature forms, FlexAttention's document mask)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks

DOC_LENGTHS = (37, 50, 20)  # three documents, then 21 padding tokens
SEQ = 128
PER_DOC_ATOL = 1e-5  # fp32 per-token loss, packed vs alone
HF_ATOL = 1e-4  # fp32 per-token loss, Megatron vs transformers


def _packed_sample(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (1, SEQ), generator=g)
    labels = torch.randint(0, vocab, (1, SEQ), generator=g)
    offsets = torch.tensor([0, *torch.tensor(DOC_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return {"tokens": tokens, "labels": labels, "cu_seqlens": offsets}


class _NoHostSync(TorchDispatchMode):
    """Fails on every op that reads a device value back to the host or whose output shape depends on the data:
    ``.item()`` / ``bool()`` / ``int()`` (``aten._local_scalar_dense``), ``nonzero``, ``masked_select`` and
    indexing with a boolean mask. (``Tensor.tolist`` of a CPU tensor reaches no op: patched apart.)"""

    SYNCING = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.masked_select.default)  # fmt: skip
    INDEXING = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        boolean = func in self.INDEXING and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        if func in self.SYNCING or boolean:
            raise AssertionError(f"{func} inside the model's forward/backward: a host sync on CUDA")
        return func(*args, **(kwargs or {}))


def _no_tolist(*_args, **_kwargs):
    raise AssertionError("Tensor.tolist() inside the model's forward/backward: a host sync on CUDA")


def _packed_training_step(model, sample, sync_free: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token losses and parameter gradients of one packed forward + backward of the SFT loss (a masked sum):
    the trainer's way (offsets and labelled rows found on the host) under :class:`_NoHostSync`, or the way before
    it (megatron's plain ``PackedSeqParams``: offsets and labelled rows read back from the model's tensors)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from afm_core.models.gpt import OutputRows
    from afm_core.train.trainer import thd_packed_seq_params

    params = thd_packed_seq_params([sample["cu_seqlens"]], SEQ, torch.device("cpu"))
    labels = sample["labels"].clone()
    labels[:, sample["cu_seqlens"][1:] - 1] = -100  # each document's last token and a prompt: not trained
    labels[:, 40:47] = -100
    model.zero_grad(set_to_none=True)
    positions = torch.zeros(1, SEQ, dtype=torch.long)
    if sync_free:
        rows = OutputRows.of(labels >= 0, "cpu", unit_grads=True)
        with _NoHostSync(), mock.patch.object(torch.Tensor, "tolist", _no_tolist):
            loss = model(sample["tokens"], positions, None, labels=labels, packed_seq_params=params, output_rows=rows)
            (loss * (labels >= 0)).sum().backward()
    else:
        plain = PackedSeqParams(**{f: getattr(params, f) for f in ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv",
                                                                   "max_seqlen_q", "max_seqlen_kv")})  # fmt: skip
        loss = model(sample["tokens"], positions, None, labels=labels, packed_seq_params=plain)
        (loss * (labels >= 0)).sum().backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _worker(rank: int, world: int, port: int, hf_dir: str, out: str) -> None:
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from transformers import AutoConfig

    from afm_core.engine.cpu_shims import apply_cpu_shims
    from afm_core.models.attention import SDPAttention
    from afm_core.models.gpt import build_gpt_model, mcore_config_from_hf
    from afm_core.models.hf_weights import load_hf_weights
    from afm_core.train.trainer import thd_packed_seq_params

    apply_cpu_shims()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        hf_config = AutoConfig.from_pretrained(hf_dir)
        config = mcore_config_from_hf(hf_config, tp=world, params_dtype=torch.float32)
        model = build_gpt_model(hf_config, config, pre_process=True, post_process=True)
        load_hf_weights([model], hf_dir)
        model.eval()
        queries: list[torch.Tensor] = []
        attention = next(m for m in model.modules() if isinstance(m, SDPAttention))
        attention.register_forward_pre_hook(lambda _, args: queries.append(args[0].detach().clone()))

        sample = _packed_sample(hf_config.vocab_size)
        offsets = sample["cu_seqlens"].tolist()
        with torch.no_grad():
            params = thd_packed_seq_params([sample["cu_seqlens"]], SEQ, torch.device("cpu"))
            positions = torch.zeros(1, SEQ, dtype=torch.long)  # ignored by GPTModel: RoPE must come from cu_seqlens
            packed = model(sample["tokens"], positions, None, labels=sample["labels"], packed_seq_params=params)[0]
            packed_query = queries.pop()  # [t, heads/tp, head_dim], after RoPE
            result = {"packed_vs_alone": [], "query_vs_alone": []}
            for a, e in itertools.pairwise(offsets):
                alone = model(
                    sample["tokens"][:, a:e], torch.arange(e - a)[None], None, labels=sample["labels"][:, a:e]
                )[0]
                alone_query = queries.pop()[:, 0]  # [s, b=1, heads/tp, head_dim] -> [s, heads/tp, head_dim]
                result["packed_vs_alone"].append((packed[a:e] - alone).abs().max().item())
                result["query_vs_alone"].append((packed_query[a:e] - alone_query).abs().max().item())
                result.setdefault("alone", []).append(alone.tolist())
        if world == 1:  # TP > 1: the output layer is megatron's vocab-parallel cross entropy (boolean masks)
            model.train()
            before = _packed_training_step(model, sample, sync_free=False)
            after = _packed_training_step(model, sample, sync_free=True)
            assert torch.equal(before[0], after[0])
            for name, grad in before[1].items():
                assert torch.equal(grad, after[1][name]), name
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_packed_documents_have_the_losses_they_have_alone(tmp_path, tp):
    # and in the worker at TP=1: a packed training forward + backward the trainer's way reads nothing back from
    # the device (no .item(), .tolist(), nonzero or boolean mask inside the model) and computes what it did before
    from transformers import AutoModelForCausalLM

    hf_dir = ensure_hf_checkpoint("tiny-llama")
    start_ranks(_worker, args=(tp, free_port(), str(hf_dir), str(tmp_path)), nprocs=tp)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    sample = _packed_sample(hf_model.config.vocab_size)
    offsets = sample["cu_seqlens"].tolist()
    for rank in range(tp):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert max(result["packed_vs_alone"]) <= PER_DOC_ATOL, result["packed_vs_alone"]
        # RoPE restarts per document: the rotated queries of a packed document are those it has alone
        assert max(result["query_vs_alone"]) <= 1e-6, result["query_vs_alone"]
        for (a, e), alone in zip(itertools.pairwise(offsets), result["alone"], strict=True):
            with torch.no_grad():
                logits = hf_model(sample["tokens"][:, a:e]).logits[0]
            reference = torch.nn.functional.cross_entropy(logits, sample["labels"][0, a:e], reduction="none")
            assert (torch.tensor(alone) - reference).abs().max().item() <= HF_ATOL


def _attention(heads: int, groups: int, head_dim: int):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from afm_core.models.attention import SDPAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    tp = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    return SDPAttention(config, 1, AttnMaskType.causal, "self", pg_collection=tp)


def _reference(q, k, v, mask):
    """Explicit softmax attention: q [s, np, hn], k/v [s, ng, hn], mask [s, s] True = masked out."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(q.shape[0], -1)


def test_sdp_attention_per_document_equals_explicit_block_causal_softmax():
    from afm_core.data.packing import block_causal_attention_mask
    from afm_core.train.trainer import thd_packed_seq_params

    torch.manual_seed(0)
    s, heads, groups, dim = 40, 6, 2, 16
    attention = _attention(heads, groups, dim)
    q, k, v = torch.randn(s, heads, dim), torch.randn(s, groups, dim), torch.randn(s, groups, dim)
    offsets = torch.tensor([0, 9, 25, 33], dtype=torch.int32)  # three documents, 7 padding tokens
    mask = block_causal_attention_mask(offsets, s)[0, 0]
    expected = _reference(q, k, v, mask)
    thd = attention(q, k, v, None, packed_seq_params=thd_packed_seq_params([offsets], s, torch.device("cpu")))
    # padding rows differ (causal among themselves in thd, each to itself in the mask) and are never trained
    torch.testing.assert_close(thd[:33], expected[:33], rtol=1e-5, atol=1e-6)
    # the sbhd path with the dense mask computes the same
    dense = attention(q[:, None], k[:, None], v[:, None], mask[None, None])
    torch.testing.assert_close(dense[:, 0], expected, rtol=1e-5, atol=1e-6)
    # a row masked everywhere (left padding) gives numbers, not NaN
    mask[:3] = True
    assert torch.isfinite(attention(q[:, None], k[:, None], v[:, None], mask[None, None])).all()


class _KernelLengths(TorchDispatchMode):
    """Records the sequence length of every CPU flash-attention call (forward and backward)."""

    KERNELS = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
               torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default)  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.lengths: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.KERNELS:
            self.lengths.append(args[1].shape[2])  # query [1, np, length, hn] (backward: after grad_out)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_document_attention_runs_at_bounded_lengths_and_a_document_computes_what_it_does_alone(dtype):
    """bf16 pads each document to ``cpu_kernel_length`` (ATen caches a kernel per length without bound there),
    exact for the document's rows: packed == alone bit for bit, forward and backward, and within bf16 rounding of
    the fp32 block-causal softmax; fp32 attends at the documents' own lengths."""
    from afm_core.data.packing import block_causal_attention_mask
    from afm_core.models.cpu_shapes import cpu_kernel_length
    from afm_core.train.trainer import thd_packed_seq_params

    torch.manual_seed(0)
    docs, heads, groups, dim = (9, 100, 70, 3), 6, 2, 16
    s = sum(docs)
    attention = _attention(heads, groups, dim)
    inputs = [torch.randn(s, n, dim).to(dtype) for n in (heads, groups, groups)]
    grad_out = torch.randn(s, heads * dim).to(dtype)
    offsets = torch.tensor([0, *itertools.accumulate(docs)], dtype=torch.int32)

    def run(rows: slice, cu: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        q, k, v = (x[rows].clone().requires_grad_() for x in inputs)
        out = attention(q, k, v, None, packed_seq_params=thd_packed_seq_params([cu], q.shape[0], torch.device("cpu")))
        out.backward(grad_out[rows])
        return out.detach(), [x.grad for x in (q, k, v)]

    with _KernelLengths() as seen:
        packed, packed_grads = run(slice(None), offsets)
    expected = [cpu_kernel_length(d, dtype) for d in docs]
    assert seen.lengths == expected * 2  # forward per document, then backward per document
    if dtype == torch.bfloat16:
        assert expected == [64, 128, 128, 64]
    else:
        assert expected == list(docs)
    for a, e in itertools.pairwise(offsets.tolist()):
        alone, alone_grads = run(slice(a, e), torch.tensor([0, e - a], dtype=torch.int32))
        assert torch.equal(packed[a:e], alone)
        for packed_grad, alone_grad in zip(packed_grads, alone_grads):
            assert torch.equal(packed_grad[a:e], alone_grad)
    reference = _reference(*(x.float() for x in inputs), block_causal_attention_mask(offsets, s)[0, 0])
    tolerance = {"rtol": 1.6e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(packed.float(), reference, **tolerance)


def test_thd_params_lay_micro_batch_rows_end_to_end():
    from afm_core.train.trainer import thd_packed_seq_params

    params = thd_packed_seq_params([torch.tensor([0, 3, 7]), torch.tensor([0, 10])], 10, torch.device("cpu"))
    assert params.cu_seqlens_q.tolist() == [0, 3, 7, 10, 20]
    assert params.max_seqlen_q == 10 and params.qkv_format == "thd"
    assert params.cu_seqlens_host == (0, 3, 7, 10, 20)  # the host copy: no layer reads the offsets back
    with pytest.raises(ValueError, match="row 1"):
        thd_packed_seq_params([torch.tensor([0, 3]), torch.tensor([0, 12])], 10, torch.device("cpu"))


def test_deterministic_mode_restricts_cuda_sdpa_to_deterministic_backends():
    from torch.nn.attention import SDPBackend

    from afm_core.models.attention import deterministic_sdpa_backends

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert deterministic_sdpa_backends() is None
        # warn_only: torch runs the cuDNN / flash / memory-efficient backwards nondeterministically, with a warning
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert deterministic_sdpa_backends() == [SDPBackend.MATH]
        torch.use_deterministic_algorithms(True)
        assert SDPBackend.CUDNN_ATTENTION not in deterministic_sdpa_backends()
        # the CPU path is untouched (and still runs) in deterministic mode
        test_sdp_attention_per_document_equals_explicit_block_causal_softmax()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_varlen_kwargs_follow_the_signature_of_each_torch_version():
    from afm_core.models.attention import varlen_causal_kwargs

    def torch_2_13(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                   enable_gqa=False, seqused_k=None, block_table=None, num_splits=None): ...  # fmt: skip

    def torch_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)): ...

    def torch_2_10(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None): ...

    default = 1 / 64**0.5
    assert varlen_causal_kwargs(torch_2_13, scale=0.1, head_dim=64, gqa=True) == {
        "window_size": (-1, 0), "scale": 0.1, "enable_gqa": True}  # fmt: skip
    assert varlen_causal_kwargs(torch_2_13, scale=0.1, head_dim=64, gqa=False) == {"window_size": (-1, 0), "scale": 0.1}
    assert varlen_causal_kwargs(torch_2_11, scale=0.1, head_dim=64, gqa=True) == {"window_size": (-1, 0), "scale": 0.1}
    assert varlen_causal_kwargs(torch_2_10, scale=default, head_dim=64, gqa=True) == {"is_causal": True}
    assert varlen_causal_kwargs(torch_2_10, scale=0.1, head_dim=64, gqa=True) is None  # no scale= in 2.10
    # the installed torch's varlen_attn, when it has one, is one of these forms
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return
    assert varlen_causal_kwargs(varlen_attn, scale=0.1, head_dim=64, gqa=True) is not None


def test_flex_document_mask_is_the_block_causal_mask():
    from afm_core.data.packing import block_causal_attention_mask
    from afm_core.models.attention import document_causal_mask_mod

    cu_seqlens = torch.tensor([0, 9, 25, 33, 40], dtype=torch.int32)  # the last "document": a row's padding
    mask_mod = document_causal_mask_mod(cu_seqlens, 40)
    q, k = torch.arange(40)[:, None], torch.arange(40)[None, :]
    attends = mask_mod(None, None, q, k)
    torch.testing.assert_close(attends, ~block_causal_attention_mask([0, 9, 25, 33, 40], 40)[0, 0], rtol=0, atol=0)
