"""The grammar of a forced tool call, so `tool_choice: "required"` or a named function yields calls whose
arguments fit the tools' schemas, written in the model family's format (its ToolCallFormat's CallGrammar).

The prompt already ends with the format's forced prefix (the call opened, and named when one function is
forced); the grammar covers the rest, in the form the family's parser reads. A plain string argument is written
raw (the parser keeps it as text; it may hold `<`, but not the start of the markup that closes the value), any
other value as JSON for its schema. Properties come in the schema's order, required ones always.
"""

from __future__ import annotations

import json
import re

from dsaserve.server.parsers.output_parser import CallGrammar
from dsaserve.structured_output.compiler import json_grammar
from dsaserve.structured_output.schema_support import unsupported_feature

# A string schema with only these keys is written raw; `format` is not enforced on raw strings (as
# jsonschema treats it: an annotation unless asked).
_RAW_STRING_KEYS = {"type", "description", "title", "enum", "pattern", "format", "minLength", "maxLength", "default",
                    "examples"}


class ToolSchemaError(ValueError):
    """A tool's parameters use a schema feature the grammar cannot enforce."""


def tool_call_grammar(xgrammar, shape: CallGrammar, schemas: dict[str, dict], named: str | None,
                      parallel: bool) -> str:
    """EBNF for what follows the prompt: the named call's arguments, or one or more calls to any tool."""
    rules: list[str] = []
    for i, (name, schema) in enumerate(schemas.items()):
        problem = unsupported_feature(schema)
        if problem:
            raise ToolSchemaError(f"tool {name!r}: {problem}")
        rules.append(f"args_{i} ::= {_arguments(xgrammar, shape, f'f{i}', schema or {}, rules)}")
    names = list(schemas)
    if named is not None:
        root = shape.named_root(f"args_{names.index(named)}")
    else:
        rules.append("call ::= " + " | ".join(shape.call(n, f"args_{i}") for i, n in enumerate(names)))
        root = shape.calls_root("call", parallel)
    return "\n".join([f"root ::= {root}"] + rules)


def _arguments(xgrammar, shape: CallGrammar, prefix: str, schema: dict, rules: list[str]) -> str:
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    parts = []
    for j, (key, prop) in enumerate(properties.items()):
        value, raw = _value(xgrammar, shape, f"{prefix}_p{j}", prop if isinstance(prop, dict) else {}, rules)
        rules.append(f"{prefix}_p{j} ::= {shape.pair(key, value, raw)}")
        parts.append(f"{prefix}_p{j}" + ("" if key in required else "?"))
    return " ".join(parts) or '""'


def _value(xgrammar, shape: CallGrammar, name: str, schema: dict, rules: list[str]) -> tuple[str, bool]:
    """The rule for one argument value, and whether it is raw text (a plain string) rather than JSON."""
    if schema.get("type") == "string" and set(schema) <= _RAW_STRING_KEYS:
        if isinstance(schema.get("enum"), list) and all(isinstance(e, str) for e in schema["enum"]):
            return "(" + " | ".join(literal(e) for e in schema["enum"]) + ")", True
        if isinstance(schema.get("pattern"), str):
            rules.append(_renamed(str(xgrammar.Grammar.from_regex(schema["pattern"])), name))
            return f"{name}_root", True
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if low or high is not None:  # counted in characters: no `<` at all then
            return f"[^<]{{{low},{'' if high is None else high}}}", True
        return shape.raw_text, True
    rules.append(_renamed(json_grammar(xgrammar, json.dumps(schema), strict=True), name))
    return f"{name}_root", False


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*')


def _renamed(ebnf: str, prefix: str) -> str:
    """ebnf with every rule name prefixed (string literals and character classes left alone), so several
    JSON sub-grammars live in one grammar."""
    names = {line.split("::=")[0].strip() for line in ebnf.splitlines() if "::=" in line}
    return _TOKEN.sub(lambda m: f"{prefix}_{m.group(0)}" if m.group(0) in names else m.group(0), ebnf)


def literal(text: str) -> str:
    """text as an EBNF string literal."""
    return json.dumps(text, ensure_ascii=False)
