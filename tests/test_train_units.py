"""Single-process pieces of the SFT engine: loss, LR schedule, checkpoint discovery, metrics log, CPU shims."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from afm_core.engine.checkpoint_dirs import (
    COMPLETE_MARKER,
    complete_checkpoints,
    latest_complete_checkpoint,
    stage_checkpoint,
)
from afm_core.engine.metrics import plot_losses, read_metrics
from afm_core.train.loss import masked_token_loss, reduce_reports
from afm_core.utils.paths import repo_root
from afm_core.utils.tracking import MetricsLog


def test_masked_token_loss_is_cross_entropy_over_unmasked_positions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g)
    labels = torch.randint(0, 11, (2, 7), generator=g)
    mask = (torch.rand(2, 7, generator=g) > 0.4).float()
    per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    loss_sum, num_tokens, report = masked_token_loss(mask, per_token)
    expected = F.cross_entropy(logits[mask.bool()], labels[mask.bool()])
    assert int(num_tokens) == int(mask.sum())
    assert float(loss_sum / num_tokens) == pytest.approx(float(expected), rel=1e-6)
    assert reduce_reports([report], groups=[]) == (pytest.approx(float(expected), rel=1e-6), int(mask.sum()))


def test_reduce_reports_is_a_token_mean_not_a_mean_of_means():
    reports = [{"lm loss": torch.tensor([10.0, 10.0])}, {"lm loss": torch.tensor([3.0, 1.0])}]
    assert reduce_reports(reports, groups=[]) == (pytest.approx(13 / 11), 11)
    assert math.isnan(reduce_reports([], groups=[])[0])


def test_masked_token_loss_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"loss_mask \(2, 3\) != per-token loss \(3, 2\)"):
        masked_token_loss(torch.ones(2, 3), torch.ones(3, 2))


def test_warmup_then_cosine_to_min_lr():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from afm_core.engine.optim import warmup_steps

    assert warmup_steps(0.1, 150) == 15 and warmup_steps(0.1, 5) == 1 and warmup_steps(0.5, 1) == 0
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([{"params": [param], "max_lr": 1e-3, "min_lr": 1e-4}], lr=0.0)
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1e-3,
        min_lr=1e-4,
        lr_warmup_steps=10,
        lr_decay_steps=110,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=110,
        wd_incr_style="constant",
    )
    lrs = []
    for _ in range(111):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step(1)
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(5e-4) and lrs[10] == pytest.approx(1e-3)
    assert lrs[60] == pytest.approx(1e-4 + 0.9e-3 / 2)  # half way through the cosine
    assert lrs[110] == pytest.approx(1e-4)


def _make_checkpoint(root, step, complete=True):
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "common.pt").write_bytes(b"x")
    if complete:
        (path / COMPLETE_MARKER).write_text(json.dumps({"step": step}))
    return path


def test_latest_complete_checkpoint_ignores_partial_ones(tmp_path):
    assert latest_complete_checkpoint(tmp_path / "missing") is None
    _make_checkpoint(tmp_path, 100)
    best = _make_checkpoint(tmp_path, 200)
    _make_checkpoint(tmp_path, 300, complete=False)  # crashed before its marker
    (tmp_path / ".tmp-step_00000400").mkdir()  # a save in progress
    (tmp_path / "step_abc").mkdir()
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [100, 200]
    assert latest_complete_checkpoint(tmp_path) == best


def test_a_save_the_disk_cannot_hold_fails_before_writing(tmp_path, monkeypatch):
    import errno
    import shutil
    from collections import namedtuple

    assert stage_checkpoint(tmp_path, 100).name == ".tmp-step_00000100"  # no checkpoint yet: nothing to estimate
    latest = _make_checkpoint(tmp_path, 100)
    (latest / "model.bin").write_bytes(b"x" * 4096)
    (tmp_path / ".tmp-step_00000150").mkdir()  # a killed save
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(
        OSError, match=r"no space for checkpoint step_00000200: .* step_00000100 is still the latest"
    ) as err:
        stage_checkpoint(tmp_path, 200)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(tmp_path)
    assert latest_complete_checkpoint(tmp_path) == latest and not list(tmp_path.glob(".tmp-*"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 0, 10**9))
    assert stage_checkpoint(tmp_path, 200).name == ".tmp-step_00000200"


def test_metrics_log_resumes_without_duplicates(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, resume_step=0)
    for step in range(5):
        log.write({"step": step, "split": "train", "loss": 5.0 - step, "grad_norm": float("nan")})
    log.write({"step": 4, "split": "eval", "loss": 1.5})
    log.close()
    with open(path, "a") as f:
        f.write('{"step": 5, "spl')  # torn by a crash
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3, 4, 4]
    assert read_metrics(path)[0]["grad_norm"] is None

    log = MetricsLog(path, resume_step=2)  # resumed from the step-2 checkpoint
    log.write({"step": 3, "split": "train", "loss": 9.0})
    log.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(0, 5.0), (1, 4.0), (2, 3.0), (3, 9.0)]
    MetricsLog(path, resume_step=0).close()  # a fresh run starts empty
    assert read_metrics(path) == []


def test_read_metrics_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "split": "eval", "loss": 1.0}\nnot json\n{"step": 1, "split": "eval", "loss": 1.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON object"):
        read_metrics(path)


def test_plot_losses_writes_png(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(
            json.dumps({"step": s, "split": sp, "loss": 2.0 / (s + 1)}) + "\n"
            for s in range(4)
            for sp in ("train", "eval")
        )
    )
    plot_losses(path, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resolve_max_steps_and_eval_batches():
    from afm_core.train.sft import full_micro_batches, resolve_max_steps

    t = SimpleNamespace(max_steps=None, epochs=2, global_batch_size=4)
    assert resolve_max_steps(t, 42) == 20
    with pytest.raises(ValueError, match=r"trainer\.max_steps or trainer\.epochs"):
        resolve_max_steps(SimpleNamespace(max_steps=None, epochs=None, global_batch_size=4), 42)
    with pytest.raises(ValueError, match="0 optimizer steps"):
        resolve_max_steps(SimpleNamespace(max_steps=None, epochs=1, global_batch_size=4), 3)
    batches = [{"tokens": torch.zeros(2, 8)}, {"tokens": torch.zeros(1, 8)}]
    assert len(full_micro_batches(iter(batches), 2)) == 1
    with pytest.raises(ValueError, match=r"trainer\.eval_sequences"):
        full_micro_batches(iter(batches[1:]), 2)


def test_training_dtype_auto_is_bf16_only_where_it_is_fast_and_warns_on_bf16_emulated(monkeypatch, caplog):
    from afm_core.engine.distributed import training_dtype
    from afm_core.utils import hardware

    for gpu, native, forced, auto, warns in (
        (True, False, "", torch.bfloat16, False),
        (True, False, "0", torch.bfloat16, False),  # the switch is about CPUs
        (False, True, "", torch.bfloat16, False),
        (False, False, "", torch.float32, True),
        (False, False, "1", torch.bfloat16, False),  # AFM_CPU_BF16=1 on an AVX2 CPU: asked for, no warning
        (False, True, "0", torch.float32, False),  # AFM_CPU_BF16=0 on an AVX512-BF16 CPU: bf16 is still fast
    ):
        monkeypatch.setenv("AFM_CPU_BF16", forced)
        monkeypatch.setattr(hardware, "cuda_available", lambda gpu=gpu: gpu)
        monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda native=native: native)
        caplog.clear()
        assert training_dtype("auto") == auto and training_dtype("fp32") == torch.float32
        assert training_dtype("bf16") == torch.bfloat16  # kept as asked, with a warning where it is emulated
        assert ("trainer.precision=bf16 on a CPU without native bf16" in caplog.text) == warns
        caplog.clear()
        assert training_dtype("bf16", warn=False) == torch.bfloat16 and not caplog.text  # the RL rollout actor's read
    with pytest.raises(ValueError, match=r"trainer\.precision='fp16'"):
        training_dtype("fp16")
    monkeypatch.setenv("AFM_CPU_BF16", "yes")
    with pytest.raises(ValueError, match=r"AFM_CPU_BF16='yes': expected 1 .*, 0 .* or unset"):
        training_dtype("auto")


def test_the_machine_summary_names_this_cpu_its_speed_flags_and_the_precision_auto_picks(monkeypatch):
    from afm_core.utils import hardware

    for forced, precision in (("1", "bf16"), ("0", "fp32")):
        monkeypatch.setenv("AFM_CPU_BF16", forced)
        machine = hardware.machine_summary()
        assert machine["cpu_precision"] == precision
    assert machine["cpu"] and machine["threads"] == len(os.sched_getaffinity(0))
    cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    flags = set(cpuinfo.split("\nflags", 1)[1].split("\n", 1)[0].split())
    assert machine["flags"] == [f for f in hardware.SPEED_FLAGS if f in flags]
    assert (machine["gpu"] is not None) == torch.cuda.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shims apply only without CUDA")
def test_cpu_shims_in_a_fresh_process():
    """Idempotent; device="cuda" lands on the CPU; `with torch.device("meta")` still applies (primed cache);
    megatron's gradient clipping on torch's foreach kernels (afm_core.engine.multi_tensor): the same norm as its
    fallback's, left on the device, and the grads scaled in place."""
    code = """
import torch
from afm_core.engine.cpu_shims import apply_cpu_shims
assert apply_cpu_shims() and apply_cpu_shims()
assert torch.ones(2, device="cuda").device.type == "cpu"
assert torch.zeros(2).to("cuda").device.type == "cpu"
assert torch.cuda.current_device() == "cpu"
assert torch.zeros(1).type() == "torch.cuda.FloatTensor" and torch.zeros(1).type(torch.int32).dtype == torch.int32
with torch.device("meta"):
    assert torch.empty(3).device.type == "meta" and torch.nn.Linear(2, 2).weight.device.type == "meta"
torch.cuda.manual_seed(7); a = torch.rand(1); torch.manual_seed(7); assert torch.equal(a, torch.rand(1))
# gradient clipping: the norm on the device, the grads scaled in place, to megatron's fallback's values
from megatron.core import utils
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from afm_core.engine import multi_tensor
multi_tensor.use_foreach_kernels(); multi_tensor.use_foreach_kernels()
assert clip_grads.l2_norm_impl is multi_tensor.multi_tensor_l2_norm
assert clip_grads.multi_tensor_scale_impl is multi_tensor.multi_tensor_scale
tensors = [torch.randn(5, 3), torch.randn(7), torch.randn(1)]
norm, _ = clip_grads.l2_norm_impl(2048, None, [tensors], False)
want, _ = utils.local_multi_tensor_l2_norm(2048, None, [tensors], False)
assert norm.shape == want.shape == (1,) and torch.allclose(norm, want, rtol=1e-6)
params = [torch.nn.Parameter(torch.ones(5, 3)), torch.nn.Parameter(torch.ones(7))]
for p in params:
    p.grad = torch.randn(p.shape)
grads = [p.grad for p in params]
want = [g * (1.0 / (4.0 + 1.0e-6)) for g in grads]
clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=4.0)
assert all(p.grad is g and torch.equal(g, w) for p, g, w in zip(params, grads, want))
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_a_preemption_signal_during_the_boundary_all_reduce_is_kept_for_the_next_boundary(monkeypatch):
    """SIGUSR2 can land while the ranks all-reduce the flags; the request must survive to the next boundary."""
    from afm_core.engine.preemption import Preemption

    preemption = Preemption()  # a loop's own: nothing process-wide to reset

    def all_reduce_while_a_signal_lands(tensor, op=None):
        preemption.request(stop=True)  # what the signal handler does, mid-collective

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce_while_a_signal_lands)
    assert preemption.boundary_flags(on_gpu=False) == (False, False)  # nothing was requested before this boundary
    assert preemption.stop_requested()  # set, and kept: the boundary had read it clear
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None: None)
    assert preemption.boundary_flags(on_gpu=False) == (True, True)  # ...and the late request is not lost
    assert preemption.boundary_flags(on_gpu=False) == (False, False)  # consumed once
    assert not preemption.stop_requested()


def test_the_jobs_preemption_hook_reaches_the_jobs_preemption_and_loops_default_to_it(monkeypatch):
    """``on_preempt`` of jobs.sft / jobs.rl (:func:`request_checkpoint`) sets the job's :class:`Preemption`, the one
    an SFT loop reads when it is handed none; a loop handed its own never sees the job's."""
    from afm_core.engine import preemption
    from afm_core.launch.submit import run_training_job
    from afm_core.train.loop import SFTLoop

    job = preemption.Preemption()
    monkeypatch.setattr(preemption, "JOB_PREEMPTION", job)  # this test's stand-in for the process's
    preemption.request_checkpoint()  # what the relay of the job's SIGUSR2 calls
    assert job.stop_requested() and not preemption.Preemption().stop_requested()
    assert "afm_core.engine.preemption.request_checkpoint" in inspect.getsource(run_training_job)
    assert inspect.signature(SFTLoop.__init__).parameters["preemption"].default is None


