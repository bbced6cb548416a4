"""Structured output through the server on the random tiny model: every constrained answer validates against its
schema (streamed and whole, with and without reasoning first), the same requests without the constraint do
not, regex and choice constraints hold, forced tool calls carry arguments valid for the tool's schema, and
what the grammar cannot enforce is refused with a 400 naming it."""

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
import torch
from structured_schemas import SCHEMAS

from dsaserve.demo.tokenizer import CHAT_TEMPLATE, GLM_STOP_TOKENS
from dsaserve.structured_output import ReasoningMarkers
from dsaserve.structured_output.request_grammar import RequestGrammar, apply_grammars
from dsaserve.tokenizer import Tokenizer

MAX_TOKENS = 400
GENERATION_PROMPT = "{%- if enable_thinking is defined and not enable_thinking -%}</think>{%- endif -%}"
assert GENERATION_PROMPT in CHAT_TEMPLATE
# As GLM-4.7 and later do: the generation prompt opens the reasoning unless thinking is off.
OPENING_TEMPLATE = CHAT_TEMPLATE.replace(
    GENERATION_PROMPT,
    "{%- if enable_thinking is defined and not enable_thinking -%}</think>{%- else -%}<think>{%- endif -%}")


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    from server_process import ServerProcess

    template = tmp_path_factory.mktemp("template") / "opening.jinja"
    template.write_text(OPENING_TEMPLATE)
    srv = ServerProcess(tiny_checkpoint, "--chat-template", str(template), "--max-num-seqs", "96",
                        "--max-model-len", "2048").wait_ready()
    srv.tokenizer = Tokenizer(tiny_checkpoint)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain_server(tiny_checkpoint):
    """The built-in template, which leaves the reasoning for the model to open."""
    from server_process import ServerProcess

    srv = ServerProcess(tiny_checkpoint, "--max-model-len", "1024").wait_ready()
    yield srv
    srv.stop()


def chat_body(server, reasoning: bool, **extra) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Answer in JSON, please."}],
            "max_tokens": MAX_TOKENS, "temperature": 1.0, **extra}
    if reasoning:
        # The random model rarely ends its reasoning by itself: make </think> likely, and ending the turn
        # before an answer unlikely (where the grammar allows nothing else, a stop token still wins).
        body["logit_bias"] = {str(server.tokenizer.token_to_id("</think>")): 3.0,
                              **{str(server.tokenizer.token_to_id(t)): -100.0 for t in GLM_STOP_TOKENS}}
    else:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


async def answer(client: httpx.AsyncClient, body: dict, stream: bool) -> dict:
    """{content, reasoning, finish_reason, tool_calls} of choice 0, whole or assembled from the stream."""
    if not stream:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return {"content": choice["message"]["content"] or "",
                "reasoning": choice["message"]["reasoning_content"] or "",
                "finish_reason": choice["finish_reason"], "tool_calls": choice["message"].get("tool_calls") or []}
    out = {"content": "", "reasoning": "", "finish_reason": None, "tool_calls": []}
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                delta = choice["delta"]
                out["content"] += delta.get("content") or ""
                out["reasoning"] += delta.get("reasoning_content") or ""
                out["tool_calls"] += delta.get("tool_calls") or []
                out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


def run_all(server, requests: list[tuple[dict, bool]]) -> list[dict]:
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return await asyncio.gather(*(answer(client, body, stream) for body, stream in requests))
    return asyncio.run(main())


def validation_error(text: str, schema: dict) -> str | None:
    try:
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


CASES = [(i, stream, reasoning) for i in range(len(SCHEMAS)) for stream in (False, True) for reasoning in (False, True)]


