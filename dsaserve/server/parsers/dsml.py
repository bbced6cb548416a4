"""DeepSeek-V3.2's tool-call format, DSML (`--tool-call-parser deepseek_v32`): after the answer's text, a blank line
and one block of one or more calls,

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="K" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="N" string="false">JSON</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

`string="true"` marks a value written as is, `string="false"` one written as JSON. A block that does not read
this way is kept as content.
"""

from __future__ import annotations

import re

from dsaserve.server.parsers.output_parser import (
    CallGrammar,
    ToolCall,
    ToolCallFormat,
    convert_value,
    property_schemas,
)
from dsaserve.server.parsers.tool_call_grammar import literal

DSML = "｜DSML｜"
CALLS_START, CALLS_END = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
INVOKE_END = f"</{DSML}invoke>"
PARAMETER_END = f"</{DSML}parameter>"

_INVOKE = re.compile(rf'<{DSML}invoke\s+name="([^"<>]+)"\s*>(.*?){re.escape(INVOKE_END)}', re.S)
_PARAMETER = re.compile(rf'<{DSML}parameter\s+name="([^"<>]+)"\s+string="(true|false)"\s*>(.*?)'
                        rf'{re.escape(PARAMETER_END)}', re.S)


def invoke_start(name: str) -> str:
    return f'<{DSML}invoke name="{name}">'


def parameter_start(key: str, string: bool) -> str:
    return f'<{DSML}parameter name="{key}" string="{"true" if string else "false"}">'


def parse_calls(block: str, schemas: dict[str, dict]) -> list[ToolCall] | None:
    """The calls of one block's body (between CALLS_START and CALLS_END), or None if it is not only calls."""
    calls = []
    for body, leftover in _matches(_INVOKE, block):
        if leftover.strip():
            return None
        if body is None:
            break
        name, inner = body.group(1), body.group(2)
        properties = property_schemas(schemas, name)
        arguments = {}
        for parameter, between in _matches(_PARAMETER, inner):
            if between.strip():
                return None
            if parameter is None:
                break
            key, string, raw = parameter.groups()
            if key in arguments:
                return None
            arguments[key] = _value(raw, string == "true", properties.get(key))
        calls.append(ToolCall(name=name, arguments=arguments))
    return calls or None


def _matches(pattern: re.Pattern, text: str):
    """(match, the text before it) for each match in order, then (None, what follows the last)."""
    at = 0
    for match in pattern.finditer(text):
        yield match, text[at : match.start()]
        at = match.end()
    yield None, text[at:]


def _value(raw: str, string: bool, schema: dict | None):
    """A string="true" value is text unless the schema asks for another type; string="false" is JSON."""
    wanted = schema.get("type") if isinstance(schema, dict) else None
    wanted = wanted if isinstance(wanted, list) else [wanted] if wanted else []
    if string and (not wanted or "string" in wanted):
        return raw
    return convert_value(raw, schema)


def _forced_prefix(name: str | None) -> str:
    return f"\n\n{CALLS_START}\n" + (f"{invoke_start(name)}\n" if name else "")


# The forced prefix opens the block (and, for a named function, its invoke) on lines of their own.
DSML_GRAMMAR = CallGrammar(
    pair=lambda key, value, raw: f'{literal(parameter_start(key, raw))} {value} {literal(PARAMETER_END + chr(10))}',
    call=lambda name, arguments: f'{literal(invoke_start(name) + chr(10))} {arguments} {literal(INVOKE_END + chr(10))}',
    named_root=lambda arguments: f'{arguments} {literal(INVOKE_END + chr(10) + CALLS_END)}',
    calls_root=lambda call, parallel: f'{call} {call + "*" if parallel else ""} {literal(CALLS_END)}',
    raw_text=f'([^<] | "<" [^/] | "</" [^{DSML[0]}])*',  # no </｜DSML｜parameter> can begin
)

DEEPSEEK_V32 = ToolCallFormat("deepseek_v32", CALLS_START, CALLS_END, parse_calls, _forced_prefix, DSML_GRAMMAR,
                              trims_before=True)
