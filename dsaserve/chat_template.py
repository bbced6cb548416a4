"""Render the checkpoint's own jinja chat template, sandboxed, with the variables HF templates expect."""

from __future__ import annotations

import json
from datetime import datetime

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template could not be rendered for these messages (a client error)."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"the chat template does not parse: {e}") from e
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}

    def render(self, messages: list[dict], /, tools: list[dict] | None = None, add_generation_prompt: bool = True,
               **template_kwargs) -> str:
        """template_kwargs are any further template variables (even one named "self")."""
        variables = dict(self.special_tokens)
        variables.update(template_kwargs)
        variables.update(messages=[_for_template(m) for m in messages], tools=tools or None,
                         add_generation_prompt=add_generation_prompt)
        try:
            return self.template.render(variables)  # a dict, so a variable may be named "self"
        except ChatTemplateError:
            raise
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template failed for these messages: {e}") from e


def _for_template(message: dict) -> dict:
    """Templates index tool-call arguments as a mapping; OpenAI clients send them as a JSON string."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    message = dict(message)
    message["tool_calls"] = []
    for call in calls:
        call = dict(call)
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass
        call["function"] = function
        message["tool_calls"].append(call)
    return message
