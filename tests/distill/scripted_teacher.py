"""A scripted teacher behind a real OpenAI-compatible ``/v1/chat/completions`` server on 127.0.0.1.

It plays every role of the MAS by reading the role and the run so far (the plain-text transcript) from the user
message, and answers each task as its script says:

- ``calls``: tool calls before the thinking agent answers;
- ``reflect``: the reflection agent rates the trajectory (False: it answers nothing);
- ``fix_after_check``: the first suggested answer is wrong (the verifier scores it 1), the one after the
  re-plan is right;
- ``wrong``: every suggested answer is wrong;
- ``repeat``: the search agent repeats one query.

The verifier scores 4 when the suggested answer contains the gold answer, else 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from aiohttp import web

from afm_core.tools.serving import start_site

REQUESTS = web.AppKey("requests", list)
"""The request bodies the server received, in order."""


def _reply(script: Mapping[str, Any], user: str) -> str:
    calls = len(re.findall(r"^Tool call ", user, re.MULTILINE))
    checks = len(re.findall(r"^Verification: ", user, re.MULTILINE))
    tool = "code" if script["task"] == "math" else "wiki_search"
    gold = script["gold"]
    right = f"\\boxed{{{gold}}}" if script["task"] == "math" else gold
    wrong = "\\boxed{-1}" if script["task"] == "math" else "Nobody"
    history, _, ask = user.rpartition("\n\nYou are the ")
    role = ask.split(".", 1)[0]
    user = history
    if role == "planning agent":
        return "1. Find the facts the task needs.\n2. Compute or look up the answer.\n3. Check it."
    if role == "thinking agent" and "NEXT:" in ask:
        if calls < script["calls"]:
            return f"I still miss a fact ({calls} calls so far).\nNEXT: {tool}"
        return "I have what I need.\nNEXT: answer"
    if role == "thinking agent":  # the suggestion
        if script.get("wrong") or (script.get("fix_after_check") and checks == 0):
            return f"Answer: {wrong}"
        return right
    if role == "search agent":
        return "first query" if script.get("repeat") else f"{script['keyword']} part {calls}"
    if role == "code agent":
        return f"```py\nprint({calls} + 1)\n```"
    if role == "reflection agent":
        if not script.get("reflect", True):
            return ""
        return ("Information conflict: good\nTool effectiveness: average\nTrajectory monitoring: good\n"
                "Keep following the plan.")  # fmt: skip
    if role == "verification agent":
        suggested = re.findall(r"Suggested answer: (.*)$", ask, re.MULTILINE)
        ok = bool(suggested) and gold.lower() in suggested[-1].lower()
        return "Score: 4. It matches the steps." if ok else "Score: 1. It does not follow from the steps."
    return ""


def scripted_app(scripts: Mapping[str, Mapping[str, Any]]) -> web.Application:
    """The server; ``scripts`` maps a question to its script (the question is found in the transcript)."""
    app = web.Application()
    app[REQUESTS] = []

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        app[REQUESTS].append(body)
        messages = body["messages"]
        user = messages[-1]["content"]
        script = next((s for question, s in scripts.items() if f"Task: {question}" in user), None)
        text = "" if script is None else _reply(script, user)
        return web.json_response({
            "id": f"chatcmpl-{len(app[REQUESTS])}", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(user.split()), "completion_tokens": len(text.split())},
        })  # fmt: skip

    app.router.add_post("/v1/chat/completions", completions)
    return app


@contextlib.contextmanager
def serve_in_thread(app: web.Application) -> Iterator[str]:
    """Serve ``app`` on a free 127.0.0.1 port from a thread with its own event loop; yields the ``/v1`` URL."""
    loop = asyncio.new_event_loop()
    started: dict[str, Any] = {}
    ready = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        started["runner"], started["url"] = loop.run_until_complete(start_site(app, "127.0.0.1", 0))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    ready.wait(30)
    try:
        yield started["url"] + "/v1"
    finally:
        asyncio.run_coroutine_threadsafe(started["runner"].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
