"""POST /v1/chat/completions: render the chat template, generate, split reasoning / content / tool calls."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from dsaserve.chat_template import ChatTemplateError
from dsaserve.engine.admission import EngineRequest
from dsaserve.server.input_checks import check_encodable, check_template_kwargs, encode_bounded
from dsaserve.server.parsers import CONTENT, REASONING, THINK_END, THINK_START, OutputParser
from dsaserve.server.protocol import APIError, ChatCompletionRequest, NamedToolChoice
from dsaserve.server.response_pieces import chat_logprobs, continuous_usage, now, sse, stream_error, usage
from dsaserve.server.state import ServerState
from dsaserve.server.structured_request import forced_tool_constraint, requested_constraint
from dsaserve.structured_output import ReasoningMarkers, StructuredOutputsParams


@dataclass
class PreparedChat:
    prompt_ids: list[int]
    parser_args: dict  # how to build each choice's output parser
    constraint: StructuredOutputsParams | None = None  # what the answer (after any reasoning) must match


def prepare_chat(state: ServerState, req: ChatCompletionRequest) -> PreparedChat:
    """Checks, template rendering and tokenization: CPU work, so the app runs it off the event loop."""
    check_encodable(req)
    state.check_model(req.model)
    req.check_unsupported()
    check_template_kwargs(req.chat_template_kwargs)
    if state.chat_template is None:
        raise APIError(400, "this model has no chat template; start the server with --chat-template FILE "
                            "or use /v1/completions", param="messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    schemas = {t.function.name: t.function.parameters or {} for t in req.tools or []}
    choice = req.tool_choice
    forced = ""
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in schemas:
            raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not in tools",
                           param="tool_choice")
        forced = state.tool_format.forced_prefix(choice.function.name)
    elif choice == "required":
        if not tools:
            raise APIError(400, "tool_choice 'required' needs at least one tool in tools", param="tool_choice")
        forced = state.tool_format.forced_prefix(None)
    try:
        text = state.chat_template.render([m.for_template() for m in req.messages], tools=tools,
                                          add_generation_prompt=req.add_generation_prompt, **req.template_kwargs())
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from e
    closed = text.rstrip().endswith(THINK_END)  # the template turned thinking off
    reasoning = state.config.reasoning_parser is not None and not closed
    opened = text.rstrip().endswith(THINK_START)
    if forced:
        text += ("" if closed else THINK_END) + forced
    ids = encode_bounded(state.engine.tokenizer, text, state.max_model_len, state.max_prompt_chars, "messages",
                         add_special_tokens=False)
    parser_args = dict(
        tool_format=state.tool_format, reasoning=reasoning and not forced,
        tools=state.config.tool_call_parser is not None and bool(tools) and choice != "none",
        start_in=REASONING if (reasoning and opened and not forced) else CONTENT,
        tool_schemas=schemas, prefix=forced,
    )
    return PreparedChat(ids, parser_args, _constraint(state, req, schemas, forced, reasoning, opened))


def _constraint(state: ServerState, req: ChatCompletionRequest, schemas: dict, forced: str, reasoning: bool,
                opened: bool) -> StructuredOutputsParams | None:
    if forced:
        if (req.response_format is not None and req.response_format.type != "text") or req.structured_outputs:
            raise APIError(400, "a forced tool_choice already constrains the output; drop response_format / "
                                "structured_outputs or use tool_choice 'auto'", param="tool_choice")
        named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
        return forced_tool_constraint(state.tool_format, schemas if named is None else {named: schemas[named]}, named,
                                      req.parallel_tool_calls is not False)
    return requested_constraint(req, _reasoning_markers(state, reasoning, opened))


def _reasoning_markers(state: ServerState, reasoning: bool, opened: bool) -> ReasoningMarkers | None:
    """With reasoning on, the constraint starts after `</think>`; the first token may open `<think>` itself."""
    end = state.engine.tokenizer.token_to_id(THINK_END)
    if not reasoning or end is None:
        return None
    return ReasoningMarkers(end, None if opened else state.engine.tokenizer.token_to_id(THINK_START),
                            in_reasoning=opened)


def admit_chat(state: ServerState, req: ChatCompletionRequest, prepared: PreparedChat,
               request_id: str) -> EngineRequest:
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    return state.admit(request_id, req, prepared.prompt_ids, req.max_completion_tokens or req.max_tokens, "messages",
                       max_tokens_param, logprobs=logprobs, structured_outputs=prepared.constraint)


def max_calls(req: ChatCompletionRequest) -> int:
    """parallel_tool_calls=false: at most one tool call per choice (the first the model makes)."""
    return 1 if req.parallel_tool_calls is False else 1 << 30


def _finish_reason(engine_reason: str | None, made_tool_calls: bool) -> str | None:
    if engine_reason == "stop" and made_tool_calls:
        return "tool_calls"
    return engine_reason


async def chat_full(state: ServerState, req: ChatCompletionRequest, request_id: str, prepared: PreparedChat,
                    admitted: EngineRequest) -> dict:
    final = None
    async for out in state.generate(admitted):
        if out.error:
            raise APIError(500, f"generation failed: {out.error}", type_="internal_error")
        if final is None:
            final = out
        else:
            final.add(out)
    choices = []
    for c in final.outputs:
        parser = OutputParser(**prepared.parser_args)  # the same parser streaming uses, fed all at once
        parsed = parser.feed(c.text, last=True)
        content, calls = parsed.content, parsed.tool_calls[: max_calls(req)]
        message = {"role": "assistant", "content": content or (None if calls else ""),
                   "reasoning_content": parsed.reasoning or None}
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        logprobs = None
        if req.logprobs:
            logprobs = {"content": chat_logprobs(c.token_ids, c.logprobs or [], req.top_logprobs or 0)}
        choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                        "finish_reason": _finish_reason(c.finish_reason, bool(calls))})
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    return {"id": request_id, "object": "chat.completion", "created": now(), "model": state.config.model_name,
            "choices": choices, "usage": usage(len(prepared.prompt_ids), completion_tokens)}


async def chat_stream(state: ServerState, req: ChatCompletionRequest, request_id: str,
                      prepared: PreparedChat, admitted: EngineRequest) -> AsyncIterator[str]:
    created, model = now(), state.config.model_name
    parsers = [OutputParser(**prepared.parser_args) for _ in range(req.n)]
    calls_made = [0] * req.n
    completion_tokens = 0

    def chunk(choices: list[dict], extra: dict | None = None) -> str:
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices}
        if continuous_usage(req) and choices:
            body["usage"] = usage(len(prepared.prompt_ids), completion_tokens)
        body.update(extra or {})
        return sse(body)

    for index in range(req.n):
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    try:
        async for out in state.generate(admitted):
            if out.error:
                yield sse(APIError(500, f"generation failed: {out.error}", type_="internal_error").body())
                break
            choices = []
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                parsed = parsers[c.index].feed(c.text, last=bool(c.finish_reason))
                delta = {}
                if parsed.reasoning:
                    delta["reasoning_content"] = parsed.reasoning
                if parsed.content:
                    delta["content"] = parsed.content
                parsed.tool_calls = parsed.tool_calls[: max(0, max_calls(req) - calls_made[c.index])]
                if parsed.tool_calls:
                    delta["tool_calls"] = [call.to_openai(calls_made[c.index] + k)
                                           for k, call in enumerate(parsed.tool_calls)]
                    calls_made[c.index] += len(parsed.tool_calls)
                logprobs = None
                if req.logprobs and c.logprobs:
                    logprobs = {"content": chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)}
                if delta or logprobs or c.finish_reason:
                    choices.append({"index": c.index, "delta": delta, "logprobs": logprobs,
                                    "finish_reason": _finish_reason(c.finish_reason, calls_made[c.index] > 0)})
            if choices:
                yield chunk(choices)
    except Exception as e:  # the stream has started: report in-band, then end it properly
        yield sse(stream_error(e).body())
    if req.stream_options and req.stream_options.include_usage:
        yield chunk([], {"usage": usage(len(prepared.prompt_ids), completion_tokens)})
    yield sse("[DONE]")
