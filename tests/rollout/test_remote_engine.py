"""The OpenAI-compatible remote engine against a real aiohttp server on 127.0.0.1: token ids and logprobs from
vLLM's ``return_tokens_as_token_ids`` reply, and a pause at turn boundaries (the request in flight completes
normally, new ones are refused until the resume)."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestServer

from afm_core.rollout.engine import SamplingConfig
from afm_core.rollout.remote_engine import RemoteEngine


def _server(held: asyncio.Event, received: list[dict]) -> TestServer:
    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        received.append(body)
        if len(received) == 1:
            await held.wait()  # the first request stays in flight until the test lets it go
        ids = [7, 8, 9][: body["max_tokens"]]
        return web.json_response({"choices": [{
            "text": "abc"[: len(ids)], "finish_reason": "length", "stop_reason": None,
            "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [-0.5] * len(ids)},
        }]})  # fmt: skip

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return TestServer(app, host="127.0.0.1")


def test_the_remote_engine_pauses_at_turn_boundaries():
    async def scenario():
        held, received = asyncio.Event(), []
        async with _server(held, received) as server:
            engine = RemoteEngine(str(server.make_url("/v1")), "m", tokenizer=None, retries=0)
            try:
                in_flight = asyncio.ensure_future(engine.generate([1, 2], SamplingConfig(max_tokens=3), "a"))
                while not received:
                    await asyncio.sleep(0.01)
                pause = asyncio.ensure_future(engine.pause())
                await asyncio.sleep(0)  # the pause has begun
                refused = await engine.generate([1, 2], SamplingConfig(max_tokens=3), "b")
                assert not pause.done() and not in_flight.done()  # waits for the request in flight
                held.set()
                first = await in_flight
                await pause
                assert len(received) == 1  # the refused request never reached the server
                await engine.resume()
                after = await engine.generate([1, 2], SamplingConfig(max_tokens=2), "c")
                return refused, first, after, received
            finally:
                await engine.close()

    refused, first, after, received = asyncio.run(scenario())
    assert refused.paused and refused.finish_reason == "abort" and refused.token_ids == []
    assert not first.paused and first.finish_reason == "length"  # completed normally
    assert first.token_ids == [7, 8, 9] and first.logprobs == [-0.5] * 3 and "retokenized" not in first.extra
    assert after.token_ids == [7, 8] and len(received) == 2 and received[0]["prompt"] == [1, 2]
