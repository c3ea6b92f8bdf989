"""HF <-> Megatron-core conversion on CPU/gloo: logits parity with transformers, exact weight round trip,
exported checkpoints that transformers loads and generates with. TP/PP ranks are spawned processes; each
one imports torch + megatron-core + transformers (5-15 s on the shared 2-core machine), so the multi-rank
cases are marked slow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from afm_core.models.arch import arch_from_hf_config
from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks

LOGITS_ATOL = 1e-4  # fp32, max |Δ| against transformers


def _pipeline_forward(model, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Forward through the pipeline by hand (gloo send/recv): full logits [b, s, vocab] on the last stage."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, s = input_ids.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(s, b, model.config.hidden_size)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = model(input_ids, position_ids, None)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return gather_from_tensor_model_parallel_region(out)


def _worker(rank: int, world_size: int, tp: int, pp: int, port: int, hf_dir: str, work: str) -> None:
    set_rank_env(rank, world_size, port)
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from afm_core.engine.cpu_shims import apply_cpu_shims
    from afm_core.models.gpt import build_gpt_model, mcore_config_from_hf
    from afm_core.models.hf_weights import export_hf_weights, load_hf_weights, save_hf_checkpoint

    apply_cpu_shims()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        hf_config = AutoConfig.from_pretrained(hf_dir)
        config = mcore_config_from_hf(hf_config, tp=tp, pp=pp, params_dtype=torch.float32)
        model = build_gpt_model(
            hf_config, config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()
        )
        load_hf_weights([model], hf_dir)
        model.eval()
        result: dict = {}
        with torch.no_grad():
            logits = _pipeline_forward(model, torch.load(Path(work) / "input_ids.pt"))
        if logits is not None:
            reference = torch.load(Path(work) / "reference_logits.pt")
            result["max_abs_diff"] = (logits - reference).abs().max().item()

        exported = export_hf_weights([model])
        if rank == 0:
            original = {}
            for shard in Path(hf_dir).glob("*.safetensors"):
                original.update(load_file(shard))
            exported = dict(exported)
            result["names_equal"] = sorted(exported) == sorted(original)
            result["unequal"] = [k for k in original if k not in exported or not torch.equal(exported[k], original[k])]
        else:
            for _ in exported:
                pass
        save_hf_checkpoint([model], hf_config, hf_dir, Path(work) / "exported", max_shard_bytes=4 * 1024**2)
        (Path(work) / f"result-{rank}.json").write_text(json.dumps(result))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _check_round_trip(hf_dir: Path, tmp_path: Path, *, tp: int, pp: int = 1, input_ids: torch.Tensor) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        reference = hf_model(input_ids).logits
    torch.save(input_ids, tmp_path / "input_ids.pt")
    torch.save(reference, tmp_path / "reference_logits.pt")

    world_size = tp * pp
    start_ranks(_worker, args=(world_size, tp, pp, free_port(), str(hf_dir), str(tmp_path)), nprocs=world_size)

    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(world_size)]
    diffs = [r["max_abs_diff"] for r in results if "max_abs_diff" in r]
    assert len(diffs) == tp  # every TP rank of the last stage
    assert max(diffs) <= LOGITS_ATOL, diffs
    assert results[0]["names_equal"] and results[0]["unequal"] == []

    exported = tmp_path / "exported"
    reloaded = AutoModelForCausalLM.from_pretrained(exported).eval()
    assert arch_from_hf_config(reloaded.config) == arch_from_hf_config(hf_model.config)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, reference)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    out = reloaded.generate(**prompt, max_new_tokens=4, do_sample=False)
    expected = hf_model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, expected)


#: The shared size of the tiny random HF models below: 2 layers, hidden 64, SwiGLU 128.
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


def _seeded(config: Any) -> Any:
    """``config``, after ``torch.manual_seed(0)``: the model built from it next gets the same random weights."""
    torch.manual_seed(0)
    return config


def _save_tiny(path: Path, model: Any, bias_std: float | None = None, norm_std: float | None = None) -> Path:
    """Save a random HF ``model`` with SmolLM2's tokenizer (vocab 49152) to ``path``; biases drawn from
    N(0, ``bias_std``) and norm weights from N(1, ``norm_std``) when given, so that a swapped or dropped tensor
    shows in the logits."""
    from transformers import AutoTokenizer

    with torch.no_grad():
        for name, param in model.named_parameters():
            if bias_std is not None and name.endswith("bias"):
                param.normal_(0.0, bias_std)
            elif norm_std is not None and "norm" in name:
                param.normal_(1.0, norm_std)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(ensure_hf_checkpoint("tiny-llama")).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """A random Qwen2 with q/k/v bias, untied embeddings, GQA (4 heads, 2 KV heads); random biases and norm
    weights so that a swapped or dropped tensor shows in the logits. Tokenizer: SmolLM2's (vocab 49152)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **TINY,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return _save_tiny(
        tmp_path_factory.mktemp("tiny-qwen2"), Qwen2ForCausalLM(_seeded(config)), bias_std=0.5, norm_std=0.2
    )


