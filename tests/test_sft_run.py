"""run_sft end to end: the composed conf/sft.yaml with the tiny random Llama preset on the real converted CoA
trajectories (../shared/data), a real gloo process group, HF export; then a new run resumed from it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from afm_core.utils.paths import repo_root, shared_data_dir
from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks

pytestmark = pytest.mark.skipif(
    not shared_data_dir().is_dir(), reason=f"real data folder {shared_data_dir()} is absent (set AFM_SHARED_DATA)"
)

ONE_STEP = ["trainer.max_steps=1", "trainer.eval_sequences=1", "trainer.progress=false"]  # the one-step tests
OVERRIDES = [
    "model=tiny-llama",
    "trainer.global_batch_size=2",
    "trainer.eval_interval=1",
    "trainer.eval_sequences=2",
    "trainer.progress=false",
    "trainer.num_threads=1",
]


def sft_worker(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    set_rank_env(rank, world, port)
    from hydra import compose, initialize_config_dir

    from afm_core.config import register_schemas
    from afm_core.config.sft import sft_config
    from afm_core.train.sft import run_sft

    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        cfg = compose(config_name="sft", overrides=overrides)
    summary = run_sft(sft_config(cfg))
    if rank == 0:
        Path(out).write_text(json.dumps(summary))


def run_sft_spawned(overrides: list[str], out: Path, world: int = 1) -> dict:
    start_ranks(sft_worker, args=(world, free_port(), overrides, str(out)), nprocs=world)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_run_sft_trains_exports_and_resumes_into_a_new_run(tmp_path, capfd):
    from transformers import AutoModelForCausalLM

    from afm_core.engine.checkpoint_dirs import complete_checkpoints
    from afm_core.engine.metrics import read_metrics
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint

    first_dir = tmp_path / "first"
    first = run_sft_spawned([*OVERRIDES, f"run_dir={first_dir}", "trainer.max_steps=2"], tmp_path / "first.json")
    assert "[sft] done at step 2/2 (megatron)" in capfd.readouterr().out
    assert first["step"] == 2 and not first["stopped_early"] and first["engine"] == "megatron"
    assert first["eval_loss_after"] < first["eval_loss_before"]
    assert first["input_tokens_per_s"] > first["tokens_per_s"] > 0  # all positions vs unmasked targets
    assert [(r["step"], r["split"]) for r in read_metrics(first_dir / "metrics.jsonl")] == [
        (0, "eval"),
        (1, "train"),
        (1, "eval"),
        (2, "train"),
        (2, "eval"),
    ]
    record = read_metrics(first_dir / "metrics.jsonl")[1]
    assert record["tokens"] > 0 and record["tokens_per_s"] > 0 and record["lr"] == 0.0  # warmup starts at 0
    assert record["tflops"] > 0 and record["mfu"] is None  # model TFLOP/s; no MFU without a datasheet peak (CPU)
    assert (first_dir / "loss.png").is_file()
    assert [s for s, _ in complete_checkpoints(first_dir / "checkpoints")] == [2]

    trained = AutoModelForCausalLM.from_pretrained(first["hf_dir"], dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(ensure_hf_checkpoint("tiny-llama"), dtype=torch.float32)
    assert trained.config.num_hidden_layers == 2
    changed = [name for name, p in trained.state_dict().items() if not torch.equal(p, initial.state_dict()[name])]
    assert "model.embed_tokens.weight" in changed and "model.layers.1.mlp.down_proj.weight" in changed

    second_dir = tmp_path / "second"
    second = run_sft_spawned(
        [*OVERRIDES, f"run_dir={second_dir}", "trainer.max_steps=3", f"resume={first_dir}", "trainer.export_hf=false"],
        tmp_path / "second.json",
    )
    assert "[sft] data: mapped the token cache in" in capfd.readouterr().out  # tokenized once, by the first run
    assert second["resumed_from"] == str(first_dir / "checkpoints" / "step_00000002")
    assert second["step"] == 3 and second["hf_dir"] is None
    assert second["eval_loss_before"] == first["eval_loss_before"]  # the history came along
    steps = [(r["step"], r["split"]) for r in read_metrics(second_dir / "metrics.jsonl")]
    assert steps == [(0, "eval"), (1, "train"), (1, "eval"), (2, "train"), (2, "eval"), (3, "train"), (3, "eval")]
    assert [s for s, _ in complete_checkpoints(second_dir / "checkpoints")] == [3]


def _fast_bf16() -> bool:
    from afm_core.utils.hardware import bf16_is_fast

    return bf16_is_fast(on_gpu=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision",
    [
        "fp32",
        pytest.param(
            "bf16",
            marks=pytest.mark.skipif(
                not _fast_bf16(),
                reason="bf16 matmuls are ~7x slower than fp32 on a CPU without native bf16 (measured here: 204 s "
                "for this step vs 37 s fp32); AFM_CPU_BF16=1 runs it",
            ),
        ),
    ],
)
def test_a_two_layer_qwen3_at_published_width_trains_one_sft_step(tmp_path, precision):
    """Qwen3-0.6B's width (hidden 1024, 16 heads x head_dim 128 = 2048-wide q, 8 KV heads, SwiGLU 3072, QK-norm,
    tied embeddings) with 2 layers and random weights (SmolLM2's tokenizer and vocabulary: Qwen3's tokenizer is not
    available offline) trains one step of the real SFT job on CPU, in fp32 and in bf16."""
    from afm_core.engine.metrics import read_metrics

    overrides = [
        "model=qwen3-0.6b",
        "model.name=qwen3-0.6b-width-2-layers",
        "model.source=random",
        "model.num_layers=2",
        "model.vocab_size=49152",
        f"run_dir={tmp_path / 'run'}",
        f"trainer.precision={precision}",
        "trainer.global_batch_size=1",
        "trainer.seq_length=512",  # bf16 matmuls are slow on CPUs without AVX512-BF16
        "trainer.export_hf=false",
        "trainer.num_threads=2",
        *ONE_STEP,
    ]
    summary = run_sft_spawned(overrides, tmp_path / "summary.json")
    assert summary["step"] == 1 and not summary["stopped_early"]
    (record,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["split"] == "train"]
    assert math.isfinite(record["loss"]) and record["loss"] > 0 and record["grad_norm"] > 0


@pytest.mark.slow
def test_tiny_qwen3_sft_step_at_tp2_updates_the_weights_as_at_tp1(tmp_path):
    """Qwen3's q/k norms are whole on every TP rank while each rank sees its own heads: their gradients must be
    summed over the TP group (megatron's ``finalize_model_grads``), else the TP ranks' copies drift apart and
    differ from TP=1. One AdamW step (no warmup: an update of ~lr per weight) gives the same exported weights at
    TP=1 and TP=2."""
    from safetensors.torch import load_file

    weights = {}
    for tp in (1, 2):
        run_dir = tmp_path / f"tp{tp}"
        overrides = [
            "model=tiny-qwen3",
            f"parallel.tp={tp}",
            f"run_dir={run_dir}",
            "trainer.precision=fp32",
            "trainer.global_batch_size=2",
            "trainer.num_threads=1",
            "optim.warmup_ratio=0.0",
            *ONE_STEP,
        ]
        summary = run_sft_spawned(overrides, tmp_path / f"tp{tp}.json", world=tp)
        weights[tp] = load_file(Path(summary["hf_dir"]) / "model.safetensors")
    assert sorted(weights[1]) == sorted(weights[2])
    gaps = {name: (weights[1][name] - weights[2][name]).abs().max().item() for name in weights[1]}
    assert max(gaps.values()) < 1e-5, sorted(gaps.items(), key=lambda kv: -kv[1])[:4]
    assert "model.layers.0.self_attn.q_norm.weight" in gaps


@pytest.mark.slow
def test_tiny_llama3_trains_one_sft_step_and_exports_its_llama3_rope_scaling(tmp_path):
    """Llama 3.x (``llama3`` RoPE scaling, rope_theta 5e5, GQA) through the real SFT job: one step changes the
    weights, and the exported HF checkpoint keeps the scaling (a Llama 3.1 checkpoint exported without it would
    compute other rotary frequencies in transformers and vLLM)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from afm_core.engine.metrics import read_metrics
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint

    overrides = [
        "model=tiny-llama3",
        f"run_dir={tmp_path / 'run'}",
        "trainer.precision=fp32",
        "trainer.global_batch_size=2",
        "trainer.num_threads=1",
        *ONE_STEP,
    ]
    summary = run_sft_spawned(overrides, tmp_path / "summary.json")
    assert summary["step"] == 1 and not summary["stopped_early"]
    (record,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["split"] == "train"]
    assert math.isfinite(record["loss"]) and record["grad_norm"] > 0
    exported = AutoConfig.from_pretrained(summary["hf_dir"])
    rope = exported.rope_parameters  # transformers 5: rope_theta and the scaling in one dict
    assert exported.model_type == "llama" and rope["rope_theta"] == 500000.0
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    start = load_file(ensure_hf_checkpoint("tiny-llama3") / "model.safetensors")
    trained = load_file(Path(summary["hf_dir"]) / "model.safetensors")
    assert trained.keys() == start.keys()
    assert not torch.equal(trained["model.layers.0.mlp.down_proj.weight"], start["model.layers.0.mlp.down_proj.weight"])
