"""Rank 0 finding no space for a checkpoint stops every rank with the same error at once (the other ranks waited
for it at the next barrier until the collective timeout). The full disk is simulated on rank 0 only: its
``shutil.disk_usage`` reports 0 bytes free; everything else is real (gloo world of 2, Megatron trainer, save)."""

from __future__ import annotations

import errno
import time
from collections import namedtuple

import torch.multiprocessing as mp

from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks
from tests.test_train_engine import SyntheticBatches, loop_config, make_cfg, tiny_provider


def _worker(rank: int, world: int, port: int, run_dir: str, out: dict) -> None:
    set_rank_env(rank, world, port)
    from afm_core.engine import checkpoint_dirs
    from afm_core.engine.core import build_model_chunks
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.train.trainer import SFTTrainer

    cfg = make_cfg(**{"trainer.global_batch_size": 4, "parallel.collective_timeout_min": 2})
    layout = init_distributed(cfg.parallel, seed=cfg.trainer.seed, num_threads=1)
    try:
        chunks = build_model_chunks(tiny_provider(layout), layout)
        data = SyntheticBatches(seed=1, dp_rank=layout.dp_rank, mbs=cfg.trainer.micro_batch_size)
        trainer = SFTTrainer(loop_config(cfg), layout, chunks, data, [], run_dir, max_steps=5)
        trainer.train_step()
        trainer.progress.step = 1
        trainer.save_checkpoint()  # a first checkpoint: the free-space check compares against its size
        if rank == 0:
            usage = namedtuple("usage", "total used free")
            checkpoint_dirs.shutil.disk_usage = lambda path: usage(1 << 40, 1 << 40, 0)  # type: ignore[assignment]
        trainer.progress.step = 2
        start = time.perf_counter()
        try:
            trainer.save_checkpoint()
        except OSError as err:
            out[rank] = (err.errno, str(err), time.perf_counter() - start)
    finally:
        destroy_distributed()


def test_no_space_on_rank_0_raises_on_every_rank_at_once(tmp_path):
    out = mp.Manager().dict()
    args = (2, free_port(), str(tmp_path / "run"), out)
    start_ranks(_worker, args=args, nprocs=2)
    for rank in (0, 1):
        code, message, seconds = out[rank]
        assert code == errno.ENOSPC and "no space for checkpoint step_00000002" in message, message
        assert seconds < 30, seconds  # not the collective timeout
    assert not (tmp_path / "run" / "checkpoints" / "step_00000002").exists()
