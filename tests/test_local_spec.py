"""The lean local-spec modules (afm_core.models.local_spec) against plain torch autograd: same outputs and
gradients (also when the weights' gradients go into megatron's ``main_grad``), and only the tensors the
docstring names kept for backward (one gloo rank, TP=1); with the eager elementwise kernels (CPU's) and with the
``torch.compile``'d ones (CUDA's, compiled here for the CPU)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks

S, B, H, FFN = 12, 2, 32, 48


def _saved_bytes(fn, params: set[int]) -> list[int]:
    """Sizes (bytes) of the distinct non-parameter storages autograd keeps for ``fn()``'s backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sorted(seen.values()), out


def _worker(rank: int, port: int, compiled: bool) -> None:
    set_rank_env(rank, 1, port)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from afm_core.engine.cpu_shims import apply_cpu_shims
    from afm_core.models.local_spec import NormColumnParallelLinear, SwiGLUMLP, set_compiled_elementwise

    apply_cpu_shims()
    set_compiled_elementwise(compiled)
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    try:
        config = TransformerConfig(
            num_layers=1,
            hidden_size=H,
            ffn_hidden_size=FFN,
            num_attention_heads=4,
            normalization="RMSNorm",
            layernorm_epsilon=1e-5,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            use_cpu_initialization=True,
            bias_activation_fusion=False,
            gradient_accumulation_fusion=False,
        )
        g = torch.Generator().manual_seed(0)

        def rms(x, gamma):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma

        # RMSNorm + column-parallel linear with a bias (Qwen2's qkv)
        qkv = NormColumnParallelLinear(
            H, 40, config=config, init_method=config.init_method, bias=True, gather_output=False, skip_bias_add=False
        )
        with torch.no_grad():
            qkv.layer_norm_weight.copy_(torch.rand(H, generator=g) + 0.5)
            qkv.bias.copy_(torch.randn(40, generator=g))
        x = torch.randn(S, B, H, generator=g, requires_grad=True)
        params = {p.untyped_storage().data_ptr() for p in qkv.parameters()}
        saved, (out, bias) = _saved_bytes(lambda: qkv(x), params)
        assert bias is None
        assert saved == sorted([S * B * H * 4, S * B * 4]), saved  # x and 1/rms per token
        reference = F.linear(rms(x, qkv.layer_norm_weight), qkv.weight, qkv.bias)
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
        upstream = torch.randn(out.shape, generator=g)
        inputs = (x, qkv.layer_norm_weight, qkv.weight, qkv.bias)
        got = torch.autograd.grad(out, inputs, upstream)
        want = torch.autograd.grad(reference, inputs, upstream)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

        # the MLP: RMSNorm + fc1, SwiGLU fused into fc2
        spec = ModuleSpec(
            module=SwiGLUMLP,
            submodules=MLPSubmodules(linear_fc1=NormColumnParallelLinear, linear_fc2=RowParallelLinear),
        )
        mlp = build_module(spec, config=config, ffn_hidden_size=FFN)
        with torch.no_grad():
            mlp.linear_fc1.layer_norm_weight.copy_(torch.rand(H, generator=g) + 0.5)
        params = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
        saved, (out, bias) = _saved_bytes(lambda: mlp(x), params)
        assert bias is None
        assert saved == sorted([S * B * 4, S * B * H * 4, S * B * 2 * FFN * 4]), saved  # 1/rms, x, fc1 output
        gate, up = F.linear(rms(x, mlp.linear_fc1.layer_norm_weight), mlp.linear_fc1.weight).chunk(2, dim=-1)
        reference = F.linear(F.silu(gate) * up, mlp.linear_fc2.weight)
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
        inputs = (x, mlp.linear_fc1.layer_norm_weight, mlp.linear_fc1.weight, mlp.linear_fc2.weight)
        upstream = torch.randn(out.shape, generator=g)
        got = torch.autograd.grad(out, inputs, upstream)
        want = torch.autograd.grad(reference, inputs, upstream)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

        # grad_into_main_grad (the trainer's setting): the weights' gradients are added to what main_grad holds
        weights = (mlp.linear_fc1.weight, mlp.linear_fc2.weight)
        mlp.grad_into_main_grad = mlp.linear_fc1.grad_into_main_grad = True
        for weight in weights:
            weight.main_grad = torch.ones(weight.shape)
        x.grad = None
        mlp(x)[0].backward(upstream)
        torch.testing.assert_close(x.grad, want[0], rtol=1e-5, atol=1e-5)
        for weight, grad in zip(weights, want[2:]):
            assert weight.grad is None
            torch.testing.assert_close(weight.main_grad, grad + 1, rtol=1e-5, atol=1e-5)
    finally:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_norm_linear_and_swiglu_mlp_equal_plain_autograd_and_keep_only_their_inputs(compiled):
    start_ranks(_worker, args=(free_port(), compiled), nprocs=1)


