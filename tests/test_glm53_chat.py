"""GLM-5.3's chat format served end to end: the template always thinks (its generation prompt opens `<think>`)
and renders `reasoning_effort`; the reasoning the model writes without an opening tag comes back as
reasoning_content and never in content, whole or streamed.

The server runs the trained demo model with tests/data/glm-5.3-chat-template.jinja, a template written from
GLM-5.3's published description; the demo model answers it as it answers its own template.
"""

import json
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from server_process import ServerProcess

from dsaserve.chat_template import ChatTemplate
from dsaserve.demo import demo_model_dir
from dsaserve.demo.tasks import GREETING_REPLY, WEATHER_TOOL
from dsaserve.tokenizer import Tokenizer

TEMPLATE = Path(__file__).parent / "data" / "glm-5.3-chat-template.jinja"
HELLO = [{"role": "user", "content": "Hello!"}]
GREETING_REASONING = "The user greets me. I say who I am and what I can do."


@pytest.fixture(scope="module")
def template():
    return ChatTemplate(TEMPLATE.read_text())


@pytest.fixture(scope="module")
def glm53_server():
    server = ServerProcess(demo_model_dir(), "--max-model-len", "2048", "--served-model-name", "glm-5.3",
                           "--chat-template", str(TEMPLATE))
    yield server.wait_ready()
    server.stop()


@pytest.fixture(scope="module")
def client(glm53_server):
    return OpenAI(base_url=glm53_server.url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("effort, line", [("low", "low"), ("high", "high"), ("max", "max"), ("medium", "max"),
                                          ("xhigh", "max"), ("none", "max"), (None, "max")])
def test_the_template_renders_the_effort_it_knows_and_max_otherwise(template, effort, line):
    kwargs = {} if effort is None else {"reasoning_effort": effort}
    text = template.render(HELLO, **kwargs)
    assert f"Reasoning Effort: {line}<" in text
    assert text.count("Reasoning Effort:") == 1
    assert text.endswith("<|assistant|><think>")  # always thinking: the model starts inside its reasoning
    assert template.render(HELLO, enable_thinking=False, **kwargs) == text  # no switch to turn it off


def prompt_tokens(template, effort: str | None) -> int:
    tokenizer = Tokenizer(demo_model_dir())
    kwargs = {} if effort is None else {"reasoning_effort": effort}
    return len(tokenizer.encode(template.render(HELLO, **kwargs), add_special_tokens=False))


def test_reasoning_effort_reaches_the_template(client, template):
    assert prompt_tokens(template, "low") != prompt_tokens(template, "max")  # else this test could not tell
    for effort in ("low", "medium", None):
        extra = {} if effort is None else {"reasoning_effort": effort}
        reply = client.chat.completions.create(model="glm-5.3", messages=HELLO, max_tokens=2, temperature=0,
                                               **extra)
        assert reply.usage.prompt_tokens == prompt_tokens(template, effort), effort


def test_reasoning_without_an_opening_tag_never_reaches_content(client):
    reply = client.chat.completions.create(model="glm-5.3", messages=HELLO, max_tokens=80, temperature=0,
                                           reasoning_effort="high")
    message = reply.choices[0].message
    assert message.reasoning_content == GREETING_REASONING
    assert message.content == GREETING_REPLY
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="glm-5.3", messages=HELLO, max_tokens=80, temperature=0,
                                                reasoning_effort="high", stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        reasoning += (getattr(delta, "reasoning_content", None) or "") if delta else ""
        content += (delta.content or "") if delta else ""
    assert (reasoning, content) == (GREETING_REASONING, GREETING_REPLY)


def test_a_tool_call_after_the_reasoning(client):
    request = dict(model="glm-5.3", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                   tools=[WEATHER_TOOL], max_tokens=80, temperature=0, reasoning_effort="low")
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert "get_weather" in choice.message.reasoning_content and "</think>" not in choice.message.reasoning_content
    assert not choice.message.content
    name, arguments, reasoning = "", "", ""
    for chunk in client.chat.completions.create(**request, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for piece in delta.tool_calls or []:
                name += piece.function.name or ""
                arguments += piece.function.arguments or ""
    assert (name, json.loads(arguments), reasoning) == ("get_weather", {"city": "Paris"},
                                                         choice.message.reasoning_content)


def test_responses_api_takes_reasoning_effort(glm53_server, template):
    body = {"model": "glm-5.3", "input": "Hello!", "max_output_tokens": 80, "temperature": 0,
            "reasoning": {"effort": "low"}}
    response = httpx.post(glm53_server.url + "/v1/responses", json=body, timeout=120).json()
    assert response["reasoning"]["effort"] == "low"
    assert response["usage"]["input_tokens"] == prompt_tokens(template, "low")
    reasoning, message = response["output"]
    assert reasoning["content"][0]["text"] == GREETING_REASONING
    assert message["content"][0]["text"] == GREETING_REPLY


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": HELLO, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": HELLO, "reasoning_effort": 3}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": HELLO, "reasoning_effort": "low",
                              "chat_template_kwargs": {"reasoning_effort": "high"}}, "reasoning_effort"),
    ("/v1/responses", {"input": "Hello!", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ("/v1/responses", {"input": "Hello!", "reasoning": "high"}, "reasoning"),
])
def test_a_bad_effort_is_a_400_naming_it(glm53_server, path, body, param):
    response = httpx.post(glm53_server.url + path, json={"model": "glm-5.3", "max_tokens": 2, **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
