"""The OpenAI-compatible server, as a real process on 127.0.0.1, driven by the official openai client."""

import asyncio
import json
import time

import httpx
import openai
import pytest
from server_process import ServerProcess

from dsaserve import LLM, SamplingParams
from dsaserve.chat_template import ChatTemplate
from dsaserve.server.parsers import OutputParser
from dsaserve.server.parsers.glm import GLM47

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_checkpoint):
    return LLM(tiny_checkpoint, dtype="float32", block_size=16, max_model_len=512, progress=False)


def offline_text(offline, ids, max_tokens, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)
    return offline.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)[0].outputs[0]


def rendered_ids(offline, messages, **kwargs):
    template = ChatTemplate(offline.tokenizer.chat_template, offline.tokenizer.special_tokens)
    return offline.tokenizer.encode(template.render(messages, **kwargs), add_special_tokens=False)


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"}]


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_chat_equals_offline_generation(client, offline):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    out = offline_text(offline, rendered_ids(offline, MESSAGES), 16)
    parser = OutputParser(GLM47, tools=False)
    parsed = [parser.feed(out.text), parser.finish()]
    choice = resp.choices[0]
    assert choice.message.content == "".join(p.content for p in parsed)
    assert (getattr(choice.message, "reasoning_content", None) or "") == "".join(p.reasoning for p in parsed)
    assert choice.finish_reason == out.finish_reason
    assert resp.usage.prompt_tokens == len(rendered_ids(offline, MESSAGES))
    assert resp.usage.completion_tokens == len(out.token_ids)


def test_chat_streaming_equals_non_streaming(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    content, reasoning, finish, usage = "", "", None, None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            finish = c.finish_reason or finish
    assert content == (whole.choices[0].message.content or "")
    assert reasoning == (getattr(whole.choices[0].message, "reasoning_content", None) or "")
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens == 24


def test_completions_list_of_prompts_n2_logprobs_stop(client, offline):
    prompts = ["The quick brown fox", "Paris is"]
    resp = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0, n=2, logprobs=2,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        expected = offline_text(offline, offline.tokenizer.encode(prompt), 8, ignore_eos=True)
        for choice in resp.choices[2 * i : 2 * i + 2]:
            assert choice.text == expected.text and choice.finish_reason == "length"
            assert len(choice.logprobs.tokens) == 8 and len(choice.logprobs.top_logprobs[0]) == 2
            assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert resp.usage.completion_tokens == 32
    text = resp.choices[0].text
    stop = text[3:5]
    stopped = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=8, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].text == text[: text.find(stop)] and stopped.choices[0].finish_reason == "stop"


def test_completions_token_id_prompts_and_echo(client, offline):
    ids = offline.tokenizer.encode("hello world")
    resp = client.completions.create(model="tiny", prompt=[ids], max_tokens=4, temperature=0, echo=True,
                                     extra_body={"ignore_eos": True})
    expected = offline_text(offline, ids, 4, ignore_eos=True)
    assert resp.choices[0].text == offline.tokenizer.decode(ids, skip_special_tokens=False) + expected.text


def test_chat_logprobs_shape(client):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3 and isinstance(item.bytes, list)
        assert item.top_logprobs[0].logprob == max(t.logprob for t in item.top_logprobs)


def test_tools_are_rendered_into_the_prompt(client, offline):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=2, temperature=0)
    with_tools = rendered_ids(offline, MESSAGES, tools=TOOLS)
    assert resp.usage.prompt_tokens == len(with_tools) > len(rendered_ids(offline, MESSAGES))
    assert "get_weather" in offline.tokenizer.decode(with_tools)


def test_named_tool_choice_forces_the_call(client, offline):
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=6, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    # The prompt ends with the opened call, so whatever the (random) model writes is parsed as that call.
    ids = rendered_ids(offline, MESSAGES, tools=TOOLS)
    assert resp.usage.prompt_tokens > len(ids)


# ---- bad input ---------------------------------------------------------------------------------------

GOOD_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def chat(**changes):
    body = json.loads(json.dumps(GOOD_CHAT))
    for key, value in changes.items():
        if value is DELETE:
            body.pop(key, None)
        else:
            body[key] = value
    return ("/v1/chat/completions", body)