def test_training_flops_count_every_matrix_product_and_causal_pairs():
    from transformers import AutoModelForCausalLM

    from afm_core.engine.flops import causal_pairs, datasheet_peak_tflops, matmul_params, mfu, training_flops
    from afm_core.models.arch import hf_config_from_arch
    from afm_core.models.presets import load_preset

    # Qwen2.5-1.5B's shape (GQA, q/k/v biases, tied output layer) with 2 of its 28 layers
    arch = dataclasses.replace(load_preset("qwen2.5-1.5b-instruct").arch, num_layers=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config_from_arch(arch))
    linear = [m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)]  # lm_head included
    assert matmul_params(arch) == sum(linear)
    assert causal_pairs([1, 3, 4]) == 1 + 6 + 10
    flops = training_flops(arch, tokens=8, attention_pairs=17)
    assert flops["linear"] == 6 * sum(linear) * 8
    assert flops["attention"] == 12 * 2 * 12 * 128 * 17
    assert datasheet_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert datasheet_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert datasheet_peak_tflops("NVIDIA H200") == 989.0
    assert datasheet_peak_tflops("cpu") is None
    assert mfu(989e12, 2.0, 989.0) == 0.5
    assert mfu(1e12, 1.0, None) is None


def test_the_sft_job_config_is_checked_on_each_rank_and_each_part_gets_its_groups(tmp_path):
    """``jobs.sft``'s ranks check the job's plain config into an ``SFTConfig`` (``load_cfg``, as ``jobs.rl``'s);
    the loop's view logs the whole config, and the objective is built from ``trainer`` and ``contrastive``."""
    from omegaconf import OmegaConf

    import jobs.sft
    from afm_core.config import ConfigError
    from afm_core.config.sft import SFTConfig, sft_config
    from afm_core.launch.plan import compose
    from afm_core.train.objective import PairLoss, TokenLoss, build_objective

    assert '"afm_core.config.sft.sft_config"' in inspect.getsource(jobs.sft.main)
    plain = OmegaConf.to_container(compose("sft", ["model=tiny-llama", f"run_dir={tmp_path}"]), resolve=True)
    config = sft_config(plain)
    assert isinstance(config, SFTConfig) and sft_config(config) is config
    loop = config.loop
    assert loop.trainer is config.trainer and loop.optim is config.optim and loop.model is config.model
    assert loop.logged["model"]["name"] == "tiny-llama" and loop.logged["run_dir"] == str(tmp_path)
    assert isinstance(build_objective(loop.trainer, loop.contrastive), TokenLoss)
    pairs = sft_config({**plain, "trainer": {**plain["trainer"], "objective": "contrastive"}}).loop
    objective = build_objective(pairs.trainer, pairs.contrastive)
    assert isinstance(objective, PairLoss) and objective.config is pairs.contrastive
    with pytest.raises(ConfigError, match=r"trainer\.eval_interval"):
        sft_config({**plain, "trainer": {**plain["trainer"], "eval_interval": 0}})