def test_every_constrained_answer_validates_against_its_schema(server):
    requests = [(chat_body(server, reasoning, seed=i, response_format={
        "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i]}}), stream)
        for i, stream, reasoning in CASES]
    answers = run_all(server, requests)
    failed = []
    for (i, stream, reasoning), a in zip(CASES, answers):
        error = validation_error(a["content"], SCHEMAS[i])
        if a["finish_reason"] != "stop" or error or (a["reasoning"] and not reasoning):
            failed.append(f"schema {i}, stream={stream}, reasoning={reasoning}: {error} {a}")
    assert failed == []
    # With reasoning on, the model mostly wrote some before its answer (it may also close it at once).
    reasoned = [bool(a["reasoning"]) for (_, _, reasoning), a in zip(CASES, answers) if reasoning]
    assert sum(reasoned) >= len(reasoned) // 2, reasoned


def test_without_the_constraint_the_same_requests_fail_validation(server):
    """So the test above measures the grammar, not a model that happens to write valid JSON."""
    requests = [(chat_body(server, reasoning, seed=i, max_tokens=60), stream) for i, stream, reasoning in CASES]
    answers = run_all(server, requests)
    valid = [(i, a["content"]) for (i, _, _), a in zip(CASES, answers)
             if validation_error(a["content"], SCHEMAS[i]) is None]
    assert valid == []


def test_json_object_answers_are_json_objects(server):
    requests = [(chat_body(server, False, seed=s, response_format={"type": "json_object"}), s % 2 == 0)
                for s in range(8)]
    for a in run_all(server, requests):
        if a["finish_reason"] == "stop":
            assert isinstance(json.loads(a["content"]), dict), a
        else:  # an unbounded object may run out of tokens; what was written is still JSON so far
            assert a["content"].lstrip().startswith("{"), a


def test_completions_take_response_format_too(server):
    schema = SCHEMAS[13]
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "JSON:", "max_tokens": MAX_TOKENS, "n": 4, "seed": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": schema}}})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop" and validation_error(choice["text"], schema) is None, choice


def test_the_openai_clients_parse_helper_gets_its_pydantic_model(server):
    from typing import Annotated

    from openai import OpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: Annotated[str, Field(max_length=12)]
        age: Annotated[int, Field(ge=0, le=150)]
        kind: Annotated[str, Field(pattern="^(human|robot)$")]

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    completion = client.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Who are you?"}], response_format=Person,
        max_tokens=MAX_TOKENS, seed=2, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and person.kind in ("human", "robot"), completion


def test_regex_and_choice_hold_on_chat_and_completions(server):
    regex, choices = r"[0-9]{3}-[a-z]{2,5}( [A-Z]{1,6})?", ["yes", "no", "maybe so"]
    for constraint, check in (({"regex": regex}, lambda t: re.fullmatch(regex, t)),
                              ({"choice": choices}, lambda t: t in choices)):
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "The answer:", "max_tokens": 40, "n": 8, "seed": 3,
            "structured_outputs": constraint})
        assert r.status_code == 200, r.text
        texts = [c["text"] for c in r.json()["choices"]]
        assert all(check(t) for t in texts), texts
        answers = run_all(server, [(chat_body(server, reasoning, seed=s, structured_outputs=constraint), s % 2 == 0)
                                   for s in range(4) for reasoning in (False, True)])
        assert all(a["finish_reason"] == "stop" and check(a["content"]) for a in answers), answers


def test_the_constraint_starts_after_the_reasoning(server):
    answers = run_all(server, [(chat_body(server, True, seed=s, structured_outputs={"regex": "[0-9]{1,6}"}), s % 2 == 0)
                               for s in range(6)])
    for a in answers:
        assert re.fullmatch("[0-9]{1,6}", a["content"]), a
    # The reasoning was not held to the digits (it would be, if the grammar started at the first token).
    assert any(re.search("[^0-9\\s]", a["reasoning"]) for a in answers), answers


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "unit": {"type": "string", "enum": ["c", "f"]},
                                         "hourly": {"type": "boolean"}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"ids": {"type": "array",
                                                 "items": {"type": "integer", "minimum": 0, "maximum": 99},
                                                 "maxItems": 3},
                                         "filter": {"type": "object",
                                                    "properties": {"q": {"type": "string", "maxLength": 8}},
                                                    "required": ["q"]}},
        "required": ["ids"]}}},
]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "lookup"}}])
def test_forced_tool_calls_have_arguments_valid_for_the_tools_schema(server, tool_choice):
    requests = [(chat_body(server, False, seed=s, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=s % 3 != 0),
                 s % 2 == 0) for s in range(12)]
    for a in run_all(server, requests):
        assert a["finish_reason"] == "tool_calls" and a["tool_calls"], a
        for call in a["tool_calls"]:
            name = call["function"]["name"]
            if isinstance(tool_choice, dict):
                assert name == "lookup"
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA_OF[name])


