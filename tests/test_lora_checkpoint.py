"""LoRA checkpoints of the megatron SFT engine (afm_core.engine.checkpoint): the tiny HF Llama (``tiny-llama``)
loaded from its HF checkpoint at TP=2 (real gloo ranks), adapters on every target, synthetic packed batches. The
checkpoint holds the adapters and their optimizer state only, with the base model's identity (and the TP=2
adapters written as a PEFT adapter give the Megatron model's logits on the HF base); a resume onto
another base model, another adapter rank, or without adapters is refused before anything is loaded, naming the
field; then the run resumed from it is the straight run, exactly. With pipeline stages (PP=2) and with full
recomputation the adapted model trains as at PP=1 without it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks
from tests.test_train_engine import SyntheticBatches, cfg_with, loop_config

pytestmark = pytest.mark.slow

LORA = {"rank": 4, "alpha": 16.0}
IDS = torch.tensor([[1, 17, 923, 5, 4000, 31, 2, 77, 13, 600, 9, 48000]])
CFG = {"parallel.tp": 2, "trainer.max_steps": 4, "trainer.save_interval": 2, "trainer.global_batch_size": 4,
       "trainer.eval_interval": 2}  # fmt: skip


def _trainer(cfg, layout, base: str, lora: dict | None, run_dir: str):
    from transformers import AutoConfig

    from afm_core.config.lora import LoRAConfig
    from afm_core.engine.core import build_model
    from afm_core.engine.distributed import activation_memory_overrides
    from afm_core.models.hf_weights import load_hf_weights
    from afm_core.models.lora import apply_lora
    from afm_core.train.trainer import SFTTrainer

    overrides = activation_memory_overrides(cfg.parallel)  # parallel.recompute, as run_sft builds the model
    chunks = build_model(AutoConfig.from_pretrained(base), layout, params_dtype=torch.float32, **overrides)
    load_hf_weights(chunks, base)
    if lora is not None:
        apply_lora(chunks, LoRAConfig(**lora))
    mbs = cfg.trainer.micro_batch_size
    heldout = SyntheticBatches(seed=2, dp_rank=layout.dp_rank, mbs=mbs)
    train = SyntheticBatches(seed=1, dp_rank=layout.dp_rank, mbs=mbs)
    return SFTTrainer(loop_config(cfg), layout, chunks, train, [heldout.make(0)], run_dir, cfg.trainer.max_steps)


def lora_worker(rank: int, world: int, port: int, spec: dict) -> None:
    """Resume with each of ``spec["refused"]``' (base, adapters) first, recording each error message; then train
    (resuming the run's latest checkpoint, if any) and dump this rank's adapters under ``out``."""
    set_rank_env(rank, world, port)
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.models.lora import adapter_named_parameters

    cfg = OmegaConf.create(spec["cfg"])
    layout = init_distributed(cfg.parallel, seed=cfg.trainer.seed, num_threads=1)
    out = Path(spec["out"])
    try:
        errors = []
        for base, lora in spec.get("refused", []):
            with pytest.raises(ValueError) as refused:
                _trainer(cfg, layout, base, lora, spec["run_dir"]).fit()
            errors.append(str(refused.value))
        (out / f"errors_rank{rank}.json").write_text(json.dumps(errors))
        trainer = _trainer(cfg, layout, spec["base"], LORA, spec["run_dir"])
        summary = trainer.fit()
        adapters = {n: p.detach().clone() for n, p in adapter_named_parameters(trainer.model)}
        torch.save(adapters, out / f"adapters_rank{rank}.pt")
        if rank == 0:
            (out / "summary.json").write_text(json.dumps(summary))
        if spec.get("peft_adapter"):  # the TP=2 adapters as a PEFT dir, and the logits it must reproduce
            _save_adapter_and_logits(trainer, spec["base"], out, rank)
    finally:
        destroy_distributed()


def _save_adapter_and_logits(trainer, base: str, out: Path, rank: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    from afm_core.models.lora_hf import save_peft_adapter

    save_peft_adapter(trainer.model, base, out / "adapter")  # TP all-gather of the adapter shards; rank 0 writes
    model = unwrap_model(trainer.model[0]).eval()
    with torch.no_grad():
        local = model(IDS, torch.arange(IDS.shape[1]).unsqueeze(0), None)  # [1, s, vocab / tp]
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    if rank == 0:
        torch.save(torch.cat(parts, dim=-1), out / "logits.pt")


def run(tmp_path: Path, name: str, base: Path, run_dir: Path, **spec) -> dict:
    out = tmp_path / name
    out.mkdir()
    spec = {"cfg": cfg_with(**CFG), "base": str(base), "run_dir": str(run_dir), "out": str(out), **spec}
    start_ranks(lora_worker, args=(2, free_port(), spec), nprocs=2)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"records": records, "out": out}


def test_lora_checkpoint_holds_adapters_resumes_exactly_and_refuses_another_base(tmp_path):
    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file, save_file

    from afm_core.engine.checkpoint import read_lora_record
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.models.hf_weights import base_identity

    base = ensure_hf_checkpoint("tiny-llama")
    straight = run(tmp_path, "straight", base, tmp_path / "straight_run", peft_adapter=True)
    with torch.no_grad():  # the TP=2 adapters, gathered and un-fused, loaded by peft onto the HF base
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        base_logits = hf(IDS).logits
        peft_logits = PeftModel.from_pretrained(hf, str(straight["out"] / "adapter")).eval()(IDS).logits
    megatron_logits = torch.load(straight["out"] / "logits.pt")
    assert float((peft_logits - megatron_logits).abs().max()) < 1e-4
    assert float((megatron_logits - base_logits).abs().max()) > 1e-2  # the trained adapters matter
    run_dir = tmp_path / "run"
    shutil.copytree(tmp_path / "straight_run", run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")  # as if killed after the step-2 checkpoint
    step2 = run_dir / "checkpoints" / "step_00000002"

    keys = list(dist_checkpointing.load_tensors_metadata(str(step2)))
    assert keys and all(".lora_A" in k or ".lora_B" in k for k in keys), [k for k in keys if "lora_" not in k][:4]
    assert any(k.startswith("optimizer.") for k in keys)  # the adapters' AdamW moments
    record = read_lora_record(step2)
    assert record["lora"] == {**LORA, "dropout": 0.0, "target_modules": ["linear_qkv", "linear_proj",
                              "linear_fc1", "linear_fc2"]}  # fmt: skip
    assert record["base"] == base_identity(base)

    other = tmp_path / "other_base"  # the same architecture, other weights (another fine-tune)
    shutil.copytree(base, other)
    weights = load_file(other / "model.safetensors")
    save_file({k: v * 1.01 for k, v in weights.items()}, other / "model.safetensors", metadata={"format": "pt"})
    refused = [(str(other), LORA), (str(base), {**LORA, "rank": 8}), (str(base), None)]
    resumed = run(tmp_path, "resumed", base, run_dir, refused=refused)
    for rank in (0, 1):
        errors = json.loads((resumed["out"] / f"errors_rank{rank}.json").read_text())
        assert errors[0].startswith(f"model: {step2} holds adapters trained on the base model {base}"), errors[0]
        assert f"this run's base {other} has weights_sha256" in errors[0]
        assert errors[1].startswith(f"model.lora.rank: {step2} holds adapters with rank=4, this run has 8"), errors[1]
        assert errors[2] == (f"{step2}: holds LoRA adapters only (model.lora.rank=4), but this run has no adapters; "
                             "resume it with model.lora.rank=4")  # fmt: skip

    assert json.loads((resumed["out"] / "summary.json").read_text())["resumed_from"] == str(step2)
    project = [{k: r.get(k) for k in ("step", "split", "loss", "lr", "grad_norm")} for r in straight["records"]]
    assert [{k: r.get(k) for k in ("step", "split", "loss", "lr", "grad_norm")} for r in resumed["records"]] == project
    for rank in (0, 1):
        a = torch.load(resumed["out"] / f"adapters_rank{rank}.pt")
        b = torch.load(straight["out"] / f"adapters_rank{rank}.pt")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert all(b[k].abs().max() > 0 for k in b)  # trained: no B left at zero


def layout_worker(rank: int, world: int, port: int, spec: dict) -> None:
    """Train LoRA on the tiny HF Llama in ``spec["cfg"]``'s layout (the run's metrics.jsonl holds its losses)."""
    set_rank_env(rank, world, port)
    from afm_core.engine.distributed import destroy_distributed, init_distributed

    cfg = OmegaConf.create(spec["cfg"])
    layout = init_distributed(cfg.parallel, seed=cfg.trainer.seed, num_threads=1)
    try:
        _trainer(cfg, layout, spec["base"], LORA, spec["run_dir"]).fit()
    finally:
        destroy_distributed()


def test_lora_trains_alike_with_pipeline_stages_and_with_full_recomputation(tmp_path):
    """The adapters of a PP=2 model (each stage adapts its own layers) and of a fully recomputed one (the adapted
    layer's forward runs again in backward) take the PP=1, stored-activations run's steps: train and held-out
    losses within 1e-4 (fp32), as ``tests/test_train_engine.py`` asks of the full model's layouts."""
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint

    base = str(ensure_hf_checkpoint("tiny-llama"))
    steps = {"trainer.max_steps": 3, "trainer.eval_interval": 3, "trainer.global_batch_size": 4}
    runs = {}
    for name, world, overrides in (("pp1", 1, {}), ("pp2", 2, {"parallel.pp": 2}),
                                   ("recompute-full", 1, {"parallel.recompute": "full"})):  # fmt: skip
        run_dir = tmp_path / name
        spec = {"cfg": cfg_with(**steps, **overrides), "base": base, "run_dir": str(run_dir)}
        start_ranks(layout_worker, args=(world, free_port(), spec), nprocs=world)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[name] = {split: [r["loss"] for r in records if r["split"] == split] for split in ("train", "eval")}
    assert len(runs["pp1"]["train"]) == 3 and runs["pp1"]["train"][-1] != runs["pp1"]["train"][0]
    for name in ("pp2", "recompute-full"):
        for split in ("train", "eval"):
            assert runs[name][split] == pytest.approx(runs["pp1"][split], abs=1e-4), (name, split, runs)
