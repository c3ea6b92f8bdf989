"""The shared POST with retries of every OpenAI-compatible client (afm_core.utils.openai_api.post_json), against
a real aiohttp server on 127.0.0.1 that answers a scripted sequence of statuses."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from afm_core.utils.openai_api import EndpointError, endpoint, post_json


def _scripted_server(path: str, statuses: list[int], reply) -> tuple[TestServer, list[int]]:
    """A local server whose ``path`` answers the scripted ``statuses`` in turn (the last one repeats), 200 with
    ``await reply(request)``; the list counts the calls."""
    calls = [0]

    async def handler(request: web.Request) -> web.Response:
        status = statuses[min(calls[0], len(statuses) - 1)]
        calls[0] += 1
        if status == 200:
            return web.json_response(await reply(request))
        return web.Response(status=status, text=f"status {status}")

    app = web.Application()
    app.router.add_post(path, handler)
    return TestServer(app, host="127.0.0.1"), calls


async def _post(statuses: list[int], retries: int) -> tuple[object, int]:
    async def echo(request: web.Request) -> dict:
        return {"echo": await request.json()}

    test_server, calls = _scripted_server("/v1/completions", statuses, echo)
    async with test_server as server, aiohttp.ClientSession() as session:
        url = endpoint(str(server.make_url("")), "completions")
        try:
            return await post_json(session, url, {"x": 1}, {}, retries=retries), calls[0]
        except EndpointError as e:
            return e, calls[0]


def test_a_429_and_a_503_are_retried_then_the_reply_is_returned():
    reply, calls = asyncio.run(_post([429, 503, 200], retries=3))
    assert reply == {"echo": {"x": 1}} and calls == 3


def test_a_client_error_fails_at_once_with_the_url_and_status():
    error, calls = asyncio.run(_post([400, 200], retries=3))
    assert isinstance(error, EndpointError) and calls == 1
    assert "/v1/completions answered HTTP 400: status 400" in str(error)


def test_the_last_failure_is_raised_after_the_retries():
    error, calls = asyncio.run(_post([500], retries=2))
    assert isinstance(error, EndpointError) and calls == 3
    assert "no reply after 3 attempts (HTTP 500: status 500)" in str(error)


@pytest.mark.parametrize("url", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"])
def test_the_endpoint_url_ends_in_v1_and_the_path(url):
    assert endpoint(url, "chat/completions") == "http://h:8000/v1/chat/completions"


async def _judge(statuses: list[int], reply: str) -> tuple[object, int]:
    from afm_core.rewards.judge import LLMJudge

    async def completion(request: web.Request) -> dict:
        assert (await request.json())["model"] == "judge-model"
        return {"choices": [{"message": {"content": reply}}]}

    test_server, calls = _scripted_server("/v1/chat/completions", statuses, completion)
    async with test_server as server:
        judge = LLMJudge(str(server.make_url("/v1")), "judge-model", attempts=3)
        try:
            return await judge.judge("Capital of France?", "Paris", "paris"), calls[0]
        finally:
            await judge.close()


def test_the_llm_judge_retries_a_503_through_the_shared_post_and_reads_the_verdict():
    grade, calls = asyncio.run(_judge([503, 200], '{"rationale": "same city", "judgement": "correct"}'))
    assert calls == 2 and grade.score == 1.0 and grade.reason == "correct" and not grade.error


def test_the_llm_judge_turns_a_client_error_or_a_reply_without_verdict_into_a_judge_error():
    grade, calls = asyncio.run(_judge([400], ""))
    assert calls == 1 and grade.reason == "judge_error" and grade.error and "HTTP 400" in grade.extra["message"]
    grade, calls = asyncio.run(_judge([200], "no idea"))
    assert calls == 1 and grade.reason == "judge_error" and "no verdict" in grade.extra["message"]
