"""GLM's tool-call format (`--tool-call-parser glm47`, GLM-4.5 and later):

    <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>

V is decoded as JSON when it parses (or as the type the tool's JSON schema asks for), else kept as a string.
"""

from __future__ import annotations

from dsaserve.server.parsers.output_parser import (
    CallGrammar,
    ToolCall,
    ToolCallFormat,
    convert_value,
    property_schemas,
)
from dsaserve.server.parsers.tool_call_grammar import literal

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"


def parse_tool_call(block: str, schemas: dict[str, dict]) -> ToolCall | None:
    """NAME<arg_key>K</arg_key><arg_value>V</arg_value>… → ToolCall, or None if it is not one."""
    first = block.find(KEY_START)
    name = (block if first < 0 else block[:first]).strip()
    if not name or "<" in name or "\n" in name:
        return None
    properties = property_schemas(schemas, name)
    arguments = {}
    rest = block[first:] if first >= 0 else ""
    while rest.strip():
        key_end, value_start = rest.find(KEY_END), rest.find(VALUE_START)
        value_end = rest.find(VALUE_END, value_start + len(VALUE_START)) if value_start >= 0 else -1
        if not rest.lstrip().startswith(KEY_START) or min(key_end, value_start, value_end) < 0 or value_start < key_end:
            return None
        key = rest[rest.find(KEY_START) + len(KEY_START) : key_end].strip()
        raw = rest[value_start + len(VALUE_START) : value_end]
        arguments[key] = convert_value(raw, properties.get(key))
        rest = rest[value_end + len(VALUE_END) :]
    return ToolCall(name=name, arguments=arguments)


def _parse_block(block: str, schemas: dict[str, dict]) -> list[ToolCall] | None:
    call = parse_tool_call(block, schemas)
    return None if call is None else [call]


# The forced prefix is `<tool_call>` (any call) or `<tool_call>NAME`; a newline may separate the tags, as GLM-4.5
# writes them.
GLM_GRAMMAR = CallGrammar(
    pair=lambda key, value, raw: (f'"\\n"? {literal(KEY_START + key + KEY_END)} "\\n"? {literal(VALUE_START)} {value} '
                                  f'{literal(VALUE_END)}'),
    call=lambda name, arguments: f'{literal(name)} {arguments} "\\n"? {literal(CALL_END)}',
    named_root=lambda arguments: f'{arguments} "\\n"? {literal(CALL_END)}',
    calls_root=lambda call, parallel: f'{call} ("\\n"? {literal(CALL_START)} {call})*' if parallel else call,
    raw_text='([^<] | "<" [^/] | "</" [^a])*',  # no </arg_value> can begin
)

GLM47 = ToolCallFormat("glm47", CALL_START, CALL_END, _parse_block,
                       forced_prefix=lambda name: CALL_START + (name or ""), grammar=GLM_GRAMMAR)
