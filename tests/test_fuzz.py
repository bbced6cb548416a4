"""A property-based fuzzer over the server's own OpenAPI schema (schemathesis), and over tool and response
schemas (misshapen, oversized): whatever the body of a chat or completion request, the answer is never a 5xx
(nor a streamed internal error), every error has OpenAI's body, and afterwards no request is running and no KV
block is in use."""

import re
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_process import ServerProcess

EXAMPLES = 30  # per route and mode, bounded: the whole fuzz takes well under a minute on 2 cores
SCHEMA_EXAMPLES = 150  # tool and response schemas, over the three routes (about 15 s)


@pytest.fixture(scope="module")
def fuzz_server(tiny_checkpoint):
    # A short context keeps every generated request (n up to 128, any max_tokens) quick.
    srv = ServerProcess(tiny_checkpoint, "--max-model-len", "96").wait_ready()
    yield srv
    srv.stop()


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode))  # bodies that fit the schema, and not
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_no_request_body_gets_a_5xx_or_a_bare_error(fuzz_server, path, mode):
    operation = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")[path]["POST"]

    @given(case=operation.as_strategy(mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True, database=None)
    def answer_is_never_a_5xx(case):
        response = case.call(base_url=fuzz_server.url, timeout=120)
        assert response.status_code < 500, (case.body, response.text[:500])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text[:500]

    answer_is_never_a_5xx()


SCHEMA_KEYS = ["type", "properties", "items", "required", "anyOf", "enum", "additionalProperties", "$ref", "$defs",
               "city", "prefixItems", "format"]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(["string", "object", "array", "integer", "x"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(SCHEMA_KEYS), inner, max_size=4),
    max_leaves=12)
TOOL_SCHEMAS = st.one_of(
    JSON_VALUES,
    st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(st.sampled_from(
        ["city", "days", "a"]), JSON_VALUES, max_size=3)}),
    st.integers(1, 6000).map(lambda n: {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                                                          for i in range(n)}}),
)


def call(server, path: str, body: dict) -> httpx.Response:
    response = httpx.post(server.url + path, json=body, timeout=120)
    assert response.status_code < 500, (str(body)[:300], response.text[:500])
    assert not re.search(r'"type":\s*"internal_error"', response.text), (str(body)[:300], response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text[:500]
    return response


@given(schema=TOOL_SCHEMAS, choice=st.sampled_from(["auto", "required", "none", "named"]), stream=st.booleans(),
       route=st.sampled_from(["chat", "responses", "response_format"]))
@settings(max_examples=SCHEMA_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
          database=None)
def test_misshapen_and_oversized_schemas_never_get_a_5xx(server, schema, choice, stream, route):
    # (the server with the usual 512-token context: tool prompts do not fit the fuzz server's 96)
    function = {"name": "get_weather", "parameters": schema}
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    messages = [{"role": "user", "content": "weather?"}]
    if route == "chat":
        call(server, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 40,
                                                   "stream": stream, "tools": [{"type": "function", "function":
                                                                                function}],
                                                   "tool_choice": tool_choice})
    elif route == "responses":
        call(server, "/v1/responses", {"model": "tiny", "input": messages, "max_output_tokens": 8,
                                            "stream": stream, "tools": [{"type": "function", **function}]})
    else:
        call(server, "/v1/chat/completions", {
            "model": "tiny", "messages": messages, "max_tokens": 16, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})


def test_after_the_fuzz_nothing_runs_and_no_block_is_held(fuzz_server):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = fuzz_server.metrics()
        if (m["dsaserve:num_requests_running"], m["dsaserve:num_requests_waiting"],
                m["dsaserve:kv_cache_usage_perc"]) == (0, 0, 0):
            break
        time.sleep(0.2)
    assert (m["dsaserve:num_requests_running"], m["dsaserve:num_requests_waiting"],
            m["dsaserve:kv_cache_usage_perc"]) == (0, 0, 0)
    assert m["dsaserve:prompt_tokens_total"] > 0  # the fuzz did reach the engine
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
