"""POST /v1/responses: OpenAI's Responses API (the subset vLLM serves) on top of the chat path.

A request becomes a chat request: `instructions` a system message, `input` (a string, or message,
function_call and function_call_output items) the turns, `previous_response_id` the stored conversation
of an earlier response in this server's lifetime, `tools` the function tools. The answer is parsed as
chat answers are (reasoning, text, tool calls) and returned as output items, whole or as typed events.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from pydantic import Field, ValidationError

from dsaserve.server.chat import PreparedChat, admit_chat, prepare_chat
from dsaserve.server.input_checks import MEDIA_PARTS, media_refusal
from dsaserve.server.parsers import OutputParser
from dsaserve.server.protocol import MAX_ID_CHARS, APIError, ChatCompletionRequest, ReasoningEffort, Strict
from dsaserve.server.response_pieces import stream_error
from dsaserve.server.state import ServerState

STORED_RESPONSES = 1000  # conversations kept for previous_response_id, least recently used dropped


class ReasoningOptions(Strict):
    effort: ReasoningEffort | None = None  # reaches the chat template as reasoning_effort
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; the reasoning comes back whole


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningOptions | None = None
    text: dict | None = None  # {"format": {"type": "json_schema", "schema": …}} constrains the answer


class ResponseStore:
    """Conversations (chat messages) of earlier responses, for previous_response_id: at most `size` of them and
    `max_bytes` of their JSON text together, the least recently used dropped first (one larger than the whole
    bound is not kept)."""

    def __init__(self, size: int = STORED_RESPONSES, max_bytes: int = 64 << 20):
        self.size, self.max_bytes = size, max_bytes
        self.items: OrderedDict[str, tuple[list[dict], int]] = OrderedDict()
        self.bytes = 0

    def get(self, response_id: str) -> list[dict]:
        if response_id not in self.items:
            raise APIError(404, f"previous_response_id {response_id!r} is not a response of this server (they are kept "
                                f"for its lifetime, the last {self.size} within {self.max_bytes} bytes)",
                           param="previous_response_id", code="response_not_found")
        self.items.move_to_end(response_id)
        return list(self.items[response_id][0])

    def put(self, response_id: str, messages: list[dict]) -> None:
        size = len(json.dumps(messages, ensure_ascii=False).encode())
        if response_id in self.items:
            self.bytes -= self.items.pop(response_id)[1]
        if size > self.max_bytes:
            return
        self.items[response_id] = messages, size
        self.bytes += size
        while len(self.items) > self.size or self.bytes > self.max_bytes:
            _, (_, dropped) = self.items.popitem(last=False)
            self.bytes -= dropped


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content, param: str) -> str:
    """A message's content: a string, or parts whose `text` fields are strings."""
    if content is None or isinstance(content, str):
        return content or ""
    for k, part in enumerate(content if isinstance(content, list) else []):
        if isinstance(part, dict) and part.get("type") in MEDIA_PARTS:
            raise media_refusal(part["type"], f"{param}.{k}")
    texts = [part.get("text") for part in content if isinstance(part, dict)] if isinstance(content, list) else [None]
    if not all(isinstance(t, str) for t in texts):
        raise APIError(400, f"{param} must be a string or a list of parts with a string 'text'", param=param)
    return "".join(texts)