def _random_ids(vocab: int, n: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_tiny_qwen2_round_trip(tiny_qwen2_dir, tmp_path, tp):
    _check_round_trip(tiny_qwen2_dir, tmp_path, tp=tp, input_ids=_random_ids(49152))
    index = json.loads((tmp_path / "exported" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded at 4 MiB


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """A random Qwen3 (transformers' ``Qwen3Config``): QK-norm, no q/k/v bias, ``head_dim`` 32 with hidden 64 and
    4 heads (q is 128 wide: not hidden / heads), GQA (2 KV heads), untied embeddings; random norm weights (the
    q/k norms too) so that a dropped or swapped norm shows in the logits. Tokenizer: SmolLM2's (vocab 49152)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **TINY,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=49152,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen3"), Qwen3ForCausalLM(_seeded(config)), norm_std=0.3)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_tiny_qwen3_round_trip(tiny_qwen3_dir, tmp_path, tp):
    """Qwen3: HF -> Megatron logits within 1e-4 (fp32), export bitwise (q_norm / k_norm included), at TP 1 and 2."""
    arch = arch_from_hf_config(__import__("transformers").AutoConfig.from_pretrained(tiny_qwen3_dir))
    assert arch.family == "qwen3" and arch.qk_layernorm and not arch.qkv_bias and arch.head_dim == 32
    _check_round_trip(tiny_qwen3_dir, tmp_path, tp=tp, input_ids=_random_ids(49152))


@pytest.mark.slow
def test_tiny_llama_tied_embeddings_across_pipeline_stages(tmp_path):
    """PP=2: the embedding lives on stage 0, the tied output layer on stage 1 (loaded from embed_tokens)."""
    _check_round_trip(ensure_hf_checkpoint("tiny-llama"), tmp_path, tp=1, pp=2, input_ids=_random_ids(49152))


def _smollm2_ids() -> torch.Tensor:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_hf_checkpoint("smollm2-135m"))
    ids = tokenizer(
        "Chain-of-Agents distills a multi-agent system into one model that plays every role, "
        "then trains it with agentic reinforcement learning.",
        return_tensors="pt",
    ).input_ids
    assert ids.shape[1] >= 16
    return ids[:, :16]


@pytest.mark.slow
def test_smollm2_round_trip_tp1(tmp_path):
    _check_round_trip(ensure_hf_checkpoint("smollm2-135m"), tmp_path, tp=1, input_ids=_smollm2_ids())


@pytest.mark.slow
def test_smollm2_round_trip_tp3(tmp_path):
    """SmolLM2 has 9 heads and 3 KV heads, so TP=2 cannot split it; TP=3 is its smallest TP > 1."""
    _check_round_trip(ensure_hf_checkpoint("smollm2-135m"), tmp_path, tp=3, input_ids=_smollm2_ids())


def test_tp_must_split_heads_and_kv_heads():
    from transformers import AutoConfig

    from afm_core.models.gpt import mcore_config_from_hf

    smol = AutoConfig.from_pretrained(ensure_hf_checkpoint("smollm2-135m"))
    with pytest.raises(
        ValueError, match=r"tp=2 does not divide num_attention_heads=9, num_query_groups \(KV heads\)=3.*valid tp: 1, 3"
    ):
        mcore_config_from_hf(smol, tp=2)
    with pytest.raises(ValueError, match="perform_initialization=False"):
        mcore_config_from_hf(smol, perform_initialization=False)
    config = mcore_config_from_hf(smol, tp=3, pp=2, params_dtype=torch.bfloat16)
    assert (config.num_layers, config.num_query_groups, config.kv_channels, config.add_qkv_bias) == (30, 3, 64, False)
    assert config.bf16 and config.pipeline_dtype == torch.bfloat16 and config.hidden_dropout == 0.0
    assert config.layernorm_epsilon == 1e-5 and not config.sequence_parallel and config.use_cpu_initialization


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _tiny_llama3(path: Path, rope: dict) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **TINY,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=49152,
        max_position_embeddings=131072,
        rope_parameters=rope,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.15,  # larger weights: the logits depend strongly on the rotary angles
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return _save_tiny(path, LlamaForCausalLM(_seeded(config)))


def test_llama31_rope_scaling_converts_and_matches_hf_logits(tmp_path):
    """Llama 3.1's ``llama3`` RoPE scaling (it was refused): Megatron's logits equal HF's over 512 positions, where
    the scaled frequencies change HF's own logits far beyond the tolerance."""
    from transformers import AutoModelForCausalLM

    scaled = _tiny_llama3(tmp_path / "llama3", LLAMA3_ROPE)
    plain = _tiny_llama3(tmp_path / "plain", {"rope_type": "default", "rope_theta": 500000.0})
    ids = torch.randint(0, 49152, (1, 512), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (
            AutoModelForCausalLM.from_pretrained(scaled)(ids).logits
            - AutoModelForCausalLM.from_pretrained(plain)(ids).logits
        )
    assert gap.abs().max().item() > 100 * LOGITS_ATOL  # the scaling is visible at these positions
    arch = arch_from_hf_config(AutoModelForCausalLM.from_pretrained(scaled).config)
    assert arch.rope_scaling == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    work = tmp_path / "work"
    work.mkdir()
    _check_round_trip(scaled, work, tp=1, input_ids=ids)


@pytest.fixture(scope="module")
def tiny_llama3_dir(tmp_path_factory) -> Path:
    """A random Llama 3.x (transformers' ``LlamaConfig``): ``llama3`` RoPE scaling, GQA (4 heads, 2 KV heads),
    ``head_dim`` 32 at hidden 64 (not hidden / heads), tied embeddings (as Llama 3.2 1B/3B), random norm weights,
    several eos ids and no pad token (Llama 3's ``generation_config``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **TINY,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=49152,
        max_position_embeddings=131072,
        rope_parameters=LLAMA3_ROPE,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=[2, 0],
        pad_token_id=None,
    )
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama3"), LlamaForCausalLM(_seeded(config)), norm_std=0.3)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_tiny_llama3_round_trip(tiny_llama3_dir, tmp_path, tp):
    """Llama 3.x: HF -> Megatron logits within 1e-4 (fp32), export bitwise, at TP 1 and 2."""
    arch = arch_from_hf_config(__import__("transformers").AutoConfig.from_pretrained(tiny_llama3_dir))
    assert arch.family == "llama" and arch.rope_scaling["rope_type"] == "llama3" and arch.head_dim == 32
    _check_round_trip(tiny_llama3_dir, tmp_path, tp=tp, input_ids=_random_ids(49152, 64))


def test_rope_scaling_megatron_cannot_reproduce_is_refused_naming_it():
    from types import SimpleNamespace

    from afm_core.models.arch import hf_rope_scaling

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    with pytest.raises(
        NotImplementedError,
        match=r"rope_type='yarn' is not supported \(megatron-core 0.16.1 drops YaRN's attention factor\)",
    ):
        hf_rope_scaling(SimpleNamespace(rope_parameters=yarn))
    other = {**LLAMA3_ROPE, "original_max_position_embeddings": 4096}
    with pytest.raises(NotImplementedError, match="original_max_position_embeddings=4096"):
        hf_rope_scaling(SimpleNamespace(rope_parameters=other))


def test_unmapped_math_changing_hf_fields_are_refused_by_name():
    """An HF attribute that would change the forward pass and is not mapped is refused naming it; an inactive one
    (a ``sliding_window`` size with sliding disabled) is not."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    arch = arch_from_hf_config(Qwen3Config(**small, head_dim=32, sliding_window=4096, use_sliding_window=False))
    assert arch.head_dim == 32 and arch.qk_layernorm and not arch.qkv_bias
    assert arch_from_hf_config(Qwen2Config(**small, sliding_window=4096)).qkv_bias
    smollm2_markers = dict(is_llama_config=True, rope_interleaved=False)  # SmolLM2's published config.json has them
    assert arch_from_hf_config(LlamaConfig(**small, **smollm2_markers)).family == "llama"
    refused = [
        (Qwen3Config(**small, use_sliding_window=True), "use_sliding_window=True"),
        (Qwen3Config(**small, attention_bias=True), "attention_bias=True"),
        (LlamaConfig(**small, mlp_bias=True), "mlp_bias=True"),
        (LlamaConfig(**small, hidden_act="gelu"), "hidden_act='gelu'"),
        (LlamaConfig(**small, rope_interleaved=True), "rope_interleaved=True: interleaved RoPE"),
        (Qwen3Config(**small, logit_scale=2.0), r"logit_scale=2.0 is not mapped to Megatron"),
        (
            Qwen3Config(**small, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
            "rope_type='yarn' is not supported",
        ),
        (
            Qwen3Config(
                **small, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}
            ),
            r"rope_parameters.partial_rotary_factor=0.5",
        ),
    ]
    for config, message in refused:
        with pytest.raises(NotImplementedError, match=message):
            arch_from_hf_config(config)
