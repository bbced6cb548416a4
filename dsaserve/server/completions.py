"""POST /v1/completions: one or several prompts (text or token ids), n samples each, echo, logprobs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from dsaserve.engine.admission import EngineRequest
from dsaserve.outputs import RequestOutput
from dsaserve.sampling_params import MAX_N
from dsaserve.server.input_checks import check_encodable, encode_bounded
from dsaserve.server.protocol import APIError, CompletionRequest
from dsaserve.server.response_pieces import (
    completion_logprobs,
    continuous_usage,
    now,
    prompt_logprobs_json,
    sse,
    stream_error,
    usage,
)
from dsaserve.server.state import ServerState
from dsaserve.server.structured_request import requested_constraint


@dataclass
class PreparedPrompt:
    ids: list[int]
    text: str | None  # None until admitted, for token-id prompts


def prepare_prompts(state: ServerState, req: CompletionRequest) -> list[PreparedPrompt]:
    """Checks and tokenization: CPU work, so the app runs it off the event loop."""
    check_encodable(req)
    state.check_model(req.model)
    req.check_unsupported()
    if req.suffix is not None:
        raise APIError(400, "suffix is not supported", param="suffix")
    tokenizer = state.engine.tokenizer
    prompt = req.prompt
    if isinstance(prompt, str):
        items = [prompt]
    elif all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    most = max(state.engine.max_num_seqs, MAX_N)
    if len(items) * req.n > most:
        raise APIError(400, f"{len(items)} prompts × n={req.n} = {len(items) * req.n} sequences; one request may "
                            f"hold at most {most} (max_num_seqs, or {MAX_N})", param="prompt")
    prepared = []
    for item in items:
        if isinstance(item, str):
            ids = encode_bounded(tokenizer, item, state.max_model_len, state.max_prompt_chars, "prompt")
            prepared.append(PreparedPrompt(ids, item))
        else:
            prepared.append(PreparedPrompt(list(item), None))  # decoded for echo once admitted
    return prepared


def admit_prompts(state: ServerState, req: CompletionRequest, prompts: list[PreparedPrompt],
                  request_id: str) -> list[EngineRequest]:
    """One engine request per prompt, each through the admission check (a 400 before anything streams)."""
    extra = {"logprobs": req.logprobs, "prompt_logprobs": req.prompt_logprobs,
             "structured_outputs": requested_constraint(req)}
    if req.echo and req.logprobs is not None:
        extra["prompt_logprobs"] = max(req.logprobs, req.prompt_logprobs or 0)
    admitted = [state.admit(f"{request_id}-{i}", req, p.ids, req.max_tokens, "prompt", **extra)
                for i, p in enumerate(prompts)]
    for prompt in prompts:
        if prompt.text is None:
            prompt.text = state.engine.tokenizer.decode(prompt.ids, skip_special_tokens=False)
    return admitted


async def merged(state: ServerState, admitted: list[EngineRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Generate every prompt concurrently; yield (prompt index, output) as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in state.generate(admitted[i]):
                await queue.put((i, out))
        except Exception as e:  # surfaced to the consumer below
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(admitted))]
    try:
        remaining = len(admitted)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def _choice_text(req: CompletionRequest, prompt: PreparedPrompt, first: bool, text: str) -> str:
    return (prompt.text + text) if (req.echo and first) else text


def _logprobs(state, req: CompletionRequest, prompt: PreparedPrompt, out: RequestOutput, token_ids, positions,
              first: bool, offset: int):
    if req.logprobs is None:
        return None
    decode = lambda t: state.engine.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    if req.echo and first:
        token_ids = prompt.ids + token_ids
        positions = (out.prompt_logprobs or [None] * len(prompt.ids)) + positions
    return completion_logprobs(token_ids, positions, req.logprobs, offset, decode)


async def completion_full(state: ServerState, req: CompletionRequest, request_id: str,
                          prompts: list[PreparedPrompt], admitted: list[EngineRequest]) -> dict:
    finals: dict[int, RequestOutput] = {}
    async for i, out in merged(state, admitted):
        if out.error:
            raise APIError(500, f"generation failed: {out.error}", type_="internal_error")
        if i in finals:
            finals[i].add(out)
        else:
            finals[i] = out
    choices = []
    for i, prompt in enumerate(prompts):
        for c in finals[i].outputs:
            logprobs = _logprobs(state, req, prompt, finals[i], c.token_ids, c.logprobs or [], True, 0)
            choice = {"index": i * req.n + c.index, "text": _choice_text(req, prompt, True, c.text),
                      "logprobs": logprobs, "finish_reason": c.finish_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(finals[i].prompt_logprobs, req.prompt_logprobs)
            choices.append(choice)
    completion_tokens = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
    return {"id": request_id, "object": "text_completion", "created": now(), "model": state.config.model_name,
            "choices": choices, "usage": usage(sum(len(p.ids) for p in prompts), completion_tokens)}


async def completion_stream(state: ServerState, req: CompletionRequest, request_id: str,
                            prompts: list[PreparedPrompt], admitted: list[EngineRequest]) -> AsyncIterator[str]:
    created, model, n = now(), state.config.model_name, req.n
    started = set()
    offsets = [0] * (len(prompts) * n)
    completion_tokens = 0
    try:
        async for i, out in merged(state, admitted):
            if out.error:
                yield sse(APIError(500, f"generation failed: {out.error}", type_="internal_error").body())
                break
            choices = []
            for c in out.outputs:
                k = i * n + c.index
                first = k not in started
                started.add(k)
                completion_tokens += len(c.token_ids)
                text = _choice_text(req, prompts[i], first, c.text)
                logprobs = _logprobs(state, req, prompts[i], out, c.token_ids, c.logprobs or [], first, offsets[k])
                offsets[k] += len(text)
                if text or c.token_ids or c.finish_reason:  # one chunk per step that made tokens
                    choice = {"index": k, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}
                    if first and req.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, req.prompt_logprobs)
                    choices.append(choice)
            if choices:
                body = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                        "choices": choices}
                if continuous_usage(req):
                    body["usage"] = usage(sum(len(p.ids) for p in prompts), completion_tokens)
                yield sse(body)
    except Exception as e:  # the stream has started: report in-band, then end it properly
        yield sse(stream_error(e).body())
    if req.stream_options and req.stream_options.include_usage:
        yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "usage": usage(sum(len(p.ids) for p in prompts), completion_tokens)})
    yield sse("[DONE]")
