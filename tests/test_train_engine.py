"""The megatron SFT engine (afm_core.train.trainer) on a tiny GPT with synthetic packed batches, real gloo
process groups (torch.multiprocessing spawn) and real dist_checkpointing.

Weights are initialised from each tensor's GLOBAL checkpoint key and offset, so every TP/PP layout starts
from the same model and the per-step losses must agree.
"""

from __future__ import annotations

import json
import math
import os
import signal
import zlib
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from afm_core.utils.paths import repo_root
from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks

VOCAB, SEQ, HIDDEN, LAYERS = 128, 32, 32, 4


def make_cfg(**overrides) -> OmegaConf:
    """trainer/optim/parallel groups from the real conf/ files, sized down for a tiny model."""
    conf = repo_root() / "conf"
    cfg = OmegaConf.create(
        {
            "trainer": OmegaConf.load(conf / "sft.yaml").trainer,
            "optim": OmegaConf.load(conf / "sft.yaml").optim,
            "parallel": OmegaConf.load(conf / "parallel" / "default.yaml"),
        }
    )
    cfg.trainer.update(
        seq_length=SEQ,
        micro_batch_size=2,
        global_batch_size=8,
        max_steps=5,
        eval_interval=2,
        save_interval=100,
        progress=False,
        num_threads=1,
        export_hf=False,
    )
    cfg.optim.update(lr=3e-3, min_lr=3e-4, warmup_ratio=0.2)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def loop_config(cfg):
    """The SFT loop's typed view of ``make_cfg``'s groups (:class:`afm_core.config.sft.LoopConfig`); no model
    preset, so no MFU."""
    from afm_core.config import check_config
    from afm_core.config.sft import LoopConfig

    return check_config(cfg, LoopConfig)


class SyntheticBatches:
    """Deterministic packed micro batches: micro batch i of DP rank r depends only on (seed, r, i).

    Each sequence packs documents of random length; loss_mask is 0 on a random prefix of each document
    (the "prompt") and on a random inner span (the "observation"), so masks differ a lot between micro batches.
    """

    def __init__(self, seed: int, dp_rank: int, mbs: int, on_fetch=None):
        self.seed, self.dp_rank, self.mbs, self.index, self.on_fetch = seed, dp_rank, mbs, 0, on_fetch

    def make(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.dp_rank * 10_007 + index)
        tokens = torch.randint(0, VOCAB, (self.mbs, SEQ + 1), generator=g)
        tokens[:, 1::2] = (tokens[:, 0:-1:2] * 7 + 3) % VOCAB  # learnable structure
        loss_mask = torch.ones(self.mbs, SEQ)
        position_ids = torch.zeros(self.mbs, SEQ, dtype=torch.long)
        attention_mask = torch.ones(self.mbs, 1, SEQ, SEQ, dtype=torch.bool)
        cu_seqlens = []
        for b in range(self.mbs):
            start, offsets = 0, [0]
            while start < SEQ:
                length = min(SEQ - start, int(torch.randint(6, 20, (1,), generator=g)))
                end = start + length
                position_ids[b, start:end] = torch.arange(length)
                attention_mask[b, 0, start:end, start:end] = ~torch.tril(torch.ones(length, length, dtype=torch.bool))
                loss_mask[b, start : start + int(torch.randint(0, length, (1,), generator=g))] = 0
                obs = start + int(torch.randint(0, length, (1,), generator=g))
                loss_mask[b, obs : obs + 3] = 0
                start = end
                offsets.append(end)
            cu_seqlens.append(torch.tensor(offsets, dtype=torch.int32))
        # the trainer reads cu_seqlens (thd); the hand-computed reference below uses the dense mask
        return {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": loss_mask,
            "position_ids": position_ids,
            "attention_mask": attention_mask,
            "cu_seqlens": cu_seqlens,
        }

    def __next__(self):
        if self.on_fetch is not None:
            self.on_fetch(self.index)
        batch = self.make(self.index)
        self.index += 1
        return batch

    def state_dict(self):
        return {"index": self.index}

    def load_state_dict(self, state):
        self.index = state["index"]


