"""Hostile requests against a real server: each test is one row of the hardening issue's table, and the
blast radius of a bad request is that request (other streams finish with all their tokens)."""

import json
import threading

import httpx
import pytest
from server_process import ServerProcess

KEY = "clé-🔑-secret"


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint):
    srv = ServerProcess(tiny_checkpoint, "--api-key", KEY).wait_ready()
    yield srv
    srv.stop()


def post(server, path, body, **kwargs):
    """Sends the body as JSON text with lone surrogates escaped (as JSON allows)."""
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(server.url + path, content=json.dumps(body), headers=headers, timeout=120, **kwargs)


def chat(**fields):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def error_of(response, status, param):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"], error
    return error


class Streams:
    """Four streaming completions running in the background while a test sends its hostile request."""

    def __init__(self, server, tokens=40):
        self.results = {}
        self.threads = [threading.Thread(target=self._stream, args=(server, i, tokens)) for i in range(4)]
        self.started = threading.Barrier(5)
        for t in self.threads:
            t.start()
        self.started.wait(60)

    def _stream(self, server, i, tokens):
        body = {"model": "tiny", "prompt": f"stream number {i}", "max_tokens": tokens, "ignore_eos": True,
                "stream": True, "temperature": 0, "stream_options": {"include_usage": True}}
        finish, used, waited = None, None, False
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                if not waited:  # every stream has started before the hostile request goes out
                    self.started.wait(60)
                    waited = True
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    finish = "error: " + chunk["error"]["message"]
                for choice in chunk.get("choices", []):
                    finish = choice["finish_reason"] or finish
                if chunk.get("usage"):
                    used = chunk["usage"]["completion_tokens"]
        self.results[i] = (finish, used)

    def all_finished(self, tokens=40) -> bool:
        for t in self.threads:
            t.join(120)
        return self.results == {i: ("length", tokens) for i in range(4)}


# ---- rows 1–3: seeds and top_k the step cannot execute --------------------------------------------------


def test_row1_a_seed_past_64_bits_with_n_is_a_400_and_the_others_finish(server):
    streams = Streams(server)
    r = post(server, "/v1/chat/completions", chat(seed=2**64 - 1, n=2))
    error_of(r, 400, "seed")
    assert streams.all_finished(), streams.results


def test_row2_a_huge_top_k_means_all_tokens_and_the_others_finish(server):
    streams = Streams(server)
    r = post(server, "/v1/chat/completions", chat(top_k=2**63, top_p=0.5))
    assert r.status_code == 200, r.text
    assert streams.all_finished(), streams.results


def test_row3_a_seed_of_2_to_the_70_is_a_400(server):
    error_of(post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "seed": 2**70}), 400, "seed")


# ---- rows 4–6: text and template variables ----------------------------------------------------------------


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a\ud800b"}]), "messages.0.content"),
    ("/v1/completions", {"model": "tiny", "prompt": "\ud800"}, "prompt"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "description": "\udfff"}}]),
     "tools.0.function.description"),
    ("/v1/chat/completions", chat(model="\ud800"), "model"),
])
def test_rows4_5_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    error_of(post(server, path, body), 400, param)


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt"])
def test_row6_reserved_chat_template_kwargs_are_a_400(server, key):
    error_of(post(server, "/v1/chat/completions", chat(chat_template_kwargs={key: 1})), 400, "chat_template_kwargs")


# ---- row 7: a prompt far too long is refused before it is tokenized ---------------------------------------


def test_row7_an_absurd_prompt_is_refused_by_its_length_in_characters(server):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "word " * 1_000_000})
    error = error_of(r, 400, "prompt")
    assert "characters" in error["message"] and error["code"] == "context_length_exceeded"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ---- rows 9, 10, 13: parameters honoured or refused -----------------------------------------------------------


def test_row9_a_temperature_below_1e_5_is_greedy(server):
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 8, "ignore_eos": True}
    tiny = post(server, "/v1/completions", {**body, "temperature": 1e-45}).json()["choices"][0]
    greedy = post(server, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]
    assert tiny["finish_reason"] == "length" and tiny["text"] == greedy["text"] and tiny["text"]


@pytest.mark.parametrize("fields, param", [
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"best_of": 3}, "best_of"),
])
def test_row10_unsupported_fields_are_a_400(server, fields, param):
    error_of(post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, **fields}), 400, param)


def test_row10_prompt_logprobs_are_returned_on_completions(server):
    ids = [40, 41, 42, 43, 44]
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    positions = r.json()["choices"][0]["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None
    for token, entry in zip(ids[1:], positions[1:]):
        assert str(token) in entry and all(e["logprob"] <= 0 for e in entry.values())
        assert len(entry) <= 3  # the prompt's own token and the 2 most likely


def test_row13_max_tokens_over_the_context_is_a_400_naming_the_limit(server):
    r = post(server, "/v1/chat/completions", chat(max_tokens=100_000))
    assert "maximum context length is 512" in error_of(r, 400, "max_tokens")["message"]


# ---- rows 11, 12: browsers and keys -------------------------------------------------------------------------


def test_row11_cors_preflight_is_answered_without_the_key(keyed):
    r = httpx.options(keyed.url + "/v1/chat/completions", timeout=10, headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "https://app.example")
    denied = post(keyed, "/v1/chat/completions", chat(), headers={"Origin": "https://app.example"})
    assert denied.status_code == 401 and "access-control-allow-origin" in denied.headers


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_row12_the_scheme_is_case_insensitive_and_a_non_ascii_key_works(keyed, scheme):
    r = post(keyed, "/v1/chat/completions", chat(), headers={"Authorization": f"{scheme} {KEY}".encode()})
    assert r.status_code == 200, r.text
    wrong = post(keyed, "/v1/chat/completions", chat(), headers={"Authorization": f"{scheme} {KEY}x".encode()})
    assert wrong.status_code == 401


# ---- what a review found: one request must not be able to load every step ---------------------------------


@pytest.mark.parametrize("fields, param", [
    ({"stop": [f"s{i}" for i in range(65)]}, "stop"),
    ({"stop": ["x" * 1025]}, "stop"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
])
def test_per_step_lists_are_bounded(server, fields, param):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, **fields})
    assert "at most" in error_of(r, 400, param)["message"]


def test_one_request_holds_at_most_max_num_seqs_sequences(server):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": [[40, 41]] * 300, "max_tokens": 1})
    error_of(r, 400, "prompt")
    assert post(server, "/v1/completions", {"model": "tiny", "prompt": [[40, 41]] * 3, "n": 2,
                                            "max_tokens": 1}).status_code == 200


def test_min_tokens_with_every_token_a_stop_token_is_a_400(server):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": list(range(640))}
    error_of(post(server, "/v1/completions", body), 400, "stop_token_ids")


def test_a_template_variable_named_self_is_just_a_variable(server):
    r = post(server, "/v1/chat/completions", chat(chat_template_kwargs={"self": 1, "enable_thinking": False}))
    assert r.status_code == 200, r.text


def test_error_bodies_stay_valid_utf8_when_they_quote_a_surrogate(server):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "stop_token_ids": ["\ud800"]})
    assert r.status_code == 400
    r.content.decode("utf-8")  # strict: no lone surrogate escapes
    assert "\\ud800" not in r.text
