"""``trainer.compile_layers`` (:func:`afm_core.models.local_spec.compile_transformer_layers`): each megatron
``TransformerLayer`` compiled whole computes what the eager layers compute (loss and every gradient, fp32), without
a graph break, and packed micro batches with new document layouts run the graph compiled before them.

The CUDA path is what this serves: the attention calls ``varlen_attn`` with device-side offsets. FlashAttention does
not run on a CPU, so a stand-in takes its place here: a custom op with ``varlen_attn``'s arguments (offsets as a
device tensor, ``max_seqlen`` a bound on the longest document), computed per document as plain causal softmax
attention inside the op and its backward written out (an op runs below autograd), opaque to the compiler as the
real kernel is. The tiny-llama preset (GQA: 4 heads, 2 groups) on one gloo rank, with
the layers' activations stored or recomputed in backward (megatron's full recomputation, ``conf/sft.yaml``'s), and
at TP=2 (two ranks: the TP all-reduces of the fused linears traced into the graph)."""

from __future__ import annotations

import pytest
import torch

from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks

pytestmark = pytest.mark.slow  # each test has inductor compile C++ kernels for the layers: 19-47 s on two AVX2 cores

T = 64  # tokens of each packed micro batch
# the first three compile the layers: the first layout (static shapes), a second one (another longest document:
# RoPE's table length dynamic), one document of all T tokens (RoPE's positions are the rows': megatron's branch);
# the rest are new lengths and document counts, which must run those graphs
LAYOUTS = ([0, 20, 50, 64], [0, 30, 64], [0, 64], [0, 10, 24, 40, 64], [0, 7, 33, 64], [0, 5, 9, 31, 50, 64])


def _documents(q, k, v, cu_seqlens):
    """Per document: ``q [np, d, hn]`` and ``k``/``v`` with their groups repeated to ``np`` heads."""
    groups = q.shape[1] // k.shape[1]
    for a, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        yield a, e, q[a:e].transpose(0, 1), *(t[a:e].transpose(0, 1).repeat_interleave(groups, 0) for t in (k, v))


def _probabilities(q, k, scale):
    """Causal softmax of ``q k^T * scale``: ``[np, d, d]``."""
    scores = q @ k.transpose(1, 2) * scale
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


@torch.library.custom_op("afm_test::varlen_attn", mutates_args=())
def _varlen_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale: float
) -> torch.Tensor:
    out = torch.empty_like(q)
    for a, e, qd, kd, vd in _documents(q, k, v, cu):
        assert e - a <= longest, (e - a, longest)  # FlashAttention sizes its grid by it
        out[a:e] = (_probabilities(qd, kd, scale) @ vd).transpose(0, 1)
    return out


@_varlen_op.register_fake
def _(q, k, v, cu, longest, scale):
    return torch.empty_like(q)


@torch.library.custom_op("afm_test::varlen_attn_backward", mutates_args=())
def _varlen_backward_op(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    for a, e, qd, kd, vd in _documents(q, k, v, cu):
        p = _probabilities(qd, kd, scale)
        do = grad[a:e].transpose(0, 1)
        dp = do @ vd.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # softmax backward
        dq[a:e] = (ds @ kd * scale).transpose(0, 1)
        for out, part in ((dk, ds.transpose(1, 2) @ qd * scale), (dv, p.transpose(1, 2) @ do)):
            out[a:e] = part.unflatten(0, (-1, groups)).sum(1).transpose(0, 1)  # the repeated heads summed
    return dq, dk, dv


@_varlen_backward_op.register_fake
def _(grad, q, k, v, cu, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu, _, scale = inputs
    ctx.save_for_backward(q, k, v, cu)
    ctx.scale = scale


def _backward(ctx, grad):
    q, k, v, cu = ctx.saved_tensors
    return (*_varlen_backward_op(grad, q, k, v, cu, ctx.scale), None, None, None)


_varlen_op.register_autograd(_backward, setup_context=_setup_context)


def standin_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, scale, enable_gqa=False):
    """``torch.nn.attention.varlen.varlen_attn`` as torch 2.13 is called for causal attention (see the module
    docstring): ``[t, np, hn]`` out."""
    assert cu_q is cu_k and max_q == max_k and tuple(window_size) == (-1, 0) and enable_gqa
    return _varlen_op(q, k, v, cu_q, max_q, scale)


def _steps(model, layouts, vocab):
    """Forward + backward of one packed micro batch per layout: the losses and the gradients of every step."""
    from afm_core.models.attention import PackedDocuments

    results = []
    for offsets in layouts:
        tokens = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(len(offsets) * T + offsets[1]))
        params = PackedDocuments.from_offsets(offsets, "cpu")
        for p in model.parameters():
            p.grad = None
        loss = model(tokens, torch.zeros_like(tokens), None, labels=tokens, packed_seq_params=params)
        loss.sum().backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    return results