class _FakeEngine:
    """An :class:`~afm_core.engine.checkpoint.EngineState` that records its loads."""

    def __init__(self, name: str, same_layout_only: str | None):
        self.name, self.same_layout_only, self.loaded = name, same_layout_only, []

    def load(self, path: Path) -> dict:
        self.loaded.append(path)
        return {"progress": {"step": 1}}


def _layout(dp: int = 1):
    from afm_core.engine.distributed import ParallelLayout

    return ParallelLayout(rank=0, world_size=dp, local_rank=0, local_world_size=dp, tp=1, pp=1, dp=dp, vpp=None,
                          tp_rank=0, pp_rank=0, dp_rank=0, device=torch.device("cpu"))  # fmt: skip


def _saved_checkpoint(root: Path, engine: str) -> Path:
    """Checkpoint 1 of a world of one as :meth:`Checkpointer.save` leaves it, the engine's own files aside."""
    from afm_core.engine.checkpoint import layout_key, rank_file, rng_state
    from afm_core.engine.checkpoint_dirs import publish_checkpoint

    temp = stage_checkpoint(root, 1)
    temp.mkdir()
    torch.save({"layout": layout_key(_layout()), "rng": rng_state(), "data": {"index": 7}}, rank_file(temp, 0))
    return publish_checkpoint(root, 1, layout=layout_key(_layout()), engine=engine, keep_last=1)