def tiny_provider(layout, *, params_dtype=torch.float32):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from afm_core.models.gpt import gpt_layer_spec

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )

    def provider(pre_process, post_process, vp_stage=None):
        model = GPTModel(
            config,
            gpt_layer_spec(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=pre_process,
            post_process=post_process,
            position_embedding_type="rope",
            share_embeddings_and_output_weights=True,
            vp_stage=vp_stage,
        )
        init_by_global_key(model)
        return model

    return provider


@torch.no_grad()
def init_by_global_key(model) -> None:
    """Fill every parameter from a generator seeded by its global checkpoint key: layout-independent init."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for sharded in model.sharded_state_dict().values():
        if not isinstance(sharded, ShardedTensor) or not sharded.data.is_floating_point():
            continue
        g = torch.Generator().manual_seed(zlib.crc32(sharded.key.encode()))
        full = torch.randn(sharded.global_shape, generator=g) * 0.05
        if "norm" in sharded.key:
            full = 1.0 + full
        local = (1,) * sharded.prepend_axis_num + tuple(sharded.data.shape)
        part = full[tuple(slice(o, o + n) for o, n in zip(sharded.global_offset, local))]
        sharded.data.copy_(part.reshape(sharded.data.shape))


def train_worker(rank: int, world: int, port: int, spec: dict) -> None:
    """Train the tiny model per ``spec`` and dump the final weights of this rank under spec['out']."""
    set_rank_env(rank, world, port)
    from afm_core.engine.core import build_model_chunks
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.engine.preemption import Preemption
    from afm_core.train.trainer import SFTTrainer

    cfg = OmegaConf.create(spec["cfg"])
    layout = init_distributed(cfg.parallel, seed=cfg.trainer.seed, num_threads=1)
    try:
        on_fetch, preemption = None, Preemption()  # this rank's: what its SIGUSR2 sets
        if spec.get("stop_at_step"):
            signal.signal(signal.SIGUSR2, lambda *_: preemption.request(stop=True))
            mb_per_step = cfg.trainer.global_batch_size // (cfg.trainer.micro_batch_size * layout.dp)
            first_of_step = (spec["stop_at_step"] - 1) * mb_per_step

            def on_fetch(index):  # the "scheduler" preempts us while the step is being prepared
                if index == first_of_step and rank == 0:
                    os.kill(os.getpid(), signal.SIGUSR2)

        if spec.get("crash_on_save"):
            _crash_on_save(spec["crash_on_save"])
        params_dtype = torch.bfloat16 if spec.get("bf16") else torch.float32
        chunks = build_model_chunks(tiny_provider(layout, params_dtype=params_dtype), layout)
        train = SyntheticBatches(seed=1, dp_rank=layout.dp_rank, mbs=cfg.trainer.micro_batch_size, on_fetch=on_fetch)
        heldout = SyntheticBatches(seed=2, dp_rank=layout.dp_rank, mbs=cfg.trainer.micro_batch_size)
        eval_batches = [heldout.make(i) for i in range(spec.get("eval_micro_batches", 2))]
        trainer = SFTTrainer(
            loop_config(cfg),
            layout,
            chunks,
            train,
            eval_batches,
            spec["run_dir"],
            cfg.trainer.max_steps,
            preemption=preemption,
        )
        summary = trainer.fit()
        # a save leaves no process behind (megatron's writer started a Manager server per rank at its first save)
        assert mp.active_children() == [], mp.active_children()
        out = Path(spec["out"])
        out.mkdir(parents=True, exist_ok=True)
        weights = {
            f"{i}.{k}": v.detach().clone()
            for i, m in enumerate(trainer.model)
            for k, v in m.module.state_dict().items()
            if isinstance(v, torch.Tensor)
        }
        torch.save(weights, out / f"weights_rank{rank}.pt")
        if rank == 0:
            (out / "summary.json").write_text(json.dumps(summary))
    finally:
        destroy_distributed()


def _crash_on_save(nth: int) -> None:
    """Make the nth dist_checkpointing save die half-way (after writing some shards)."""
    from megatron.core import dist_checkpointing

    from afm_core.engine import checkpoint

    real_save, calls = dist_checkpointing.save, []

    def dying_save(state, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == nth:
            (Path(path) / "__0_0.distcp").write_bytes(b"partial")
            raise OSError(28, "No space left on device (simulated)")
        return real_save(state, path, *args, **kwargs)

    checkpoint.dist_checkpointing.save = dying_save


def spawn(world: int, spec: dict) -> None:
    start_ranks(train_worker, args=(world, free_port(), spec), nprocs=world)


def run(tmp_path: Path, name: str, world: int = 1, run_dir: Path | None = None, **spec) -> dict:
    """Spawn a training run; returns its summary, metrics records and rank-0 weights."""
    out = tmp_path / name
    spec.setdefault("cfg", OmegaConf.to_container(make_cfg()))
    spec.update(run_dir=str(run_dir or out / "run"), out=str(out))
    spawn(world, spec)
    metrics_path = Path(spec["run_dir"]) / "metrics.jsonl"
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    return {"summary": json.loads((out / "summary.json").read_text()), "records": records, "out": out}


def losses(result: dict, split: str = "train") -> list[float]:
    return [r["loss"] for r in result["records"] if r["split"] == split]


def cfg_with(**overrides) -> dict:
    return OmegaConf.to_container(make_cfg(**overrides))


def loss_worker(rank: int, world: int, port: int, spec: dict) -> None:
    """DP=2, two micro batches per rank: the engine's loss and gradients against a hand-computed
    F.cross_entropy over the unmasked positions of the whole global batch."""
    import torch.nn.functional as F

    set_rank_env(rank, world, port)
    from afm_core.engine.core import build_model_chunks
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.train.loss import reduce_reports
    from afm_core.train.trainer import SFTTrainer

    cfg = OmegaConf.create(spec["cfg"])
    layout = init_distributed(cfg.parallel, seed=cfg.trainer.seed, num_threads=1)
    try:
        chunks = build_model_chunks(tiny_provider(layout), layout)
        data = SyntheticBatches(seed=3, dp_rank=layout.dp_rank, mbs=cfg.trainer.micro_batch_size)
        trainer = SFTTrainer(loop_config(cfg), layout, chunks, data, [], spec["run_dir"], max_steps=5)
        assert trainer.num_microbatches == 2
        batches = [data.make(i) for i in range(2)]
        model = chunks[0]
        params = list(model.parameters())
        # the reference takes its gradients from autograd: the layers that add theirs into main_grad stop for it
        fused = [m for m in model.modules() if getattr(m, "grad_into_main_grad", False)]
        for module in fused:
            module.grad_into_main_grad = False
        ce_sum, count = torch.zeros(()), torch.zeros(())
        for batch in batches:
            logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])  # [b, s, V]
            keep = batch["loss_mask"].bool()
            ce_sum = ce_sum + F.cross_entropy(logits[keep], batch["labels"][keep], reduction="sum")
            count += keep.sum()
        global_count = count.clone()
        torch.distributed.all_reduce(global_count)
        hand_grads = torch.autograd.grad(ce_sum / global_count, params)
        for grad in hand_grads:
            torch.distributed.all_reduce(grad)
        hand_loss = ce_sum.detach().clone()
        torch.distributed.all_reduce(hand_loss)
        hand_loss = float(hand_loss / global_count)
        for module in fused:
            module.grad_into_main_grad = True

        for chunk in trainer.model:
            chunk.zero_grad_buffer()
        loss, tokens = reduce_reports(trainer._run_schedule(batches, forward_only=False), trainer.report_groups)
        assert tokens == int(global_count), (tokens, int(global_count))
        assert abs(loss - hand_loss) < 1e-5, (loss, hand_loss)
        for param, grad in zip(params, hand_grads):
            torch.testing.assert_close(param.main_grad, grad, rtol=1e-4, atol=1e-7)
    finally:
        destroy_distributed()


def test_loss_and_grads_equal_hand_computed_cross_entropy(tmp_path):
    spec = {"cfg": cfg_with(**{"trainer.global_batch_size": 8}), "run_dir": str(tmp_path / "run")}
    start_ranks(loss_worker, args=(2, free_port(), spec), nprocs=2)


# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tp2_pp2_and_interleaved_pp_match_tp1(tmp_path):
    base = run(tmp_path, "tp1")
    assert len(losses(base)) == 5 and losses(base)[-1] < losses(base)[0]
    layouts = {"tp2": {"parallel.tp": 2}, "pp2": {"parallel.pp": 2}, "pp2-vpp2": {"parallel.pp": 2, "parallel.vpp": 2}}
    for name, overrides in layouts.items():
        other = run(tmp_path, name, world=2, cfg=cfg_with(**overrides))
        assert losses(other) == pytest.approx(losses(base), abs=1e-4), name
        assert losses(other, "eval") == pytest.approx(losses(base, "eval"), abs=1e-4), name


RESUME_CFG = {"trainer.max_steps": 6, "trainer.save_interval": 2, "trainer.keep_last": 2}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """6 steps, DP=2, no interruption."""
    return run(tmp_path_factory.mktemp("straight"), "straight", world=2, cfg=cfg_with(**RESUME_CFG))


def assert_same_run(resumed: dict, straight: dict) -> None:
    keys = ("step", "split", "loss", "tokens", "lr", "grad_norm")

    def project(result):
        return [{k: r.get(k) for k in keys} for r in result["records"]]

    assert project(resumed) == project(straight)  # every (step, split) exactly once, equal values
    for rank in (0, 1):
        a = torch.load(resumed["out"] / f"weights_rank{rank}.pt")
        b = torch.load(straight["out"] / f"weights_rank{rank}.pt")
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
def test_exact_resume_after_two_preemption_signals(tmp_path, straight_run):
    """Stopped at step 3, resumed and stopped again at step 5 (a resume of a resumed run), resumed to the end:
    the same run as the straight one. On Slurm the requeue path is preempted once per test
    (tests/slurm/test_slurm_two_nodes.py)."""
    from afm_core.engine.checkpoint_dirs import complete_checkpoints

    run_dir = tmp_path / "run"
    first = run(tmp_path, "first", world=2, run_dir=run_dir, cfg=cfg_with(**RESUME_CFG), stop_at_step=3)
    assert first["summary"]["stopped_early"] and first["summary"]["step"] == 3
    assert [step for step, _ in complete_checkpoints(run_dir / "checkpoints")] == [2, 3]
    second = run(tmp_path, "second", world=2, run_dir=run_dir, cfg=cfg_with(**RESUME_CFG), stop_at_step=5)
    assert second["summary"]["resumed_from"].endswith("step_00000003")
    assert second["summary"]["stopped_early"] and second["summary"]["step"] == 5
    assert [step for step, _ in complete_checkpoints(run_dir / "checkpoints")] == [4, 5]  # keep_last=2
    third = run(tmp_path, "third", world=2, run_dir=run_dir, cfg=cfg_with(**RESUME_CFG))
    assert third["summary"]["resumed_from"].endswith("step_00000005")
    assert third["summary"]["eval_loss_before"] == losses(straight_run, "eval")[0]
    assert_same_run(third, straight_run)
    assert [step for step, _ in complete_checkpoints(run_dir / "checkpoints")] == [5, 6]
    assert (run_dir / "loss.png").stat().st_size > 0


@pytest.mark.slow
def test_crash_during_checkpoint_write_keeps_previous(tmp_path, straight_run):
    from afm_core.engine.checkpoint_dirs import (
        COMPLETE_MARKER,
        complete_checkpoints,
        directory_bytes,
        latest_complete_checkpoint,
        measured_write_speed,
        read_marker,
    )

    run_dir = tmp_path / "run"
    with pytest.raises(mp.ProcessRaisedException, match="No space left on device"):
        run(tmp_path, "crashed", world=2, run_dir=run_dir, cfg=cfg_with(**RESUME_CFG), crash_on_save=2)
    checkpoints = run_dir / "checkpoints"
    assert [step for step, _ in complete_checkpoints(checkpoints)] == [2]
    assert (checkpoints / ".tmp-step_00000004").is_dir()  # the torn save, ignored
    assert latest_complete_checkpoint(checkpoints).name == "step_00000002"
    # the marker measures the save (what jobs.plan sizes the USR2 lead with on a resubmission)
    marker, saved = read_marker(checkpoints / "step_00000002"), checkpoints / "step_00000002"
    assert marker["bytes"] == directory_bytes(saved) - (saved / COMPLETE_MARKER).stat().st_size > 0
    assert marker["write_s"] > 0 and marker["nodes"] == 1
    speed = measured_write_speed(checkpoints)
    assert speed["gb_s_per_node"] == marker["bytes"] / marker["write_s"] / 1e9
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(logged) == 4  # lines past the checkpoint, to be dropped on resume

    resumed = run(tmp_path, "resumed", world=2, run_dir=run_dir, cfg=cfg_with(**RESUME_CFG))
    assert resumed["summary"]["resumed_from"].endswith("step_00000002")
    assert_same_run(resumed, straight_run)
    assert not list(checkpoints.glob(".tmp-*"))


@pytest.mark.slow
def test_bf16_tensor_parallel_resumes_exactly(tmp_path):
    """The GPU precision path on CPU: bf16 params (Float16Module, fp32 main weights in megatron's optimizer)."""
    import shutil

    cfg = cfg_with(**{"parallel.tp": 2, "trainer.max_steps": 4, "trainer.save_interval": 2})
    straight = run(tmp_path, "straight", world=2, cfg=cfg, bf16=True)
    assert all(math.isfinite(loss) for loss in losses(straight))
    run_dir = Path(straight["summary"]["checkpoint"]).parent.parent
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")  # as if killed after the step-2 checkpoint
    resumed = run(tmp_path, "resumed", world=2, run_dir=run_dir, cfg=cfg, bf16=True)
    assert resumed["summary"]["resumed_from"].endswith("step_00000002")

    def project(result):
        return [(r["step"], r["split"], r["loss"], r.get("grad_norm")) for r in result["records"]]

    assert project(resumed) == project(straight)