def _worker(rank: int, tp: int, port: int, recompute: bool) -> None:
    set_rank_env(rank, tp, port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=tp)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from torch._dynamo.utils import counters

    from afm_core.engine.cpu_shims import apply_cpu_shims
    from afm_core.models import attention
    from afm_core.models.arch import hf_config_from_arch
    from afm_core.models.gpt import build_gpt_model, mcore_config_from_hf
    from afm_core.models.local_spec import compile_transformer_layers
    from afm_core.models.presets import load_preset

    apply_cpu_shims()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    # the CUDA kernel choice, with the stand-in kernel
    attention._varlen_attn = lambda: standin_varlen_attn
    attention.SDPAttention.thd_kernel = lambda self, query: "varlen"
    try:
        arch = load_preset("tiny-llama").arch
        hf_config = hf_config_from_arch(arch)
        config = mcore_config_from_hf(hf_config, tp=tp, params_dtype=torch.float32)
        config.bias_dropout_fusion = True  # as on CUDA (gpt.platform_fusions): megatron's compiled bias-dropout-add
        if recompute:  # megatron's full activation recomputation: each layer's forward run again in backward
            config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 1
        model = build_gpt_model(hf_config, config, pre_process=True, post_process=True)
        eager = _steps(model, LAYOUTS, arch.vocab_size)
        assert compile_transformer_layers([model]) == arch.num_layers

        compiled = _steps(model, LAYOUTS[:3], arch.vocab_size)
        assert counters["graph_break"] == {}, dict(counters["graph_break"])
        graphs = counters["stats"]["unique_graphs"]
        # new lengths, and a document count not seen before (1): the graphs compiled for the first layouts
        compiled += _steps(model, LAYOUTS[3:], arch.vocab_size)
        assert counters["stats"]["unique_graphs"] == graphs, "a new document layout recompiled the layers"

        for step, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(compiled, eager)):
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5, msg=f"step {step}: loss")
            for name, want in want_grads.items():
                torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-5, msg=f"step {step}: {name}")
    finally:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    ("tp", "recompute"), [(1, False), (1, True), (2, False)], ids=["tp1", "tp1-recompute-full", "tp2"]
)
def test_compiled_layers_equal_eager_and_new_document_layouts_do_not_recompile(tp, recompute):
    start_ranks(_worker, args=(tp, free_port(), recompute), nprocs=tp)


def _trainer_worker(rank: int, port: int, run_dir: str) -> None:
    set_rank_env(rank, 1, port)
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch._dynamo.utils import counters

    from afm_core.engine.core import build_model_chunks
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.train.trainer import SFTTrainer
    from tests.test_train_engine import SyntheticBatches, loop_config, make_cfg, tiny_provider

    cfg = make_cfg()
    layout = init_distributed(cfg.parallel, seed=cfg.trainer.seed, num_threads=1)
    try:
        losses = {}
        weights = None
        for compiled in (False, True):
            cfg.trainer.compile_layers = compiled
            chunks = build_model_chunks(tiny_provider(layout), layout)
            if weights is None:
                weights = {k: v.clone() for k, v in chunks[0].state_dict().items() if v is not None}
            chunks[0].load_state_dict(weights, strict=False)
            data = SyntheticBatches(seed=1, dp_rank=0, mbs=cfg.trainer.micro_batch_size)
            if compiled:  # packed documents on CPU: refused, naming the field
                with pytest.raises(ValueError, match=r"trainer\.compile_layers=true needs CUDA"):
                    SFTTrainer(loop_config(cfg), layout, chunks, data, [], f"{run_dir}/refused", max_steps=2)
            # the documents by a block-causal mask (sbhd): one graph per layer whatever the layout
            trainer = SFTTrainer(
                loop_config(cfg), layout, chunks, data, [], f"{run_dir}/{compiled}", max_steps=2, thd_packing=False
            )
            losses[compiled] = [trainer.train_step()["loss"] for _ in range(2)]
            layers = [m for m in chunks[0].modules() if isinstance(m, TransformerLayer)]
            assert [m._compiled_call_impl is not None for m in layers] == [compiled] * len(layers)
        assert counters["stats"]["unique_graphs"] > 0 and counters["graph_break"] == {}
        # the fused linears' weight gradients go to main_grad through DDP's hook in the compiled layers (no sink)
        torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)
    finally:
        destroy_distributed()


def test_trainer_compile_layers_trains_as_eager_and_is_refused_for_packed_documents_on_cpu(tmp_path):
    start_ranks(_trainer_worker, args=(free_port(), str(tmp_path)), nprocs=1)