DELETE = object()
BAD_REQUESTS = [
    # (path, body or raw bytes, status, param or None)
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2, 3]", 400, None),
    ("/v1/completions", b"", 400, None),
    (*chat(messages=DELETE), 400, "messages"),
    (*chat(messages=[]), 400, "messages"),
    (*chat(messages="hi"), 400, "messages"),
    (*chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    (*chat(messages=[{"role": "user", "content": 5}]), 400, "messages.0.content"),
    (*chat(model="gpt-9"), 404, "model"),
    (*chat(max_tokens=0), 400, "max_tokens"),
    (*chat(max_tokens="ten"), 400, "max_tokens"),
    (*chat(max_tokens=1.5), 400, "max_tokens"),
    (*chat(temperature=-0.5), 400, "temperature"),
    (*chat(temperature="hot"), 400, "temperature"),
    (*chat(top_p=0), 400, "top_p"),
    (*chat(top_k=-5), 400, "top_k"),
    (*chat(n=0), 400, "n"),
    (*chat(n=1000), 400, "n"),
    (*chat(logprobs="yes"), 400, "logprobs"),
    (*chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    (*chat(top_logprobs=2), 400, "top_logprobs"),
    (*chat(presence_penalty=5), 400, "presence_penalty"),
    (*chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    (*chat(logit_bias={"5": 500}), 400, "logit_bias"),
    (*chat(stop=[""]), 400, "stop"),
    (*chat(stop=7), 400, "stop"),
    (*chat(tools=[{"type": "function"}]), 400, "tools.0.function"),
    (*chat(tools=[{"type": "retrieval", "function": {"name": "x"}}]), 400, "tools.0.type"),
    (*chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), 400, "tools.0.function.name"),
    (*chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]), 400,
     "tools.0.function.parameters"),
    (*chat(tool_choice="required"), 400, "tool_choice"),
    (*chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), 400, "tool_choice"),
    (*chat(messages=[{"role": "user", "content": "word " * 1000}]), 400, "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": [10**7], "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [], "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/nothing", {}, 404, None),
]


def test_bad_requests_get_openai_errors_and_the_server_recovers(server):
    assert len(BAD_REQUESTS) >= 25
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path, body, status, param in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = http.post(path, json=body)
            assert r.status_code == status, (path, body, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], r.text
            if param is not None:
                assert error["param"] == param, (body, error)
        big = http.post("/v1/completions", content=b"x" * (9 << 20), headers={"content-type": "application/json"})
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        good = http.post("/v1/chat/completions", json=GOOD_CHAT)
        assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert wait_for_idle(server)


