"""The second hostile probe against a real server: each test is one of its findings (stored responses, tool
schemas, oversized schemas, header deadlines and connection caps, Host headers). Shutdown is in
test_shutdown.py."""

import socket
import time

import httpx
import pytest
from server_process import ServerProcess

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def limited(tiny_checkpoint):
    srv = ServerProcess(tiny_checkpoint, "--header-timeout", "1", "--max-connections", "4",
                        "--api-key", "k").wait_ready()
    yield srv
    srv.stop()


def post(server, path, body, **kwargs):
    return httpx.post(server.url + path, json=body, timeout=120, **kwargs)


def error_of(response, status, param):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"], error
    return error


def chat(**fields):
    return {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 8, **fields}


def tool(parameters):
    return {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}


# ---- finding 1: stored responses ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["function_call", "function_call_output"])
def test_finding1_a_huge_call_id_is_a_400_and_is_not_stored(server, kind):
    call_id = "c" * 4_000_000
    items = [{"role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    index = 1 if kind == "function_call" else 2
    items[index]["call_id"] = call_id
    r = post(server, "/v1/responses", {"model": "tiny", "input": items, "tools": [WEATHER], "max_output_tokens": 1})
    assert "4000000 characters" in error_of(r, 400, f"input.{index}.call_id")["message"]


def test_finding1_a_huge_tool_call_id_in_chat_is_a_400(server):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "tool_calls": [{"id": "c" * 100_000, "type": "function",
                                                      "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    error_of(post(server, "/v1/chat/completions", chat(messages=messages)), 400, "messages.1.tool_calls.0.id")


# ---- finding 2: tool schemas are checked on arrival ---------------------------------------------------------

BAD_SCHEMAS = [
    ({"type": "object", "properties": {"city": "string"}}, "function.parameters.properties.city"),
    ({"type": "object", "properties": {"a": 5}}, "function.parameters.properties.a"),
    ({"type": "object", "properties": {"a": {"items": [1]}}}, "function.parameters.properties.a.items.0"),
    ({"type": "object", "properties": {"a": {"type": "strnig"}}}, "function.parameters.properties.a.type"),
    ({"type": "object", "properties": {"a": {"anyOf": {"type": "string"}}}}, "function.parameters.properties.a.anyOf"),
    ({"type": "object", "required": "city"}, "function.parameters.required"),
]


@pytest.mark.parametrize("parameters, where", BAD_SCHEMAS)
@pytest.mark.parametrize("tool_choice, stream", [("auto", False), ("auto", True), ("required", False)])
def test_finding2_a_misshapen_tool_schema_is_a_400_naming_where(server, parameters, where, tool_choice, stream):
    r = post(server, "/v1/chat/completions", chat(tools=[tool(parameters)], tool_choice=tool_choice, stream=stream))
    assert error_of(r, 400, "tools.0.function.parameters")["message"].startswith(f"tools.0.{where} ")


def test_finding2_a_misshapen_tool_schema_is_a_400_on_responses(server):
    body = {"model": "tiny", "input": "weather?", "max_output_tokens": 4,
            "tools": [{"type": "function", "name": "get_weather", "parameters": BAD_SCHEMAS[0][0]}]}
    r = post(server, "/v1/responses", body)
    assert r.status_code == 400 and "properties.city" in r.json()["error"]["message"], r.text


def test_finding2_a_well_formed_schema_with_a_forced_call_still_answers(server):
    r = post(server, "/v1/chat/completions", chat(tools=[WEATHER], tool_choice="required", max_tokens=40))
    assert r.status_code == 200, r.text


# ---- finding 3: every size check is a 400 ------------------------------------------------------------------

def wide_schema(n=5000):
    return {"type": "object", "properties": {f"field_{i:05d}": {"type": "string"} for i in range(n)}}


def test_finding3_an_oversized_json_schema_is_a_400(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": wide_schema()}}
    r = post(server, "/v1/chat/completions", chat(response_format=fmt))
    assert "characters" in error_of(r, 400, "response_format.json_schema.schema")["message"]
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4, "response_format": fmt})
    error_of(r, 400, "response_format.json_schema.schema")


def test_finding3_an_oversized_tool_schema_with_a_forced_call_is_a_400(server):
    r = post(server, "/v1/chat/completions", chat(tools=[tool(wide_schema())], tool_choice="required"))
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text


# ---- finding 6: headers that do not arrive, connections past the cap --------------------------------------

def test_finding6_a_connection_without_complete_headers_is_closed(limited):
    with socket.create_connection(("127.0.0.1", limited.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the rest
        started = time.monotonic()
        assert s.recv(1024) == b""  # closed by the server
        assert time.monotonic() - started < 5
    # a slow request that does send its headers in time is answered
    with socket.create_connection(("127.0.0.1", limited.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(0.5)
        s.sendall(b"Host: 127.0.0.1\r\n\r\n")
        assert s.recv(1024).startswith(b"HTTP/1.1 200")


def test_finding6_a_connection_past_the_cap_gets_a_503_in_openai_form(limited):
    held = [socket.create_connection(("127.0.0.1", limited.port), timeout=10) for _ in range(4)]
    try:
        time.sleep(0.2)
        r = httpx.get(limited.url + "/health", timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["code"] == "too_many_connections"
    finally:
        for s in held:
            s.close()
    time.sleep(1.5)  # (the header deadline would close them anyway)
    assert httpx.get(limited.url + "/health", timeout=10).status_code == 200


# ---- finding 7: Host headers and a doubled Authorization ------------------------------------------------

@pytest.mark.parametrize("host, status", [("evil.example", 400), ("evil.example:8000", 400), ("localhost", 200),
                                          ("127.0.0.1:1234", 200), ("[::1]:80", 200), ("LOCALHOST", 200)])
def test_finding7_a_loopback_server_answers_only_loopback_hosts(server, host, status):
    r = httpx.get(server.url + "/v1/models", headers={"host": host}, timeout=10)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["code"] == "invalid_host"


def test_finding7_allowed_hosts_widens_the_list(tiny_checkpoint):
    srv = ServerProcess(tiny_checkpoint, "--allowed-hosts", '["api.example"]').wait_ready()
    try:
        assert httpx.get(srv.url + "/v1/models", headers={"host": "api.example"}, timeout=10).status_code == 200
        assert httpx.get(srv.url + "/v1/models", headers={"host": "localhost"}, timeout=10).status_code == 400
    finally:
        srv.stop()


def test_finding7_two_authorization_headers_are_a_400(limited):
    headers = [("authorization", "Bearer nope"), ("authorization", "Bearer k")]
    r = httpx.get(limited.url + "/v1/models", headers=headers, timeout=10)
    assert error_of(r, 400, "authorization")
    assert httpx.get(limited.url + "/v1/models", headers={"authorization": "Bearer k"}, timeout=10).status_code == 200

