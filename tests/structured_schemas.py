"""Twenty JSON schemas for the structured-output tests: nested objects, arrays, enums, required fields,
bounded numbers, anyOf, formats and patterns. Strings and arrays carry length bounds so that a random
model, which never chooses to stop, still reaches the end of every document within the token budget."""

NAME = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "ip": {"type": "string", "format": "ipv4"}},
        "required": ["id"]}}, "required": ["user"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5},
                                                          {"type": "string", "maxLength": 6}]}}, "required": ["value"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "array",
                                                "prefixItems": [{"type": "number", "minimum": -10, "maximum": 10},
                                                                {"type": "number", "minimum": -10, "maximum": 10}],
                                                "items": False}}, "required": ["point"]},
    {"type": "object", "properties": {"status": {"const": "done"},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 3}},
     "required": ["status", "count"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"}}, "required": ["date"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["c"]}}, "required": ["b"]}},
     "required": ["a"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2,
                                                "items": {"type": "object", "properties": {
        "sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 10}}, "required": ["sku", "qty"]}}},
     "required": ["items"]},
    {"type": "object", "properties": {"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 5}},
     "required": ["maybe"]},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                      "legs": {"type": "integer", "minimum": 2, "maximum": 4},
                                      "nick": NAME}, "required": ["kind", "legs"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "exclusiveMinimum": -50,
                                                      "exclusiveMaximum": 60},
                                      "unit": {"enum": ["c", "f"]}}, "required": ["temperature", "unit"]},
    {"type": "object", "$defs": {"node": {"type": "object", "properties": {"label": NAME}, "required": ["label"]}},
     "properties": {"left": {"$ref": "#/$defs/node"}, "right": {"$ref": "#/$defs/node"}},
     "required": ["left", "right"]},
    {"type": "object", "properties": {"choice": {"oneOf": [{"type": "boolean"}, {"enum": ["x", "y"]}]}},
     "required": ["choice"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
        "title": {"type": "string", "minLength": 1, "maxLength": 8}}, "required": ["matrix", "title"]},
]
