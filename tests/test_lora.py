"""LoRA adapters on the Megatron model (afm_core.models.lora), on real megatron-core over gloo with the tiny-llama
HF checkpoint: with ``B = 0`` the adapted model's logits are the (frozen) base model's exactly; at TP=2 the
per-token loss and every adapter gradient equal TP=1's (fp32); only the adapters require and receive gradients,
and the trainer core's optimizer holds them alone and changes nothing else in a step.

The base is compared frozen, as LoRA holds it: ATen's ``matmul`` folds a 3-D input differently when the weight
requires grad (``should_fold`` in ``aten/src/ATen/native/LinearAlgebra.cpp`` reads ``requires_grad()``, even under
``no_grad``), so a trainable and a frozen copy of the same weights differ by float rounding (~6e-7 in the logits
here) on the sequence-major, non-contiguous activations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from afm_core.config.lora import LoRAConfig
from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks

LORA = LoRAConfig(rank=4, alpha=8.0)
SEQ = 16


def _full_b(name: str, shape: tuple[int, int]) -> torch.Tensor:
    """A non-zero ``B`` in TP=1's layout, the same for every run."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g) * 0.05


def _rank_rows(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This TP rank's rows of a column-parallel tensor in TP=1's layout: contiguous for linear_qkv (whole query
    groups per rank), ``[gate_p; up_p]`` for linear_fc1, as megatron shards their weights."""
    if name.endswith("linear_fc1"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return full.chunk(tp)[rank]


def _gather_rows(name: str, local: torch.Tensor, group, tp: int) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    if name.endswith("linear_fc1"):
        gates, ups = zip(*(p.chunk(2) for p in parts), strict=True)
        return torch.cat([*gates, *ups])
    return torch.cat(parts)


def _worker(rank: int, port: int, hf_dir: str, out: str) -> None:
    set_rank_env(rank, 2, port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from transformers import AutoConfig

    from afm_core.engine.cpu_shims import apply_cpu_shims
    from afm_core.models.gpt import build_gpt_model, mcore_config_from_hf
    from afm_core.models.hf_weights import load_hf_weights
    from afm_core.models.lora import adapted_modules, adapter_named_parameters, apply_lora, is_adapter_name

    apply_cpu_shims()
    hf_config = AutoConfig.from_pretrained(hf_dir)
    ids = torch.randint(0, 1000, (1, SEQ), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(SEQ).unsqueeze(0)
    labels = torch.roll(ids, -1, dims=1)
    runs = {}

    def build(tp: int):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        config = mcore_config_from_hf(hf_config, tp=tp, pp=1, params_dtype=torch.float32)
        model = build_gpt_model(hf_config, config, pre_process=True, post_process=True)
        load_hf_weights([model], hf_dir)
        return model

    for tp in (1, 2):
        model = build(tp)
        tp_rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
        for p in model.parameters():  # the base model as LoRA holds it: frozen (see below)
            p.requires_grad_(False)
        with torch.no_grad():
            base_logits = model(ids, pos, None)  # [1, s, V/tp]
        count = apply_lora([model], LORA)
        with torch.no_grad():
            assert torch.equal(model(ids, pos, None), base_logits), "B = 0: the adapted model is the base model"
        assert count == sum(p.numel() for _, p in adapter_named_parameters([model]))
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all(is_adapter_name(n) for n in trainable), sorted(trainable)[:5]
        modules = dict(adapted_modules([model]))
        assert len(modules) == 4 * hf_config.num_hidden_layers
        with torch.no_grad():
            for name, module in modules.items():
                full = _full_b(name, (module.lora_B.shape[0] * (tp if module._afm_lora.column else 1), LORA.rank))
                module.lora_B.copy_(_rank_rows(name, full, tp_rank, tp) if module._afm_lora.column else full)
        loss = model(ids, pos, None, labels=labels)  # [1, s] per-token cross entropy
        loss.sum().backward()
        assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter_name(n))
        grads = {}
        for name, module in modules.items():
            a, b = module.lora_A.grad, module.lora_B.grad
            if tp > 1 and module._afm_lora.column:
                b = _gather_rows(name, b, group, tp)
            elif tp > 1:
                parts = [torch.empty_like(a) for _ in range(tp)]
                torch.distributed.all_gather(parts, a.contiguous(), group=group)
                a = torch.cat(parts, dim=1)
            grads[name] = (a, b)
        runs[tp] = (loss.detach(), grads, count)
        if tp == 2:
            _one_optimizer_step(model, rank, Path(out))
        ps.destroy_model_parallel()

    if rank == 0:
        (loss1, grads1, count1), (loss2, grads2, count2) = runs[1], runs[2]
        torch.testing.assert_close(loss2, loss1, rtol=1e-5, atol=1e-5)
        worst = 0.0
        for name, (a1, b1) in grads1.items():
            a2, b2 = grads2[name]
            torch.testing.assert_close(a2, a1, rtol=1e-4, atol=1e-6, msg=f"{name}.lora_A grad")
            torch.testing.assert_close(b2, b1, rtol=1e-4, atol=1e-6, msg=f"{name}.lora_B grad")
            worst = max(worst, float((a2 - a1).abs().max()), float((b2 - b1).abs().max()))
        Path(out, "result.json").write_text(json.dumps({"worst_grad_diff": worst, "counts": [count1, count2]}))
    torch.distributed.destroy_process_group()


def _one_optimizer_step(model: torch.nn.Module, rank: int, out: Path) -> None:
    """The trainer core over the adapted TP=2 model: its optimizer holds exactly the adapter parameters, and one
    step changes them and nothing else."""
    from afm_core.config.sft import OptimConfig
    from afm_core.engine.core import MegatronTrainer
    from afm_core.engine.distributed import ParallelLayout
    from afm_core.models.lora import is_adapter_name

    layout = ParallelLayout(rank=rank, world_size=2, local_rank=rank, local_world_size=2, tp=2, pp=1, dp=1,
                            vpp=None, tp_rank=rank, pp_rank=0, dp_rank=0, device=torch.device("cpu"))  # fmt: skip
    for p in model.parameters():
        p.grad = None
    names = {id(p): n for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = MegatronTrainer(
        layout, [model], optim=OptimConfig(lr=1e-2, warmup_ratio=0.0), max_steps=2, grad_clip=1.0,
        distributed_optimizer=False, checkpoint_dir=out / f"ckpt{rank}", keep_last=1,
    )  # fmt: skip
    optimized = [names[id(p)] for group in trainer.optimizer.param_groups for p in group["params"]]
    assert optimized and all(is_adapter_name(n) for n in optimized), optimized[:5]
    assert len(optimized) == sum(1 for n in before if is_adapter_name(n))
    ids = torch.randint(0, 1000, (1, SEQ), generator=torch.Generator().manual_seed(1))
    batch = {"ids": ids, "pos": torch.arange(SEQ).unsqueeze(0), "labels": torch.roll(ids, -1, dims=1)}

    def forward_step(data, chunk):
        b = next(data)
        per_token = chunk(b["ids"], b["pos"], None, labels=b["labels"])

        def loss_func(output):
            return output.sum(), torch.tensor(output.numel()), {"loss": output.detach().sum()}

        return per_token, loss_func

    trainer.step([batch], forward_step, seq_length=SEQ, micro_batch_size=1, what="lora step")
    for n, p in model.named_parameters():
        assert (not torch.equal(p.detach(), before[n])) == is_adapter_name(n), n
    inner = trainer.optimizer.optimizer  # the torch AdamW under megatron's fp32 optimizer wrapper
    assert inner.state and all(is_adapter_name(names[id(p)]) for p in inner.state), "Adam moments: adapters only"


@pytest.mark.slow
def test_lora_adapters_start_as_the_base_model_and_tp2_matches_tp1(tmp_path):
    start_ranks(_worker, args=(free_port(), str(ensure_hf_checkpoint("tiny-llama")), str(tmp_path)), nprocs=2)
    result = json.loads((tmp_path / "result.json").read_text())
    # tiny-llama, r = 4, per layer r * (in + out): qkv 128 + 256, proj 128 + 128, fc1 128 + 512, fc2 256 + 128
    # = 6656 (x 2 layers); at TP=2 a rank holds the replicated A (qkv, fc1) / B (proj, fc2) and half the other
    assert result["counts"] == [2 * 6656, 2 * 4352], result


def test_lora_config_refuses_bad_values():
    from afm_core.config.checks import ConfigError

    for bad in ({"rank": -1}, {"rank": 4, "alpha": 0}, {"dropout": 1.0}, {"target_modules": []},
                {"target_modules": ["q_proj"]}):  # fmt: skip
        with pytest.raises(ConfigError, match=r"model\.lora"):
            LoRAConfig(**bad)
    assert LoRAConfig(rank=16, alpha=32).scale == 2.0
    assert not LoRAConfig().enabled
