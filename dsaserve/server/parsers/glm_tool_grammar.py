"""The grammar of GLM tool calls, so `tool_choice: "required"` or a named function yields a call whose
arguments fit the tool's schema.

The prompt already ends with `<tool_call>` (required) or `<tool_call>NAME` (named); the grammar covers
the rest, in the format the glm47 parser reads:
    NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>
A plain string argument is written raw (the parser keeps it as text; it may hold `<`, but not the
sequence `</a` with which `</arg_value>` begins, nor end in `<` or `</`), any other value as JSON for
its schema. Properties come in the schema's order, required ones always; a newline may separate the tags,
as GLM-4.5 writes them.
"""

from __future__ import annotations

import json
import re

from dsaserve.server.parsers.glm import CALL_END, CALL_START, KEY_END, KEY_START, VALUE_END, VALUE_START
from dsaserve.structured_output.compiler import json_grammar
from dsaserve.structured_output.schema_support import unsupported_feature

# A string schema with only these keys is written raw; `format` is not enforced on raw strings (as
# jsonschema treats it: an annotation unless asked).
_RAW_STRING_KEYS = {"type", "description", "title", "enum", "pattern", "format", "minLength", "maxLength", "default",
                    "examples"}


class ToolSchemaError(ValueError):
    """A tool's parameters use a schema feature the grammar cannot enforce."""


def tool_call_grammar(xgrammar, schemas: dict[str, dict], named: str | None, parallel: bool) -> str:
    """EBNF for what follows the prompt: the named call's arguments, or one or more calls to any tool."""
    rules: list[str] = []
    for i, (name, schema) in enumerate(schemas.items()):
        problem = unsupported_feature(schema)
        if problem:
            raise ToolSchemaError(f"tool {name!r}: {problem}")
        rules.append(f"args_{i} ::= {_arguments(xgrammar, f'f{i}', schema or {}, rules)}")
    names = list(schemas)
    if named is not None:
        root = f'args_{names.index(named)} "\\n"? {_lit(CALL_END)}'
    else:
        rules.append("call ::= " + " | ".join(f'{_lit(n)} args_{i} "\\n"? {_lit(CALL_END)}'
                                              for i, n in enumerate(names)))
        root = f'call ("\\n"? {_lit(CALL_START)} call)*' if parallel else "call"
    return "\n".join([f"root ::= {root}"] + rules)


def _arguments(xgrammar, prefix: str, schema: dict, rules: list[str]) -> str:
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    parts = []
    for j, (key, prop) in enumerate(properties.items()):
        value = _value(xgrammar, f"{prefix}_p{j}", prop if isinstance(prop, dict) else {}, rules)
        pair = f'"\\n"? {_lit(KEY_START + key + KEY_END)} "\\n"? {_lit(VALUE_START)} {value} {_lit(VALUE_END)}'
        rules.append(f"{prefix}_p{j} ::= {pair}")
        parts.append(f"{prefix}_p{j}" + ("" if key in required else "?"))
    return " ".join(parts) or '""'


def _value(xgrammar, name: str, schema: dict, rules: list[str]) -> str:
    """The rule for one argument value: raw text for a plain string, else JSON for its schema."""
    if schema.get("type") == "string" and set(schema) <= _RAW_STRING_KEYS:
        if isinstance(schema.get("enum"), list) and all(isinstance(e, str) for e in schema["enum"]):
            return "(" + " | ".join(_lit(e) for e in schema["enum"]) + ")"
        if isinstance(schema.get("pattern"), str):
            rules.append(_renamed(str(xgrammar.Grammar.from_regex(schema["pattern"])), name))
            return f"{name}_root"
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if low or high is not None:  # counted in characters: no `<` at all then
            return f"[^<]{{{low},{'' if high is None else high}}}"
        return RAW_TEXT
    rules.append(_renamed(json_grammar(xgrammar, json.dumps(schema), strict=True), name))
    return f"{name}_root"


RAW_TEXT = '([^<] | "<" [^/] | "</" [^a])*'  # any text in which </arg_value> cannot begin

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*')


def _renamed(ebnf: str, prefix: str) -> str:
    """ebnf with every rule name prefixed (string literals and character classes left alone), so several
    JSON sub-grammars live in one grammar."""
    names = {line.split("::=")[0].strip() for line in ebnf.splitlines() if "::=" in line}
    return _TOKEN.sub(lambda m: f"{prefix}_{m.group(0)}" if m.group(0) in names else m.group(0), ebnf)


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
