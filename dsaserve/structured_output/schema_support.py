"""JSON-schema features xgrammar would silently ignore, so a request using them gets a 400 instead.

Measured against xgrammar 0.2.9: it enforces types, enum/const, properties/required/additionalProperties,
anyOf/oneOf, local $ref, string length/pattern/most formats, number bounds and multipleOf, array
items/prefixItems/minItems/maxItems, min/maxProperties, patternProperties and propertyNames. The keywords
below it accepts and then does not enforce.
"""

from __future__ import annotations

IGNORED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                    "contains", "minContains", "maxContains", "unevaluatedItems", "$dynamicRef")
KNOWN_FORMATS = frozenset((
    "email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6", "hostname", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
))
# Keywords whose value is a schema, a list of schemas, or a map of name → schema.
_SCHEMA_KEYS = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "additionalItems")
_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions")


def unsupported_feature(schema, path: str = "") -> str | None:
    """A description of the first unsupported feature in `schema` (with its JSON path), or None."""
    if not isinstance(schema, dict):
        return None
    where = path or "the schema root"
    for key in IGNORED_KEYWORDS:
        if key in schema:
            return f"'{key}' at {where} is not supported by structured output; remove it"
    if schema.get("uniqueItems") is True:
        return f"'uniqueItems' at {where} is not supported by structured output; remove it"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"'allOf' with several schemas at {where} is not supported by structured output; merge them into one"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"'$ref' {ref!r} at {where} points outside the schema; only local references ('#/...') are supported"
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in KNOWN_FORMATS:
        return (f"'format': {fmt!r} at {where} is not supported by structured output; "
                f"supported: {', '.join(sorted(KNOWN_FORMATS))}")
    for key, value in _children(schema):
        found = unsupported_feature(value, f"{path}/{key}")
        if found:
            return found
    return None


def _children(schema: dict):
    for key in _SCHEMA_KEYS:
        if isinstance(schema.get(key), dict):
            yield key, schema[key]
    for key in _LIST_KEYS:
        if isinstance(schema.get(key), list):
            yield from ((f"{key}/{i}", s) for i, s in enumerate(schema[key]))
    for key in _MAP_KEYS:
        if isinstance(schema.get(key), dict):
            yield from ((f"{key}/{name}", s) for name, s in schema[key].items())


_TYPES = frozenset(("string", "integer", "number", "boolean", "object", "array", "null"))


def misshapen(schema, path: str) -> str | None:
    """The first place where `schema` is not a JSON schema in shape (a subschema neither an object nor a boolean, a
    keyword holding the wrong kind of value), with its dotted path from `path`; None where it is one."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{path} must be a JSON schema (an object), not {type(schema).__name__} {_shown(schema)}"
    kind = schema.get("type")
    if kind is not None and not (isinstance(kind, str) and kind in _TYPES
                                 or isinstance(kind, list) and all(isinstance(k, str) and k in _TYPES for k in kind)):
        return f"{path}.type must be one of {', '.join(sorted(_TYPES))} (or a list of them), not {_shown(kind)}"
    for key, want in (("required", list), ("enum", list), *((k, dict) for k in _MAP_KEYS),
                      *((k, list) for k in _LIST_KEYS)):
        if key in schema and not isinstance(schema[key], want):
            return f"{path}.{key} must be {'a list' if want is list else 'an object'}, not {_shown(schema[key])}"
    if isinstance(schema.get("required"), list) and not all(isinstance(r, str) for r in schema["required"]):
        return f"{path}.required must list property names (strings)"
    for key in _SCHEMA_KEYS:
        value = schema.get(key)
        children = enumerate(value) if key == "items" and isinstance(value, list) else None  # (tuple form)
        found = (next((f for i, s in children if (f := misshapen(s, f"{path}.{key}.{i}"))), None) if children
                 else misshapen(value, f"{path}.{key}") if key in schema else None)
        if found:
            return found
    for key in _LIST_KEYS:
        for i, sub in enumerate(schema.get(key, ())):
            if found := misshapen(sub, f"{path}.{key}.{i}"):
                return found
    for key in _MAP_KEYS:
        for name, sub in schema.get(key, {}).items():
            if found := misshapen(sub, f"{path}.{key}.{name}"):
                return found
    return None


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
