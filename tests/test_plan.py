"""``jobs.plan``: the planned bytes against the tensors of real gloo worlds, the 32B recipes, the Slurm gate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from afm_core.config.lora import LoRAConfig
from afm_core.engine.memory import activations, model_state
from afm_core.launch.plan import JobConfig, checkpoint_plan, layout_of, make_plan, plan_config
from afm_core.launch.plan_estimates import lora_activation_bytes, lora_adapter_params
from afm_core.launch.plan_render import render
from afm_core.models.arch import hf_config_from_arch
from afm_core.models.presets import load_preset
from afm_core.utils.hardware import bf16_is_fast
from afm_core.utils.paths import repo_root
from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks

SEQ, MBS = 64, 2


def measure_worker(rank: int, world: int, port: int, spec: dict, out: dict) -> None:
    """Build the model of ``spec`` in a real gloo world, wrap it in the trainer, take one optimizer step (Adam's
    state exists after it) and measure this rank's tensors; then the saved-for-backward bytes of each decoder
    layer in one forward of a ``[MBS, SEQ]`` micro batch."""
    set_rank_env(rank, world, port)
    from afm_core.config import check_config
    from afm_core.config.sft import LoopConfig
    from afm_core.engine.core import build_model_chunks
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.models.gpt import build_gpt_model, mcore_config_from_hf
    from afm_core.train.trainer import SFTTrainer

    conf = repo_root() / "conf"
    cfg = OmegaConf.create(
        {
            "trainer": OmegaConf.load(conf / "sft.yaml").trainer,
            "optim": OmegaConf.load(conf / "sft.yaml").optim,
            "parallel": {**OmegaConf.to_container(OmegaConf.load(conf / "parallel" / "default.yaml")), **spec["p"]},
        }
    )
    cfg.trainer.update(seq_length=SEQ, micro_batch_size=MBS, global_batch_size=MBS * spec["dp"], num_threads=1)
    layout = init_distributed(cfg.parallel, seed=1, num_threads=1)
    try:
        hf_config = hf_config_from_arch(load_preset(spec["model"]).arch)
        dtype = torch.bfloat16 if spec["bf16"] else torch.float32
        config = mcore_config_from_hf(hf_config, tp=layout.tp, pp=layout.pp, params_dtype=dtype)
        chunks = build_model_chunks(
            lambda **kw: build_gpt_model(hf_config, config, **kw),
            layout,  # pre/post_process, vp_stage
        )
        if spec["lora"]:  # adapters on, base frozen, before the trainer wraps the chunks (as the SFT job does)
            from afm_core.config.lora import LoRAConfig
            from afm_core.models.lora import apply_lora

            out[(rank, "adapters")] = apply_lora(chunks, LoRAConfig(rank=spec["lora"]))
        loop = check_config(cfg, LoopConfig)
        trainer = SFTTrainer(loop, layout, chunks, None, [], spec["run_dir"], max_steps=1)  # type: ignore[arg-type]
        for chunk in trainer.model:
            chunk.zero_grad_buffer()
        trainer.optimizer.step()
        unique = {id(p): p for c in trainer.model for p in c.parameters()}.values()
        param_bytes = sum(p.numel() * p.element_size() for p in unique)
        params = {p.untyped_storage().data_ptr() for p in unique}
        grads = sum(b.grad_data.numel() * b.grad_data.element_size() for c in trainer.model for b in c.buffers)
        optimizer = 0
        for inner in [getattr(o, "optimizer", o) for o in getattr(trainer.optimizer, "chained_optimizers", [])]:
            for state in inner.state.values():  # exp_avg and exp_avg_sq (the scalar step counters are not counted)
                optimizer += sum(t.numel() * t.element_size() for k, t in state.items() if k != "step")
        for wrapped in getattr(trainer.optimizer, "chained_optimizers", []):
            for group in getattr(wrapped, "fp32_from_float16_groups", []):  # bf16: the fp32 master weights
                optimizer += sum(p.numel() * p.element_size() for p in group)

        layer_bytes = measure_layer_activations(chunks[0], hf_config.vocab_size, params)
        out[(rank, "pp")] = layout.pp_rank
        out[(rank, "bytes")] = (param_bytes, grads, optimizer)
        out[(rank, "layer")] = layer_bytes
    finally:
        destroy_distributed()


def measure_layer_activations(model: torch.nn.Module, vocab: int, params: set[int]) -> float | None:
    """Mean bytes a decoder layer saves for backward in one forward (parameters excluded; storages counted once);
    None on a stage that does not start with the embedding (it would need the previous stage's output)."""
    if not model.pre_process:
        return None
    from megatron.core.transformer.transformer_layer import TransformerLayer

    inside: list[int] = []
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if inside and ptr not in params and t.is_floating_point():
            storages[ptr] = max(storages.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]

    def enter(*_: object) -> None:
        inside.append(1)

    def leave(*_: object) -> None:
        inside.pop()

    handles = [m.register_forward_pre_hook(enter) for m in layers]
    handles += [m.register_forward_hook(leave) for m in layers]
    tokens = torch.randint(0, vocab, (MBS, SEQ))
    positions = torch.arange(SEQ).expand(MBS, SEQ)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, positions, None)
    for handle in handles:
        handle.remove()
    return sum(storages.values()) / len(layers)