def test_the_one_checkpoint_protocol_checks_engine_and_layout_then_restores_the_ranks_state(tmp_path):
    from afm_core.engine.checkpoint import Checkpointer, MegatronShards
    from afm_core.engine.checkpoint_dirs import read_marker
    from afm_core.train.deepspeed_engine import DeepSpeedFiles

    assert (MegatronShards.name, MegatronShards.same_layout_only) == ("megatron", None)
    assert DeepSpeedFiles.name == "deepspeed" and "same number" in str(DeepSpeedFiles.same_layout_only)

    path = _saved_checkpoint(tmp_path / "megatron", "megatron")
    assert sorted(p.name for p in path.iterdir()) == [COMPLETE_MARKER, "rank_00000.pt"]
    assert read_marker(path)["layout"] == {"world_size": 1, "tp": 1, "pp": 1, "dp": 1}
    expected = torch.rand(3)  # the draw after the saved RNG state
    megatron = _FakeEngine("megatron", None)
    common, rank_state = Checkpointer(tmp_path / "megatron", 1, _layout()).load(path, megatron)
    assert common == {"progress": {"step": 1}} and rank_state == {"data": {"index": 7}}
    assert torch.equal(torch.rand(3), expected) and megatron.loaded == [path]
    # another layout: Megatron's shards reshard, the rank's own state is not restored
    assert Checkpointer(tmp_path / "megatron", 1, _layout(dp=2)).load(path, megatron) == (common, {})

    deepspeed = _FakeEngine("deepspeed", DeepSpeedFiles.same_layout_only)
    with pytest.raises(ValueError, match=r"by the megatron engine; resume it with trainer\.engine=megatron"):
        Checkpointer(tmp_path / "megatron", 1, _layout()).load(path, deepspeed)
    zero = _saved_checkpoint(tmp_path / "deepspeed", "deepspeed")
    with pytest.raises(ValueError, match=r"this run has .*'dp': 2.*ZeRO-3 checkpoints resume on the same number"):
        Checkpointer(tmp_path / "deepspeed", 1, _layout(dp=2)).load(zero, deepspeed)
    assert deepspeed.loaded == []  # refused before the engine read anything
    with pytest.raises(ValueError, match=r"by the deepspeed engine; resume it with trainer\.engine=deepspeed"):
        Checkpointer(tmp_path / "deepspeed", 1, _layout()).load(zero, megatron)
