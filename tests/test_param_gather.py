"""B3: with the distributed optimizer and ``overlap_param_gather`` each DP rank updates only its shard of the
parameters at ``optimizer.step()``; the rest arrive with the next forward. What reads the weights in between (the
weight sync to vLLM, an RL checkpoint, the HF export: :func:`afm_core.models.hf_weights.export_hf_weights`) must see
every rank's update. Real gloo world of DP=2, Megatron DDP + DistributedOptimizer with the GPU settings
(overlapped reduce and gather) forced on, as a GPU job with DP > 1 runs them."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks
from tests.test_train_engine import SyntheticBatches, loop_config, make_cfg, tiny_provider


def _worker(rank: int, world: int, port: int, run_dir: str, out: dict) -> None:
    set_rank_env(rank, world, port)
    from afm_core.engine import core as core_module
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.models.hf_weights import export_hf_weights
    from afm_core.train import trainer as trainer_module

    gpu_settings = core_module.ddp_config

    def overlapped(**kwargs):  # what ddp_config gives a GPU job with DP > 1
        return gpu_settings(**{**kwargs, "on_gpu": True})

    core_module.ddp_config = overlapped  # what the trainer core wraps the model with
    cfg = make_cfg(
        **{"trainer.global_batch_size": 4, "parallel.distributed_optimizer": True, "optim.warmup_ratio": 0.0}
    )
    layout = init_distributed(cfg.parallel, seed=cfg.trainer.seed, num_threads=1)
    try:
        chunks = core_module.build_model_chunks(tiny_provider(layout), layout)
        data = SyntheticBatches(seed=1, dp_rank=layout.dp_rank, mbs=cfg.trainer.micro_batch_size)
        trainer = trainer_module.SFTTrainer(loop_config(cfg), layout, chunks, data, [], run_dir, max_steps=5)
        assert trainer.core.ddp_config.overlap_param_gather and trainer.core.ddp_config.use_distributed_optimizer
        before = {name: t.clone() for name, t in export_hf_weights(trainer.model)}
        trainer.train_step()
        after = {name: t.clone() for name, t in export_hf_weights(trainer.model)}  # the weight sync's read
        sums = torch.tensor([float(after[n].double().sum()) for n in sorted(after)], dtype=torch.float64)
        gathered = [torch.zeros_like(sums) for _ in range(world)]
        torch.distributed.all_gather(gathered, sums)
        out[rank] = {
            "ranks_agree": all(torch.equal(g, gathered[0]) for g in gathered),
            "changed": sum(not torch.equal(before[n], after[n]) for n in after),
            "tensors": len(after),
        }
    finally:
        destroy_distributed()


def test_every_rank_exports_every_updated_parameter_after_a_distributed_optimizer_step(tmp_path):
    out = mp.Manager().dict()
    start_ranks(_worker, args=(2, free_port(), str(tmp_path), out), nprocs=2)
    for rank in (0, 1):
        assert out[rank]["ranks_agree"], out[rank]  # no rank sends another rank's stale shard
        assert out[rank]["changed"] == out[rank]["tensors"], out[rank]  # every tensor carries the update
