"""Checks of client input that the request models cannot express: text the tokenizer cannot take,
template variables a client may not set, and prompts too long to be worth tokenizing."""

from __future__ import annotations

from dsaserve.server.protocol import APIError

# Content parts carrying an image, video or audio: GLM-5.3-Flash ships a vision tower, dsaserve serves its text model.
MEDIA_PARTS = ("image_url", "input_image", "image", "video_url", "input_audio", "audio_url", "input_file")


def media_refusal(kind: str, path: str) -> APIError:
    """The 400 for a media part at `path`, saying it is not served (instead of a schema error about 'text')."""
    return APIError(400, f"{path}: {kind!r} content is not served yet (dsaserve serves text models and the text part "
                         "of multimodal ones); send 'text' parts", param=path)


# Variables the server itself passes to the chat template.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})


def unencodable_field(value, path: str = "") -> str | None:
    """The dotted path of the first string that is not valid Unicode text (a lone surrogate such as
    "\\ud800", which JSON allows but UTF-8 cannot encode), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and unencodable_field(key, path) is not None:
            return f"{path}.{key}".lstrip(".") if path else "body"
        found = unencodable_field(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def check_encodable(request) -> None:
    """400 naming the field when any string of the request cannot be encoded as UTF-8."""
    field = unencodable_field(request.model_dump(exclude_none=True))
    if field is not None:
        raise APIError(400, f"{field} contains text that is not valid Unicode (a lone surrogate such as \\ud800); "
                            "send UTF-8 text", param=field)


def check_template_kwargs(kwargs: dict | None) -> None:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs or ()))
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them from the "
                            "request's own fields", param="chat_template_kwargs")


# The prefix tokenized first when a prompt is long: this many characters per token of context.
PREFIX_CHARS_PER_TOKEN = 8
BOUNDARY_TOKENS = 16  # a prefix may tokenize a few tokens differently at its cut


def encode_bounded(tokenizer, text: str, max_tokens: int, max_chars: int, param: str,
                   add_special_tokens: bool = True) -> list[int]:
    """Token ids of text, refusing one that cannot fit max_tokens without tokenizing all of it: first by
    its length in characters, then, for a long text, by the tokens of a prefix of it."""
    check_prompt_chars(text, max_chars, param)
    head = max_tokens * PREFIX_CHARS_PER_TOKEN
    if len(text) > head:
        prefix = tokenizer.encode(text[:head], add_special_tokens=add_special_tokens)
        if len(prefix) > max_tokens + BOUNDARY_TOKENS:
            raise APIError(400, f"{param} has more than {max_tokens} tokens (its first {head} characters alone are "
                                f"{len(prefix)}), more than the model's context holds; shorten it", param=param,
                           code="context_length_exceeded")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_prompt_chars(text: str, max_chars: int, param: str) -> None:
    """Refuse text that could not fit max_model_len even at the longest token, before tokenizing it."""
    if len(text) > max_chars:
        raise APIError(400, f"{param} has {len(text)} characters, more than the {max_chars} that the model's "
                            "context could hold at the longest token; shorten it", param=param,
                       code="context_length_exceeded")
