"""The server in-process: draining and slow bodies at the guard, and CPU work kept off the event loop."""

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from dsaserve.chat_template import ChatTemplate
from dsaserve.server.app import GuardMiddleware, build_app
from dsaserve.server.metrics import ServerMetrics
from dsaserve.server.parsers.glm import GLM47
from dsaserve.server.state import ServerConfig, ServerState


def guard(**config) -> tuple[GuardMiddleware, SimpleNamespace, list]:
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    state = SimpleNamespace(config=ServerConfig("tiny", **config), in_flight=0, running=0, last_activity=0.0,
                            draining=False)
    return GuardMiddleware(app, state), state, reached


async def call(middleware, path: str, receive) -> tuple[int, dict | None]:
    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "method": "POST", "headers": []}
    await middleware(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    if sent[0]["status"] == 503:  # every 503 says when to come back
        assert (b"retry-after", b"5") in sent[0]["headers"]
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
    assert state.in_flight == 0 and state.running == 0


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


TWO_CALLS = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
             "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>")


def fake_state(text: str):
    from dsaserve.outputs import CompletionOutput, RequestOutput

    async def generate(request):
        yield RequestOutput("id", None, [1, 2], [CompletionOutput(0, text, [5, 6, 7], finish_reason="stop")],
                          finished=True)

    return SimpleNamespace(generate=generate, config=SimpleNamespace(model_name="tiny"))


@pytest.mark.parametrize("parallel, expected",
                         [(None, ["Paris", "Rome"]), (True, ["Paris", "Rome"]), (False, ["Paris"])])
def test_parallel_tool_calls_false_keeps_the_first_call(parallel, expected):
    from dsaserve.server.chat import PreparedChat, chat_full, chat_stream
    from dsaserve.server.protocol import ChatCompletionRequest

    schemas = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}
    prepared = PreparedChat([1, 2], {"tool_format": GLM47, "tools": True, "tool_schemas": schemas})
    fields = {"messages": [{"role": "user", "content": "x"}]}
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    full = asyncio.run(chat_full(fake_state(TWO_CALLS), ChatCompletionRequest(**fields), "id", prepared, None))
    calls = full["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == expected

    async def collect(stream):
        return [line async for line in stream]

    request = ChatCompletionRequest(**fields, stream=True)
    lines = asyncio.run(collect(chat_stream(fake_state(TWO_CALLS), request, "id", prepared, None)))
    streamed = [call for line in lines if line.startswith("data: {")
                for choice in json.loads(line[6:])["choices"] for call in choice["delta"].get("tool_calls", [])]
    assert [json.loads(c["function"]["arguments"])["city"] for c in streamed] == expected


def test_continuous_usage_stats_put_usage_in_every_chunk():
    from dsaserve.server.chat import PreparedChat, chat_stream
    from dsaserve.server.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True,
                                    stream_options={"include_usage": True, "continuous_usage_stats": True})

    async def collect(stream):
        return [json.loads(line[6:]) async for line in stream if line.startswith("data: {")]

    chunks = asyncio.run(collect(chat_stream(fake_state("Hi there"), request, "id",
                                                     PreparedChat([1, 2], {"tool_format": GLM47}), None)))
    assert all("usage" in c for c in chunks)
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


def test_a_long_prompt_is_refused_after_tokenizing_only_a_prefix(tiny_checkpoint):
    from dsaserve.server.input_checks import encode_bounded
    from dsaserve.server.protocol import APIError
    from dsaserve.tokenizer import Tokenizer

    tokenizer, seen = Tokenizer(tiny_checkpoint), []
    encode = tokenizer.encode
    tokenizer.encode = lambda text, **kwargs: seen.append(len(text)) or encode(text, **kwargs)
    text = "x " * 50_000  # far more than 512 tokens, yet within the character bound
    with pytest.raises(APIError) as caught:
        encode_bounded(tokenizer, text, 512, 10**9, "prompt")
    assert caught.value.param == "prompt" and "first 4096 characters" in caught.value.message
    assert seen == [4096]  # the whole text was never tokenized
    seen.clear()
    assert encode_bounded(tokenizer, "x " * 100, 512, 10**9, "prompt") == encode("x " * 100)
    assert seen == [200]