def test_forced_call_string_arguments_may_hold_angle_brackets():
    """A raw string argument may contain `<` (code, HTML, generics), but not the start of `</arg_value>`."""
    import xgrammar

    from dsaserve.server.parsers.glm import GLM_GRAMMAR
    from dsaserve.server.parsers.tool_call_grammar import tool_call_grammar

    schema = {"type": "object", "properties": {"code": {"type": "string"}}}
    grammar = tool_call_grammar(xgrammar, GLM_GRAMMAR, {"run": schema}, "run", False)
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([chr(i) for i in range(32, 127)]))
    compiled = compiler.compile_grammar(grammar)

    def complete(value: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled)
        return matcher.accept_string(f"<arg_key>code</arg_key><arg_value>{value}</arg_value></tool_call>") \
            and matcher.is_completed()

    assert complete("if a < b: print(List<int>)") and complete("<div>x</div>") and complete("")
    assert not complete("x</arg_value>y")


@pytest.mark.parametrize("schema, named", [
    ({"type": "object", "not": {"required": ["a"]}}, "'not'"),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, "'uniqueItems' at /properties/a"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "'if'"),
    ({"$ref": "https://example.com/schema.json"}, "'$ref'"),
    ({"type": "string", "format": "idn-email"}, "'format': 'idn-email'"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "'allOf'"),
    ({"type": "bogus"}, "Unsupported type"),
])
def test_what_the_grammar_cannot_enforce_is_a_400_naming_it(server, schema, named):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json=chat_body(
        server, False, max_tokens=4,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and named in error["message"], error


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "array", "contains": {"type": "integer"}}}}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(?<=x)y"}}}}}], "tool_choice": "required"}, "tools"),
])
def test_bad_constraints_are_a_400(server, extra, param):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json=chat_body(server, False, max_tokens=4, **extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_responses_api_text_format_constrains_the_answer(plain_server):
    schema = SCHEMAS[0]
    r = httpx.post(plain_server.url + "/v1/responses", timeout=120, json={
        "model": "tiny", "input": "Who are you?", "max_output_tokens": MAX_TOKENS, "temperature": 1.0,
        "text": {"format": {"type": "json_schema", "name": "person", "schema": schema}}})
    assert r.status_code == 200, r.text
    message = [item for item in r.json()["output"] if item["type"] == "message"][0]
    assert validation_error(message["content"][0]["text"], schema) is None, message


# ---- engine level ---------------------------------------------------------------------------------


def test_a_compiling_grammar_does_not_hold_up_other_requests(engine, monkeypatch):
    """Compiling happens at admission on the caller's thread: while one request's grammar compiles, the
    engine keeps stepping everyone else; the waiting request then runs under its grammar."""
    import threading

    from dsaserve.sampling_params import SamplingParams
    from dsaserve.structured_output import StructuredOutputsParams

    compiler = engine.engine.grammars
    started, release = threading.Event(), threading.Event()
    real = compiler._compile

    def slow(spec):
        started.set()
        assert release.wait(60)
        return real(spec)

    monkeypatch.setattr(compiler, "_compile", slow)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    constrained = SamplingParams(max_tokens=60, temperature=1.0, seed=5,
                                 structured_outputs=StructuredOutputsParams(json={**schema, "title": "slow"}))

    async def main():
        admitting = asyncio.create_task(asyncio.to_thread(engine.make_request, "slow", "hello", constrained))
        await asyncio.to_thread(started.wait, 60)
        other = engine.make_request("other", "the quick brown fox", SamplingParams(max_tokens=8, ignore_eos=True))
        async def run_other():
            return [out async for out in engine.stream(other)]
        outs = await asyncio.wait_for(run_other(), 60)  # a step blocked on the compile would never get here
        assert outs[-1].finished and not admitting.done()  # finished while the grammar was still compiling
        release.set()
        request = await admitting
        text = "".join([c.text for out in [o async for o in engine.stream(request)] for c in out.outputs])
        return text

    text = asyncio.run(main())
    jsonschema.validate(json.loads(text), schema)


def test_a_compile_that_takes_too_long_is_refused_and_cached_when_done(engine, monkeypatch):
    import threading

    from dsaserve.engine.admission import RequestRejected
    from dsaserve.sampling_params import SamplingParams
    from dsaserve.structured_output import StructuredOutputsParams

    compiler = engine.engine.grammars
    release = threading.Event()
    real = compiler._compile

    def slow(spec):
        assert release.wait(30)
        return real(spec)

    monkeypatch.setattr(compiler, "_compile", slow)
    monkeypatch.setattr(compiler, "timeout", 0.2)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-c]{2,9}"))
    with pytest.raises(RequestRejected, match="took longer than 0.2s to compile"):
        engine.make_request("slow-compile", "hi", params)
    release.set()
    monkeypatch.setattr(compiler, "timeout", 30)
    assert engine.make_request("slow-compile-2", "hi", params).grammar is not None  # the finished compile, cached


