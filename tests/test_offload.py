"""B4: the trainer's parameters, gradient buffers and optimizer state leave device memory while the engine
generates and come back bit for bit; training goes on as if they had never left (real Megatron DDP + optimizer,
a one-rank gloo world; the same code frees GPU memory on a GPU)."""

from __future__ import annotations

import pytest
import torch

from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env_for_test
from tests.test_train_engine import SyntheticBatches, loop_config, make_cfg, tiny_provider


def _state(trainer) -> list[torch.Tensor]:
    from afm_core.engine.offload import _optimizer_tensors

    tensors = [p.detach().clone() for chunk in trainer.model for p in chunk.parameters()]
    return tensors + [t.detach().clone() for t in _optimizer_tensors(trainer.optimizer)]


@pytest.mark.parametrize("bf16", [False, True])
def test_offloaded_training_state_reloads_bit_for_bit_and_training_continues_identically(tmp_path, bf16, monkeypatch):
    from afm_core.engine.core import build_model_chunks
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.engine.offload import offload_training_state
    from afm_core.train.trainer import SFTTrainer

    set_rank_env_for_test(monkeypatch, free_port())
    cfg = make_cfg(**{"trainer.global_batch_size": 4})
    layout = init_distributed(cfg.parallel, seed=cfg.trainer.seed, num_threads=1)
    try:
        dtype = torch.bfloat16 if bf16 else torch.float32
        trainers = []
        for name in ("offloaded", "control"):
            chunks = build_model_chunks(tiny_provider(layout, params_dtype=dtype), layout)
            data = SyntheticBatches(seed=1, dp_rank=0, mbs=cfg.trainer.micro_batch_size)
            trainers.append(SFTTrainer(loop_config(cfg), layout, chunks, data, [], tmp_path / name, max_steps=5))
        offloaded, control = trainers
        first = [t.train_step()["loss"] for t in trainers]
        assert first[0] == first[1]
        before = _state(offloaded)
        n_params = len(list(offloaded.model[0].parameters()))
        assert len(before) == n_params * (4 if bf16 else 3)  # + Adam's two moments (+ the fp32 master weights)

        handle = offload_training_state(offloaded, enabled=True)
        assert handle.bytes >= sum(t.numel() * t.element_size() for t in before)
        assert all(p.untyped_storage().nbytes() == 0 for c in offloaded.model for p in c.parameters())
        handle.reload()

        after = _state(offloaded)
        assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
        second = [t.train_step() for t in trainers]
        assert second[0]["loss"] == second[1]["loss"] and second[0]["grad_norm"] == second[1]["grad_norm"]
        assert all(torch.equal(a, b) for a, b in zip(_state(offloaded), _state(control)))
        assert offload_training_state(offloaded, enabled=False).bytes == 0  # CPU ranks in production
    finally:
        destroy_distributed()