LAYOUTS = {
    # name: model, parallel, world, bf16, LoRA rank (0: full)
    "tiny-llama tp2": ("tiny-llama", {"tp": 2}, 2, False, 0),
    "tiny-llama pp2": ("tiny-llama", {"pp": 2}, 2, False, 0),
    "tiny-llama dp2 bf16": ("tiny-llama", {}, 2, True, 0),
    "smollm2 pp2 bf16": ("smollm2-135m", {"pp": 2}, 2, True, 0),
    "tiny-qwen3 tp2": ("tiny-qwen3", {"tp": 2}, 2, False, 0),  # q wider than hidden, QK-norm
    # adapters on a frozen base: no base grads or optimizer state; the adapters' saved tensors
    "tiny-llama tp2 lora16 bf16": ("tiny-llama", {"tp": 2}, 2, True, 16),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_planned_parameter_gradient_and_optimizer_bytes_equal_the_measured_tensors(tmp_path, name):
    model, parallel, world, bf16, rank_r = LAYOUTS[name]
    tp, pp = parallel.get("tp", 1), parallel.get("pp", 1)
    spec = {"model": model, "p": parallel, "dp": world // (tp * pp), "bf16": bf16, "run_dir": str(tmp_path),
            "lora": rank_r}  # fmt: skip
    arch = load_preset(model).arch
    lora = LoRAConfig(rank=rank_r) if rank_r else None
    planned = model_state(
        hf_config_from_arch(arch),
        world_size=world,
        tp=tp,
        pp=pp,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        distributed_optimizer=False,
        on_gpu=False,
        lora=lora,
    )
    out = mp.Manager().dict()
    start_ranks(measure_worker, args=(world, free_port(), spec, out), nprocs=world)
    element_size = 2 if bf16 else 4
    adapter_bytes = (
        lora_activation_bytes(arch, rank_r, lora.target_modules, element_size=element_size, tp=tp) if lora else 0
    )
    for rank in range(world):
        stage = planned[out[(rank, "pp")]]
        assert out[(rank, "bytes")] == (stage.param_bytes, stage.grad_bytes, stage.optimizer_bytes), name
        if lora:  # the real module's count = the meta build's = the arithmetic from the architecture
            assert (
                out[(rank, "adapters")]
                == stage.adapter_params
                == lora_adapter_params(arch, rank_r, lora.target_modules, tp=tp, layers=stage.layers)
            )
        measured = out[(rank, "layer")]
        if measured is None:
            continue
        acts = activations(
            arch, stage, pp=pp, vpp=None, tp=tp, cp=1, seq_length=SEQ, micro_batch_size=MBS, num_microbatches=1,
            sequence_parallel=False, recompute=None, element_size=element_size, on_gpu=False,
            adapter_bytes_per_token=adapter_bytes,
        )  # fmt: skip
        assert abs(acts.per_layer_micro_batch / measured - 1) <= 0.2, (name, acts.per_layer_micro_batch, measured)


def job(app: str, *overrides: str) -> JobConfig:
    return plan_config(app, overrides)


def test_qwen25_32b_totals_32_76b_parameters_and_its_sft_recipe_fits_80gb_gpus():
    plan = make_plan(job("sft", "recipe=afm_web_sft_32b"))
    assert abs(plan["total_params"] / 32.76e9 - 1) < 0.005, plan["total_params"]
    stage_params = sum(row["params"] for row in plan["stages"]) * plan["layout"]["tp"]
    assert abs(stage_params / plan["total_params"] - 1) < 1e-3  # the meta-built shards add up to the HF tensors
    assert plan["fits"] is True and plan["gpus"]["80"]["fits"], render(plan)


def test_qwen3_32b_totals_32_76b_parameters_its_sft_recipe_fits_80gb_gpus_and_every_hf_tensor_is_synced():
    """Qwen3-32B (head_dim 128 with 64 heads: q is 8192 wide at hidden 5120; q/k norms): the published 32.8B."""
    from transformers import AutoModelForCausalLM

    plan = make_plan(job("sft", "recipe=afm_web_sft_qwen3_32b"))
    assert abs(plan["total_params"] / 32.76e9 - 1) < 0.005, plan["total_params"]
    stage_params = sum(row["params"] for row in plan["stages"]) * plan["layout"]["tp"]
    assert abs(stage_params / plan["total_params"] - 1) < 1e-3  # the meta-built shards (q/k norms too) add up
    assert plan["fits"] is True and plan["gpus"]["80"]["fits"], render(plan)
    rl = make_plan(job("rl", "recipe=afm_code_rl_qwen3_32b"))
    planned = {row["name"]: tuple(row["shape"]) for row in rl["weight_sync"]}
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config_from_arch(load_preset("qwen3-32b").arch))
    assert planned == {name: tuple(t.shape) for name, t in hf.state_dict().items()}
    assert planned["model.layers.0.self_attn.q_proj.weight"] == (8192, 5120)
    assert planned["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert rl["fits"] is True, render(rl)


def test_the_weight_sync_plan_names_every_hf_tensor_of_qwen25_32b_once_with_its_shape():
    from transformers import AutoModelForCausalLM

    plan = make_plan(job("rl", "recipe=afm_code_rl_32b"))
    planned = {row["name"]: tuple(row["shape"]) for row in plan["weight_sync"]}
    assert len(planned) == len(plan["weight_sync"])
    with torch.device("meta"):  # the HF model itself, no memory
        hf = AutoModelForCausalLM.from_config(hf_config_from_arch(load_preset("qwen2.5-coder-32b-instruct").arch))
    assert planned == {name: tuple(t.shape) for name, t in hf.state_dict().items()}
    assert {row["pp_rank"] for row in plan["weight_sync"]} == {0}  # pp=1: one stage sends everything
    engine = plan["vllm"]  # the colocated engine at the recipe's context: 4,096 + 28,672 tokens
    assert engine["max_model_len"] == 32768 <= hf.config.max_position_embeddings
    assert (
        engine["per_gpu"]["80"]["sequences_at_max_model_len"] >= 1 and "generation" in plan["gpus"]["80"]["phases_gib"]
    )
    # the RL job applies the recipe's full recompute (B2): 160.6 GiB "does not fit" planned without it, 70.4 with it
    assert plan["layout"]["recompute"] == "full" and plan["fits"] is True, render(plan)
    # a 32B RL checkpoint with AdamW state, ~460 GB: 57 s at 1 GB/s per node on 8 nodes, within USR2@120
    cfg = job("rl", "recipe=afm_code_rl_32b", "cluster.checkpoint_write_gb_s=1.0")
    ckpt = checkpoint_plan(cfg.cluster, cfg.run_dir, layout_of(cfg), plan["total_params"])
    assert abs(ckpt["gb"] - 458.7) < 1 and 50 < ckpt["write_s"] < 120 and ckpt["lead_warning"] is None
    assert ckpt["write_speed_source"] == "configured"
    # host memory per node: the 8 GPUs' trainer state while vLLM generates, vLLM's weights while the trainer runs
    state = max(row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"] for row in plan["stages"])
    assert plan["host"]["per_node_bytes"] == {"generation": 8 * state, "training": 8 * plan["vllm"]["weights_bytes"]}
    small = make_plan(job("rl", "recipe=afm_code_rl_32b", "cluster.mem=64G"))
    assert any("> cluster.mem=64G" in note for note in small["notes"]), small["notes"]
    # unset (the default), the speed is measured: a probe write into the run dir's file system
    assert plan["checkpoint"]["write_speed_source"].startswith("measured: 256 MiB written and fsynced to ")
    assert plan["checkpoint"]["write_s"] == pytest.approx(
        plan["checkpoint"]["bytes"] / (plan["checkpoint"]["write_gb_s_per_node"] * 1e9 * 8)
    )
    cfg = job("rl", "recipe=afm_code_rl_32b", "cluster.signal_delay_s=60", "cluster.checkpoint_write_gb_s=0.5")
    slow = checkpoint_plan(cfg.cluster, cfg.run_dir, layout_of(cfg), plan["total_params"])
    assert "set cluster.signal_delay_s >= 232" in slow["lead_warning"], slow  # 115 s to write x 1.5 + 60


def test_a_resubmitted_run_sizes_the_usr2_lead_by_its_own_last_checkpoint_write(tmp_path):
    from afm_core.engine.checkpoint_dirs import publish_checkpoint, staging_dir

    run_dir = tmp_path / "run"
    staging = staging_dir(run_dir / "checkpoints", 40)
    staging.mkdir(parents=True)
    (staging / "shard.distcp").write_bytes(b"x" * 3_000_000)
    started = time.time() - 30  # 3 MB in ~30 s by 2 nodes: 5e-5 GB/s per node
    publish_checkpoint(run_dir / "checkpoints", 40, layout={}, engine="megatron", keep_last=1, started=started, nodes=2)
    cfg = job("rl", "recipe=afm_code_rl_32b", f"run_dir={run_dir}", "cluster.signal_delay_s=60")
    ckpt = checkpoint_plan(cfg.cluster, cfg.run_dir, layout_of(cfg), 32_763_876_352)
    assert ckpt["write_speed_source"] == "measured by this run's step_00000040"
    assert (
        ckpt["write_gb_s_per_node"] == pytest.approx(5e-5, rel=0.05)
        and "set cluster.signal_delay_s >= " in (ckpt["lead_warning"])
    )


def test_a_32b_sft_at_tp1_pp1_does_not_fit_and_slurm_submission_is_refused_before_sbatch(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(repo_root()), "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    sbatch = tmp_path / "sbatch"  # records a call, which must not happen
    sbatch.write_text(f"#!/bin/sh\ntouch {tmp_path}/sbatch_called\nexit 1\n")
    sbatch.chmod(0o755)
    args = ["recipe=afm_web_sft_32b", "parallel.tp=1", "parallel.pp=1", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(
        [sys.executable, "-m", "jobs.sft", *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 3, done.stderr[-2000:]
    assert "does not fit on 80 GB GPUs" in done.stderr and "parallel.tp=8" in done.stderr, done.stderr[-2000:]
    assert "does not fit" in done.stdout and "GiB" in done.stdout
    assert (run_dir / "plan.json").is_file() and not (tmp_path / "sbatch_called").exists()
    assert not (run_dir / "logs").exists()


def test_the_plan_of_a_cpu_job_has_no_gpu_verdict_and_jobs_plan_writes_plan_json(tmp_path):
    out = tmp_path / "plan.json"
    done = subprocess.run(
        [sys.executable, "-m", "jobs.plan", "model=tiny-llama", "trainer.max_steps=1", f"plan.out={out}"],
        env={**os.environ, "PYTHONPATH": str(repo_root())},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    dtype = "bf16" if bf16_is_fast(on_gpu=False) else "fp32"  # trainer.precision=auto on this CPU
    assert out.is_file() and f"{dtype} on CPU" in done.stdout and "verdict" not in done.stdout
    assert Path(out).read_text().startswith("{")


def test_the_estimates_import_alone_and_size_a_checkpoint_and_its_usr2_lead_from_plain_numbers():
    """``plan_estimates`` loads no other launch module, no torch and no submitit (nothing that probes a disk or joins
    a process group), and its checkpoint model is arithmetic on the numbers it is given."""
    code = "import json, sys, afm_core.launch.plan_estimates; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root(), capture_output=True, text=True, check=True)
    loaded = {m for m in json.loads(out.stdout) if m.split(".")[0] in ("afm_core", "torch", "submitit")}
    assert loaded == {"afm_core", "afm_core.launch", "afm_core.launch.plan_estimates"}
    from afm_core.launch.plan_estimates import checkpoint_estimate

    ckpt = checkpoint_estimate(10**9, bf16=True, nodes=2, signal_lead_s=5, write_gb_s_per_node=1.0, source="given")
    assert ckpt["bytes"] == 14 * 10**9 and ckpt["write_s"] == 7.0  # 14 B/param (bf16, fp32 master, m, v) over 2 GB/s
    assert "set cluster.signal_delay_s >= 70" in ckpt["lead_warning"]  # 7 s x 1.5 + 60
    fp32 = checkpoint_estimate(10**9, bf16=False, nodes=1, signal_lead_s=60, write_gb_s_per_node=1.0, source="given")
    assert fp32["bytes"] == 12 * 10**9 and fp32["write_s"] == 12.0 and fp32["lead_warning"] is None


def test_lora_adapter_count_weight_sync_bytes_and_checkpoint_follow_from_the_architecture():
    """SmolLM2-135M at rank 16 on the four default targets: ``r * (in + out)`` per linear (qkv 576 -> (9 + 2 * 3)
    * 64, proj 576 -> 576, fc1 576 -> 2 * 1536, fc2 1536 -> 576), and the PEFT adapter the LoRA weight sync sends:
    <= 5% of the full sync's bytes; a LoRA checkpoint holds the adapters and their AdamW state only."""
    from afm_core.config.lora import LORA_TARGETS
    from afm_core.launch.plan_estimates import checkpoint_estimate, lora_sync_summary, weight_sync_plan

    arch = load_preset("smollm2-135m").arch
    per_layer = 16 * ((576 + 960) + (576 + 576) + (576 + 3072) + (1536 + 576))
    assert lora_adapter_params(arch, 16, LORA_TARGETS) == 30 * per_layer == 4_055_040
    # TP=3: B of qkv / fc1 and A of proj / fc2 split, the others replicated
    per_rank = 16 * ((576 + 960 // 3) + (576 // 3 + 576) + (576 + 3072 // 3) + (1536 // 3 + 576))
    assert lora_adapter_params(arch, 16, LORA_TARGETS, tp=3, layers=10) == 10 * per_rank
    sync = lora_sync_summary(arch, 16, LORA_TARGETS, weight_sync_plan(arch, 1, 1, None))
    assert sync["tensors"] == 30 * 7 * 2  # lora_A and lora_B of q, k, v, o, gate, up, down in every layer
    assert sync["full_bytes"] == 2 * 134_515_008 and sync["ratio"] <= 0.05, sync
    ckpt = checkpoint_estimate(134_515_008, True, 1, 120, 1.0, "given", trained_params=4_055_040)
    assert ckpt["bytes"] == 14 * 4_055_040


def test_lora_plan_of_an_rl_job_drops_the_kl_reference_copy_and_sets_the_full_layout_beside_it():
    one_gpu = ("cluster=slurm", "cluster.nodes=1", "cluster.tasks_per_node=1", "cluster.gpus_per_node=1")
    overrides = ("recipe=rl_demo", "algorithm.kl_coef=0.001", "model.lora.rank=16", "cluster.checkpoint_write_gb_s=1.0")
    plan = make_plan(job("rl", *overrides, *one_gpu))
    lora, stage, full = plan["lora"], plan["stages"][0], plan["lora"]["full_stages"][0]
    assert stage["adapter_params"] == lora["adapter_params"] == plan["trained_params"] == 4_055_040
    assert "reference_bytes" not in stage and full["reference_bytes"] == 2 * full["params"]  # bf16 frozen copy
    assert stage["grad_bytes"] == 4 * 4_055_040 and full["grad_bytes"] >= 4 * plan["total_params"]
    assert stage["optimizer_bytes"] == 12 * 4_055_040  # fp32 master + 2 moments, the adapters only
    assert lora["per_gpu"]["80"]["lora_peak_gib"] < lora["per_gpu"]["80"]["full_peak_gib"]
    assert lora["weight_sync"]["ratio"] <= 0.05 and plan["checkpoint"]["bytes"] == 14 * 4_055_040
    text = render(plan)
    assert "the KL reference is the base with the adapters disabled (no copy)" in text
    assert "weight sync: the adapters only, 420 tensors" in text and "reference" in text