def test_a_grammar_is_compiled_once_per_spec(engine):
    from dsaserve.sampling_params import SamplingParams
    from dsaserve.structured_output import StructuredOutputsParams

    compiler = engine.engine.grammars
    before = compiler.num_compiled
    for k in range(3):
        spec = StructuredOutputsParams(json={"type": "object", "title": "once"})
        engine.make_request(f"once-{k}", "hi", SamplingParams(max_tokens=4, structured_outputs=spec))
    assert compiler.num_compiled == before + 1


def test_length_bounded_strings_admit_only_json_string_characters(engine):
    """xgrammar 0.2.9 lets raw control characters into a string with maxLength (invalid JSON); the compiler
    excludes them."""
    import xgrammar

    from dsaserve.structured_output import StructuredOutputsParams

    compiled = engine.engine.grammars.compile(StructuredOutputsParams(json={"type": "string", "maxLength": 5}))
    matcher = xgrammar.GrammarMatcher(compiled)
    assert matcher.accept_string('"ab')
    assert not matcher.accept_string("\x01") and not matcher.accept_string("\t")


def test_with_reasoning_not_yet_opened_the_first_token_may_open_it(engine):
    from dsaserve.structured_output import StructuredOutputsParams

    tokenizer = engine.tokenizer
    think, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    compiled = engine.engine.grammars.compile(StructuredOutputsParams(regex="[0-9]+"))
    vocab = engine.engine.config.vocab_size
    grammar = RequestGrammar(compiled, {0}, ReasoningMarkers(end, start_token_id=think))

    def allowed() -> set[int]:
        logits = torch.zeros(1, vocab)
        apply_grammars(logits, [grammar])
        return set(torch.nonzero(logits[0] > float("-inf")).flatten().tolist())

    digits = {tokenizer.token_to_id(str(d)) for d in range(10)}
    assert think in allowed() and digits <= allowed()  # open the reasoning, or start the answer
    assert grammar.accept(think) and not grammar.constrains_next  # reasoning: unconstrained
    assert grammar.accept(tokenizer.token_to_id("x")) and grammar.accept(end)
    assert think not in allowed() and digits <= allowed()  # after </think>, only the grammar


def test_without_xgrammar_a_constraint_is_refused_saying_what_to_install(engine, monkeypatch):
    import sys

    from dsaserve.engine.admission import RequestRejected
    from dsaserve.sampling_params import SamplingParams
    from dsaserve.structured_output import StructuredOutputsParams
    from dsaserve.structured_output.compiler import GrammarCompiler

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if not installed
    monkeypatch.setattr(engine.engine, "grammars", GrammarCompiler(engine.tokenizer, 640, [0]))
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    with pytest.raises(RequestRejected, match=r"pip install 'xgrammar>=0.2.9'"):
        engine.make_request("no-xgrammar", "hi", params)