def to_messages(req: ResponsesRequest, store: ResponseStore) -> list[dict]:
    """The conversation as chat messages: stored turns, instructions, then the input items."""
    messages = store.get(req.previous_response_id) if req.previous_response_id else []
    if req.instructions:
        messages = [{"role": "system", "content": req.instructions}] + [m for m in messages if m["role"] != "system"]
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for k, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role", "user"),
                             "content": _text(item.get("content"), f"input.{k}.content")})
        elif kind in ("function_call", "function_call_output") and len(str(item.get("call_id"))) > MAX_ID_CHARS:
            raise APIError(400, f"input.{k}.call_id has {len(str(item.get('call_id')))} characters; give at most "
                                f"{MAX_ID_CHARS}", param=f"input.{k}.call_id")
        elif kind == "function_call":
            messages.append({"role": "assistant", "content": "", "tool_calls": [{
                "id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text(item.get("output"), f"input.{k}.output")})
        elif kind != "reasoning":  # earlier reasoning is not sent back to the model
            raise APIError(400, f"input item type {kind!r} is not supported; use message, function_call, "
                                "function_call_output", param=f"input.{k}.type")
    return messages


def to_chat(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
             for t in req.tools or [] if t.get("type") == "function"]
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    fields = dict(model=req.model, messages=messages, tools=tools or None, tool_choice=choice,
                  max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
                  parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req.text),
                  reasoning_effort=req.reasoning.effort if req.reasoning else None)
    try:
        return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        path = ".".join(str(p) for p in first["loc"]).replace("messages", "input")
        raise APIError(400, f"{path}: {first['msg']}", param=path) from e


def _response_format(text: dict | None) -> dict | None:
    """The Responses API's text.format, as chat's response_format (the schema sits one level up there)."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}


class ResponseBuilder:
    """Accumulates the output items of one response and renders the Response object and its events."""

    def __init__(self, state: ServerState, req: ResponsesRequest, prompt_tokens: int, streaming: bool):
        self.state, self.req, self.prompt_tokens, self.streaming = state, req, prompt_tokens, streaming
        self.id, self.created = item_id("resp"), int(time.time())
        self.output: list[dict] = []
        self.output_tokens = 0
        self.sequence = 0
        self.finish: str | None = None

    def response(self, status: str) -> dict:
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.state.config.model_name, "output": self.output, "instructions": self.req.instructions,
               "tools": self.req.tools or [], "tool_choice": self.req.tool_choice or "auto",
               "parallel_tool_calls": self.req.parallel_tool_calls is not False,
               "previous_response_id": self.req.previous_response_id,
               "max_output_tokens": self.req.max_output_tokens, "temperature": self.req.temperature,
               "top_p": self.req.top_p, "store": self.req.store, "error": None, "incomplete_details": None,
               "reasoning": {"effort": self.req.reasoning.effort if self.req.reasoning else None, "summary": None},
               "usage": {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                         "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": self.prompt_tokens + self.output_tokens}}
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    @property
    def final_status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def event(self, kind: str, **fields) -> str:
        """One server-sent event (nothing to render when the response goes out whole)."""
        if not self.streaming:
            return ""
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def conversation(self, messages: list[dict]) -> list[dict]:
        text = "".join(p["text"] for item in self.output if item["type"] == "message" for p in item["content"])
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]
        answer = {"role": "assistant", "content": text}
        if calls:
            answer["tool_calls"] = calls
        return messages + [answer]


def new_item(kind: str, **extra) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning", "id": item_id("rs"), "summary": [], "content": [], **extra}
    if kind == "message":
        return {"type": "message", "id": item_id("msg"), "role": "assistant", "status": "in_progress", "content": []}
    return {"type": "function_call", "id": item_id("fc"), "status": "completed", **extra}


async def respond(state: ServerState, req: ResponsesRequest, store: ResponseStore, stream: bool):
    """The Response (whole) or an async iterator of its events (stream)."""
    messages = to_messages(req, store)
    chat = to_chat(req, messages)
    prepared: PreparedChat = await asyncio.to_thread(prepare_chat, state, chat)
    builder = ResponseBuilder(state, req, len(prepared.prompt_ids), stream)
    admitted = await asyncio.to_thread(admit_chat, state, chat, prepared, builder.id)
    events = _events(state, req, store, messages, prepared, admitted, builder)
    if stream:
        return events
    async for _ in events:
        pass
    return builder.response(builder.final_status)


async def _events(state, req, store, messages, prepared, admitted, builder: ResponseBuilder) -> AsyncIterator[str]:
    parser = OutputParser(**prepared.parser_args)
    yield builder.event("response.created", response=builder.response("in_progress"))
    yield builder.event("response.in_progress", response=builder.response("in_progress"))
    open_item: dict | None = None
    try:
        async for out in state.generate(admitted):
            if out.error:
                raise APIError(500, f"generation failed: {out.error}", type_="internal_error")
            completion = out.outputs[0] if out.outputs else None
            if completion is None:
                continue
            builder.output_tokens += len(completion.token_ids)
            builder.finish = completion.finish_reason or builder.finish
            parsed = parser.feed(completion.text, last=bool(completion.finish_reason))
            for kind, piece in (("reasoning", parsed.reasoning), ("message", parsed.content)):
                if piece:
                    if open_item is None or open_item["type"] != kind:
                        for event in _close(builder, open_item):
                            yield event
                        open_item, opened = _open(builder, kind)
                        for event in opened:
                            yield event
                    yield _delta(builder, open_item, piece)
            for call in parsed.tool_calls:
                for event in _close(builder, open_item):
                    yield event
                open_item = None
                for event in _call(builder, call):
                    yield event
        for event in _close(builder, open_item):
            yield event
    except Exception as e:  # once started, a stream reports in-band; a whole response is an error answer
        if not builder.streaming:
            raise
        yield builder.event("error", **stream_error(e).body()["error"])
        return
    if req.store:
        store.put(builder.id, builder.conversation(messages))
    # Always response.completed, its status "incomplete" when cut by max_output_tokens: the openai
    # client's stream helper (get_final_response) waits for that event, as vLLM sends it.
    yield builder.event("response.completed", response=builder.response(builder.final_status))


def _open(builder: ResponseBuilder, kind: str) -> tuple[dict, list[str]]:
    item = new_item(kind)
    builder.output.append(item)
    index = len(builder.output) - 1
    events = [builder.event("response.output_item.added", output_index=index, item=dict(item, content=[]))]
    if kind == "message":
        part = {"type": "output_text", "text": "", "annotations": []}
        item["content"].append(part)
        events.append(builder.event("response.content_part.added", item_id=item["id"], output_index=index,
                                    content_index=0, part=dict(part)))
    else:
        item["content"].append({"type": "reasoning_text", "text": ""})
    return item, events


def _delta(builder: ResponseBuilder, item: dict, piece: str) -> str:
    index = builder.output.index(item)
    item["content"][0]["text"] += piece
    kind = "response.output_text.delta" if item["type"] == "message" else "response.reasoning_text.delta"
    extra = {"logprobs": []} if item["type"] == "message" else {}
    return builder.event(kind, item_id=item["id"], output_index=index, content_index=0, delta=piece, **extra)


def _close(builder: ResponseBuilder, item: dict | None) -> list[str]:
    if item is None:
        return []
    index = builder.output.index(item)
    part = item["content"][0]
    if item["type"] == "message":
        item["status"] = "completed"
        events = [builder.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                text=part["text"], logprobs=[]),
                  builder.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                                part=part)]
    else:
        events = [builder.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"])]
    return events + [builder.event("response.output_item.done", output_index=index, item=item)]


def _call(builder: ResponseBuilder, call) -> list[str]:
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    item = new_item("function_call", call_id=call.id, name=call.name, arguments=arguments)
    builder.output.append(item)
    index = len(builder.output) - 1
    return [builder.event("response.output_item.added", output_index=index, item=dict(item, arguments="")),
            builder.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=arguments),
            builder.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          arguments=arguments),
            builder.event("response.output_item.done", output_index=index, item=item)]
