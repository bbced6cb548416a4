"""A property-based fuzzer over the server's own OpenAPI schema (schemathesis): whatever the body of a
chat or completion request, the answer is never a 5xx, every error has OpenAI's body, and afterwards
no request is running and no KV block is in use."""

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from server_process import ServerProcess

EXAMPLES = 30  # per route and mode, bounded: the whole fuzz takes well under a minute on 2 cores


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
