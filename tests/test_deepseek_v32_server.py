"""`dsaserve serve` on a generated DeepSeek-V3.2 checkpoint (`dsaserve build-demo --model-type deepseek_v32`: no chat
template, so its own encoding), driven by the official openai client: thinking on and off, streamed and whole,
and tool calls written in DSML (held to the tools' schemas by the forced tool_choice's grammar, the weights being
random) parsed into `tool_calls`."""

import json
import subprocess
import sys

import httpx
import pytest
from openai import OpenAI
from server_process import ServerProcess

from dsaserve import LLM, SamplingParams
from dsaserve.deepseek_v32_chat import DeepseekV32Chat
from dsaserve.server.parsers import REASONING, OutputParser
from dsaserve.server.parsers.dsml import DEEPSEEK_V32

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "enum": [1, 2, 3]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
HELLO = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v32demo"))
    done = subprocess.run([sys.executable, "-m", "dsaserve", "build-demo", "--model-type", "deepseek_v32", path],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    srv = ServerProcess(checkpoint, "--max-model-len", "2048").wait_ready()  # the tools prompt is ~1K tokens
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(checkpoint):
    return LLM(checkpoint, dtype="float32", block_size=16, max_model_len=512, progress=False)


def offline_text(offline, messages, max_tokens, **kwargs) -> str:
    ids = offline.tokenizer.encode(DeepseekV32Chat().render(messages, **kwargs), add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return offline.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)[0].outputs[0].text


def streamed(client, **request) -> dict:
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reasoning += getattr(choice.delta, "reasoning_content", None) or ""
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return {"reasoning": reasoning, "content": content, "finish": finish,
            "calls": [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]}


def whole(client, **request) -> dict:
    choice = client.chat.completions.create(**request).choices[0]
    return {"reasoning": getattr(choice.message, "reasoning_content", None) or "",
            "content": choice.message.content or "", "finish": choice.finish_reason,
            "calls": [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]}


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_uses_the_families_encoding_and_parsers(client, offline, thinking):
    extra = {"extra_body": {"chat_template_kwargs": {"thinking": True}}} if thinking else {}
    request = dict(model="tiny", messages=HELLO, max_tokens=12, temperature=0, **extra)
    reply = client.chat.completions.create(**request)
    text = offline_text(offline, HELLO, 12, thinking=thinking)
    prompt = offline.tokenizer.encode(DeepseekV32Chat().render(HELLO, thinking=thinking), add_special_tokens=False)
    assert reply.usage.prompt_tokens == len(prompt)
    parser = OutputParser(DEEPSEEK_V32, start_in=REASONING if thinking else "content")
    expected = parser.feed(text, last=True)
    got = whole(client, **request)
    assert (got["reasoning"], got["content"]) == (expected.reasoning, expected.content)
    assert bool(got["reasoning"]) == thinking  # the prompt opened <think> only with thinking on
    assert {k: v for k, v in streamed(client, **request).items()} == got


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_dsml_tool_calls_reach_tool_calls(client, thinking, tool_choice):
    extra = {"extra_body": {"chat_template_kwargs": {"thinking": True}}} if thinking else {}
    request = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris, and the time?"}],
                   tools=[WEATHER, CLOCK], tool_choice=tool_choice, max_tokens=400, temperature=0, **extra)
    got = whole(client, **request)
    assert got["finish"] == "tool_calls" and got["calls"] and not got["content"] and not got["reasoning"]
    for name, arguments in got["calls"]:
        schema = {"get_weather": WEATHER, "get_time": CLOCK}[name]["function"]["parameters"]
        assert set(arguments) == set(schema["required"])
        for key, value in arguments.items():
            assert value in schema["properties"][key]["enum"]  # typed by the string flag: 2, not "2"
    if isinstance(tool_choice, dict):
        assert [name for name, _ in got["calls"]] == ["get_time"]
    assert streamed(client, **request) == got


def test_a_tool_round_trip_is_encoded_for_the_model(client, server, offline):
    """The assistant's call and the tool's result come back as DSML and <function_results> in the prompt."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=4)
    prompt = DeepseekV32Chat().render(messages, tools=[WEATHER])
    assert "<result>sunny</result>" in prompt and 'string="false">2</｜DSML｜parameter>' in prompt
    assert reply.usage.prompt_tokens == len(offline.tokenizer.encode(prompt, add_special_tokens=False))
    orphan = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]})
    assert orphan.status_code == 400 and "messages.1 is a tool result" in orphan.json()["error"]["message"]