@pytest.fixture
def compiled_elementwise(request):
    from afm_core.models.local_spec import set_compiled_elementwise

    set_compiled_elementwise(request.param)
    yield request.param
    set_compiled_elementwise(None)


@pytest.mark.parametrize("compiled_elementwise", [False, True], ids=["eager", "compiled"], indirect=True)
def test_lean_rope_equals_megatrons_and_keeps_one_cos_sin_for_all_layers(compiled_elementwise):
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    from afm_core.models.local_spec import lean_apply_rotary_pos_emb

    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    one_rank = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    g = torch.Generator().manual_seed(0)
    half = torch.rand(16, 1, 1, 4, generator=g) * 10
    freqs = torch.cat([half, half], dim=-1)  # [s, 1, 1, hn] as megatron's RotaryEmbedding makes them
    cu = torch.tensor([0, 5, 12, 16])
    cases = [
        ("bshd", torch.randn(16, 2, 3, 8, generator=g), freqs, None),
        ("thd, positions of all rows", torch.randn(16, 3, 8, generator=g), freqs, cu),
        ("thd, each document from 0", torch.randn(16, 3, 8, generator=g), freqs[:7], cu),
    ]
    for name, t, f, cu_seqlens in cases:
        kwargs = {"cu_seqlens": cu_seqlens, "cp_group": one_rank}
        x = t.clone().requires_grad_()
        want = apply_rotary_pos_emb(x, f, config, **kwargs)
        upstream = torch.randn(want.shape, generator=g)
        (want_grad,) = torch.autograd.grad(want, x, upstream)
        layers = functools.partial(
            lambda x, f, kwargs: [lean_apply_rotary_pos_emb(x, f, config, **kwargs) for _ in range(3)], x, f, kwargs
        )
        saved, got = _saved_bytes(layers, set())
        assert len(saved) == 2, (name, saved)  # cos and sin, shared by the three "layers"
        for out in got:
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6, msg=name)
            (grad,) = torch.autograd.grad(out, x, upstream)
            torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_rms_norm_is_qwen3s_qk_norm_bit_for_bit(dtype):
    """The local spec's QK-norm equals transformers' ``Qwen3RMSNorm`` (fp32 statistics, cast, then the gain) on
    ``[s, b, heads, head_dim]``, forward and backward, in fp32 and bf16."""
    from types import SimpleNamespace

    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from afm_core.models.local_spec import HeadRMSNorm

    torch.manual_seed(0)
    ours = HeadRMSNorm(SimpleNamespace(params_dtype=dtype), 32, eps=1e-6)
    theirs = Qwen3RMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.normal_(1.0, 0.3)
        theirs.weight.copy_(ours.weight)
    x = torch.randn(5, 2, 4, 32, dtype=dtype) * 3
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = ours(a), theirs(b)
    assert torch.equal(out, ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    assert torch.equal(a.grad, b.grad) and torch.equal(ours.weight.grad, theirs.weight.grad)