def test_max_tokens_over_the_context_is_a_400_and_omitted_fills_it(server):
    prompt = {"model": "tiny", "prompt": "x " * 100, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={**prompt, "max_tokens": 10000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "maximum context length is 512" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", timeout=60, json=prompt)  # no max_tokens: what fits
    assert r.status_code == 200
    body = r.json()
    assert body["usage"]["total_tokens"] == 512 and body["choices"][0]["finish_reason"] == "length"


def wait_for_idle(server, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if m.get("dsaserve:kv_cache_usage_perc") == 0 and m.get("dsaserve:num_requests_running") == 0 \
                and m.get("dsaserve:num_requests_waiting") == 0:
            return True
        time.sleep(0.2)
    return False


def test_fifty_streaming_clients_disconnecting(server):
    async def disconnect_after_two_chunks(http, i):
        body = {"model": "tiny", "prompt": f"story number {i}", "max_tokens": 200, "stream": True,
                "ignore_eos": True, "temperature": 0.8}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 2:
                        return  # leaving the block closes the connection mid-generation

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            await asyncio.gather(*(disconnect_after_two_chunks(http, i) for i in range(50)))

    asyncio.run(main())
    assert wait_for_idle(server)
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.metrics()["dsaserve:generation_tokens_total"] < 50 * 200  # aborted, not run to the end


def test_metrics_parse_and_move(server, client):
    before = server.metrics()
    client.completions.create(model="tiny", prompt="count me", max_tokens=5, extra_body={"ignore_eos": True})
    after = server.metrics()
    assert after["dsaserve:generation_tokens_total"] == before["dsaserve:generation_tokens_total"] + 5
    assert after["dsaserve:prompt_tokens_total"] > before["dsaserve:prompt_tokens_total"]
    assert (after["dsaserve:time_to_first_token_seconds_count"]
            == before["dsaserve:time_to_first_token_seconds_count"] + 1)
    assert (after["dsaserve:inter_token_latency_seconds_count"]
            >= before["dsaserve:inter_token_latency_seconds_count"] + 1)
    for name in ("dsaserve:kv_cache_usage_perc", "dsaserve:prefix_cache_hit_rate", "dsaserve:num_preemptions_total"):
        assert name in after


def test_api_key(tiny_checkpoint):
    srv = ServerProcess(tiny_checkpoint, "--api-key", "sekrit").wait_ready()
    try:
        r = httpx.get(srv.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert ok.completions.create(model="tiny", prompt="hi", max_tokens=2).choices
        assert httpx.get(srv.url + "/health").status_code == 200  # health stays open for probes
    finally:
        srv.stop()


def test_idle_shutdown_exits_cleanly(tiny_checkpoint):
    srv = ServerProcess(tiny_checkpoint, "--idle-shutdown", "2").wait_ready()
    httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=60)
    start = time.monotonic()
    code = srv.proc.wait(timeout=60)
    assert code == 0 and time.monotonic() - start >= 1.0
    srv.stop()


def test_sigterm_finishes_in_flight_requests_and_exits_cleanly(tiny_checkpoint):
    import threading

    srv = ServerProcess(tiny_checkpoint).wait_ready()
    result = {}

    def long_request():
        body = {"model": "tiny", "prompt": "go", "max_tokens": 150, "ignore_eos": True}
        result["response"] = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(0.5)
    srv.proc.terminate()
    thread.join(120)
    assert srv.proc.wait(60) == 0
    response = result["response"]
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 150
    srv.stop()


def test_non_streaming_client_disconnect_aborts(server):
    body = {"model": "tiny", "prompt": "a long one", "max_tokens": 400, "ignore_eos": True}
    before = server.metrics()["dsaserve:generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    assert wait_for_idle(server, timeout=10)
    assert server.metrics()["dsaserve:generation_tokens_total"] - before < 400


def test_thinking_switch_reaches_the_template(client, offline):
    off = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    on = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0)
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + 1  # the closing </think> token
    assert (getattr(off.choices[0].message, "reasoning_content", None) or "") == ""


def test_bench_serve_against_the_server(server, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "serve.json"
    result = subprocess.run([sys.executable, "-m", "dsaserve", "bench", "serve", "--base-url", server.url,
                             "--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--max-concurrency", "2",
                             "--output-json", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["completed"] == 4 and data["errors"] == 0 and data["output_tokens_per_s"] > 0
    assert data["ttft_ms_p50"] > 0 and data["tpot_ms_p99"] >= data["tpot_ms_p50"]


def test_chat_template_override_file(tmp_path, offline):
    from dsaserve.server.launcher import load_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                    "{% if add_generation_prompt %}[assistant]{% endif %}")

    class FakeEngine:
        tokenizer, model_config = offline.tokenizer, offline.engine.config

    template = load_chat_template(FakeEngine(), str(path))
    assert template.render([{"role": "user", "content": "hi"}]) == "[user]hi[assistant]"
    sandboxed = load_chat_template(FakeEngine(), None)
    assert sandboxed.render([{"role": "user", "content": "hi"}]).startswith("[gMASK]<sop>")


def test_chat_template_is_sandboxed(tmp_path):
    from dsaserve.chat_template import ChatTemplate, ChatTemplateError

    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        evil.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no system"):
        ChatTemplate("{{ raise_exception('no system') }}").render([])


def test_engine_refusals_are_400s_before_the_stream_starts(server):
    bad = {"model": "tiny", "prompt": "x", "max_tokens": 3, "stream": True, "logit_bias": {"-1000000": 5}}
    r = httpx.post(server.url + "/v1/completions", json=bad, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    long = {"model": "tiny", "prompt": "word " * 1000, "max_tokens": 3}
    r = httpx.post(server.url + "/v1/completions", json=long, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 2},
                      timeout=60).status_code == 200


def test_an_error_inside_a_started_stream_is_reported_and_the_stream_ends():
    from types import SimpleNamespace

    from dsaserve.engine.async_llm_engine import EngineStepError
    from dsaserve.outputs import CompletionOutput, RequestOutput
    from dsaserve.server.chat import PreparedChat, chat_stream
    from dsaserve.server.completions import PreparedPrompt, completion_stream
    from dsaserve.server.protocol import ChatCompletionRequest, CompletionRequest

    async def failing_generate(request):
        yield RequestOutput("id", None, [1, 2], [CompletionOutput(0, "Hi", [5])], finished=False)
        raise EngineStepError("simulated device error")

    state = SimpleNamespace(generate=failing_generate, config=SimpleNamespace(model_name="tiny"))

    async def collect(stream):
        return [line async for line in stream]

    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True)
    prepared = PreparedChat([1, 2], {"tool_format": GLM47, "tools": False})
    lines = asyncio.run(collect(chat_stream(state, chat, "id", prepared, None)))
    completion = CompletionRequest(prompt="x", stream=True)
    lines2 = asyncio.run(collect(completion_stream(state, completion, "id", [PreparedPrompt([1, 2], "x")], [None])))
    for out in (lines, lines2):
        assert '"Hi"' in "".join(out)
        error = json.loads(out[-2][len("data: "):])["error"]
        assert error["type"] == "internal_error" and "simulated device error" in error["message"]
        assert out[-1] == "data: [DONE]\n\n"


def test_image_content_is_a_400_that_says_it_is_not_served(server):
    """An image part (GLM-5.3-Flash ships a vision tower; dsaserve serves the text model) is refused by name, not with
    pydantic's "Input should be 'text'", and the server keeps serving."""
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [part]}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages.0.content" and "'image_url' content is not served yet" in error["message"]
    ok = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert httpx.post(server.url + "/v1/chat/completions", json=ok, timeout=60).status_code == 200
