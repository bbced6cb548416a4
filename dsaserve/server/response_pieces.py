"""OpenAI response pieces: ids, usage, logprobs in the chat and the completions shapes, SSE framing."""

from __future__ import annotations

import json
import time
import uuid

from dsaserve.engine.admission import RequestRejected
from dsaserve.outputs import PositionLogprobs
from dsaserve.server.protocol import APIError


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def continuous_usage(req) -> bool:
    """stream_options.continuous_usage_stats (vLLM): usage so far in every chunk, with include_usage."""
    options = req.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def stream_error(error: Exception) -> APIError:
    """The error body to send inside a stream that has already started."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, RequestRejected):
        return APIError(400, str(error), param=error.param)
    return APIError(500, f"generation failed: {type(error).__name__}: {error}", type_="internal_error")


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": max(logprob, -9999.0), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], top: int) -> list[dict]:
    """`choices[].logprobs.content` entries: the chosen token and its `top` alternatives."""
    out = []
    for token, entry in zip(token_ids, positions):
        chosen = entry[token]
        alternatives = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
        item = _entry(chosen.decoded_token or "", chosen.logprob)
        item["top_logprobs"] = [_entry(lp.decoded_token or "", lp.logprob) for _, lp in alternatives
                                if lp.rank is not None and lp.rank <= top][:top]
        out.append(item)
    return out


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], top: int,
                        text_offset: int, decode) -> dict:
    """`choices[].logprobs` of /v1/completions: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for token, entry in zip(token_ids, positions):
        if entry is None:  # the first prompt token has no log-probability
            piece = decode(token)
            tokens.append(piece)
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            chosen = entry[token]
            piece = chosen.decoded_token or ""
            tokens.append(piece)
            token_logprobs.append(max(chosen.logprob, -9999.0))
            ranked = sorted(entry.values(), key=lambda lp: lp.rank or 0)
            top_logprobs.append({(lp.decoded_token or ""): max(lp.logprob, -9999.0)
                                 for lp in ranked if lp.rank is not None and lp.rank <= top})
        offsets.append(offset)
        offset += len(piece or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def prompt_logprobs_json(positions: list[PositionLogprobs | None] | None, top: int) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob, rank,
    decoded_token}} with the prompt's own token and the `top` most likely."""
    if positions is None:
        return None
    out = []
    for entry in positions:
        if entry is None:
            out.append(None)
            continue
        own = next(iter(entry))
        out.append({str(tid): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": lp.decoded_token}
                    for tid, lp in entry.items() if tid == own or (lp.rank or 0) <= top})
    return out
