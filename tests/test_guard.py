"""The server in-process: draining and slow bodies at the guard, and CPU work kept off the event loop."""

import asyncio
import json
from types import SimpleNamespace

import httpx

from dsaserve.chat_template import ChatTemplate
from dsaserve.server.app import GuardMiddleware, build_app
from dsaserve.server.metrics import ServerMetrics
from dsaserve.server.state import ServerConfig, ServerState


def guard(**config) -> tuple[GuardMiddleware, SimpleNamespace, list]:
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    state = SimpleNamespace(config=ServerConfig("tiny", **config), in_flight=0, last_activity=0.0, draining=False)
    return GuardMiddleware(app, state), state, reached


async def call(middleware, path: str, receive) -> tuple[int, dict | None]:
    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "method": "POST", "headers": []}
    await middleware(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body) if body else None


async def whole_body():
    return {"type": "http.request", "body": b"{}", "more_body": False}


def test_requests_that_arrive_while_draining_get_503():
    middleware, state, reached = guard()
    assert asyncio.run(call(middleware, "/v1/completions", whole_body))[0] == 204
    state.draining = True
    status, body = asyncio.run(call(middleware, "/v1/completions", whole_body))
    assert status == 503 and body["error"]["code"] == "server_shutting_down" and body["error"]["message"]
    assert asyncio.run(call(middleware, "/health", whole_body))[0] == 204  # probes still answer
    assert reached == ["/v1/completions", "/health"]


def test_a_body_that_does_not_arrive_in_time_is_a_408():
    middleware, state, reached = guard(body_timeout=0.2)

    async def never():
        await asyncio.sleep(3600)

    status, body = asyncio.run(call(middleware, "/v1/completions", never))
    assert status == 408 and body["error"]["code"] == "request_timeout" and not reached
    assert state.in_flight == 0


def test_rendering_and_tokenizing_run_off_the_event_loop(engine, monkeypatch):
    tokenizer = engine.tokenizer
    state = ServerState(engine, ServerConfig("tiny"), ChatTemplate(tokenizer.chat_template, tokenizer.special_tokens),
                        ServerMetrics(engine.stats, "tiny"))
    encode, on_loop = tokenizer.encode, []

    def recording_encode(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording_encode)

    async def main():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                               ("/v1/completions", {"prompt": "hello"})):
                r = await client.post(path, json={**body, "max_tokens": 2}, timeout=60)
                assert r.status_code == 200, r.text

    asyncio.run(main())
    assert on_loop and not any(on_loop)
