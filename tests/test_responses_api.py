"""POST /v1/responses through the official openai client: a round trip, the streamed events in order, a
function call round trip (call → tool output item → answer), and previous_response_id continuation."""

import json

import httpx
import openai
import pytest

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_a_string_input_round_trip(client):
    response = client.responses.create(model="tiny", input="Hello there", instructions="Be brief.",
                                       max_output_tokens=6, temperature=0)
    assert response.object == "response" and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 6 and response.usage.input_tokens > 0
    assert all(item.type in ("message", "reasoning", "function_call") for item in response.output)


def test_streamed_events_come_in_order_and_add_up_to_the_response(client):
    with client.responses.stream(model="tiny", input="Tell me something", max_output_tokens=12,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and final.status in ("completed", "incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind in ("response.output_item.added", "response.output_item.done"):
        assert kinds.count(kind) == len(final.output)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "".join(p.text for item in final.output if item.type == "message" for p in item.content)
    whole = client.responses.create(model="tiny", input="Tell me something", max_output_tokens=12, temperature=0)
    assert [i.type for i in whole.output] == [i.type for i in final.output]
    assert whole.output_text == final.output_text  # greedy: the same answer whole and streamed


@pytest.fixture(scope="module")
def engine512(tiny_checkpoint):
    from dsaserve.engine.async_llm_engine import AsyncLLMEngine
    from dsaserve.engine_args import EngineArgs

    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=tiny_checkpoint, dtype="float32", block_size=16,
                                                     max_model_len=512, progress=False))
    yield eng
    eng.shutdown()


def test_function_calls_come_out_as_items_whole_and_streamed(engine512):
    """The model's calls (here from a stand-in generator) become function_call items and their events."""
    import asyncio

    from dsaserve.chat_template import ChatTemplate
    from dsaserve.outputs import CompletionOutput, RequestOutput
    from dsaserve.server.metrics import ServerMetrics
    from dsaserve.server.responses_endpoint import ResponsesRequest, ResponseStore, respond
    from dsaserve.server.state import ServerConfig, ServerState

    tokenizer = engine512.tokenizer
    state = ServerState(engine512, ServerConfig("tiny"),
                        ChatTemplate(tokenizer.chat_template, tokenizer.special_tokens),
                        ServerMetrics(engine512.stats, "tiny"))
    text = "Let me check." + "".join(f"<tool_call>get_weather<arg_key>city</arg_key><arg_value>{c}</arg_value>"
                                     "</tool_call>" for c in ("Paris", "Rome"))

    async def generate(request):
        yield RequestOutput(request.request_id, None, [1], [CompletionOutput(0, text, [5, 6], finish_reason="stop")],
                            finished=True)

    state.generate = generate
    request = ResponsesRequest(model="tiny", input="Weather?", tools=[WEATHER_TOOL])
    store = ResponseStore()
    whole = asyncio.run(respond(state, request, store, stream=False))
    assert [i["type"] for i in whole["output"]] == ["message", "function_call", "function_call"]
    assert [json.loads(i["arguments"]) for i in whole["output"][1:]] == [{"city": "Paris"}, {"city": "Rome"}]
    assert whole["output"][0]["content"][0]["text"] == "Let me check." and whole["status"] == "completed"
    stored = store.get(whole["id"])[-1]
    assert [c["function"]["name"] for c in stored["tool_calls"]] == ["get_weather", "get_weather"]

    async def events():
        return [json.loads(e.split("data: ", 1)[1]) async for e in await respond(state, request, store, stream=True)]

    streamed = asyncio.run(events())
    deltas = [e["delta"] for e in streamed if e["type"] == "response.function_call_arguments.delta"]
    assert [json.loads(d) for d in deltas] == [{"city": "Paris"}, {"city": "Rome"}]
    assert streamed[-1]["response"]["output"][1]["name"] == "get_weather"


def test_the_tool_output_reaches_the_prompt(server):
    """The function call and its output are rendered into the prompt: more input tokens than without."""
    def input_tokens(items):
        r = httpx.post(server.url + "/v1/responses", timeout=60,
                       json={"model": "tiny", "input": items, "tools": [WEATHER_TOOL], "max_output_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens"]

    question = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny and 21 degrees in the city"}
    assert input_tokens(question) < input_tokens(question + [call]) < input_tokens(question + [call, output])


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="tiny", input="My name is Ada.", max_output_tokens=4, temperature=0)
    second = client.responses.create(model="tiny", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    alone = client.responses.create(model="tiny", input="What is my name?", max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens


def test_an_unknown_previous_response_id_is_a_404(server):
    r = httpx.post(server.url + "/v1/responses", timeout=30,
                   json={"model": "tiny", "input": "x", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_an_input_image_part_is_a_400_that_says_it_is_not_served(server):
    content = [{"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": "data:,"}]
    r = httpx.post(server.url + "/v1/responses", timeout=30,
                   json={"model": "tiny", "input": [{"role": "user", "content": content}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "input.0.content.1", error
    assert "'input_image' content is not served yet" in error["message"]


def test_a_failed_generation_is_an_error_answer_whole_and_in_band_streamed(engine512):
    import asyncio

    from dsaserve.chat_template import ChatTemplate
    from dsaserve.outputs import CompletionOutput, RequestOutput
    from dsaserve.server.metrics import ServerMetrics
    from dsaserve.server.protocol import APIError
    from dsaserve.server.responses_endpoint import ResponsesRequest, ResponseStore, respond
    from dsaserve.server.state import ServerConfig, ServerState

    tokenizer = engine512.tokenizer
    state = ServerState(engine512, ServerConfig("tiny"),
                        ChatTemplate(tokenizer.chat_template, tokenizer.special_tokens),
                        ServerMetrics(engine512.stats, "tiny"))

    async def generate(request):
        yield RequestOutput(request.request_id, None, [1], [CompletionOutput(0, "", [], finish_reason="error")],
                            finished=True, error="the model produced non-finite logits")

    state.generate = generate
    request, store = ResponsesRequest(model="tiny", input="hi"), ResponseStore()
    with pytest.raises(APIError, match="non-finite") as caught:
        asyncio.run(respond(state, request, store, stream=False))
    assert caught.value.status == 500

    async def events():
        return [e async for e in await respond(state, request, store, stream=True)]

    last = asyncio.run(events())[-1]
    assert last.startswith("event: error") and "non-finite" in last
    assert not store.items  # a failed response is not kept for previous_response_id


def test_the_store_is_bounded_in_bytes_and_drops_the_oldest_first():
    from dsaserve.server.responses_endpoint import ResponseStore

    store = ResponseStore(size=100, max_bytes=10_000)
    conversation = [{"role": "user", "content": "x" * 3_000}]
    for k in range(5):
        store.put(f"resp_{k}", conversation)
    assert list(store.items) == ["resp_2", "resp_3", "resp_4"] and store.bytes <= 10_000
    store.get("resp_2")  # used: now the newest
    store.put("resp_5", conversation)
    assert list(store.items) == ["resp_4", "resp_2", "resp_5"]
    store.put("resp_big", [{"role": "user", "content": "é" * 6_000}])  # 12,000 bytes of UTF-8: never kept
    assert "resp_big" not in store.items and len(store.items) == 3
    assert store.bytes == sum(size for _, size in store.items.values())
