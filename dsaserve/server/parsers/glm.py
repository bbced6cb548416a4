"""GLM output parsing: `<think>…</think>` reasoning and `<tool_call>…</tool_call>` tool calls.

One incremental state machine serves streaming and non-streaming alike (non-streaming feeds the
whole text at once), so both produce the same result whatever the chunking. Text that could be the
start of a tag is held back until it is known not to be one, so partial tags never reach `content`.

Formats (GLM-4.5 and later; `--reasoning-parser glm45`, `--tool-call-parser glm47`):
    <think>reasoning</think>content
    <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>
V is decoded as JSON when it parses (or as the type the tool's JSON schema asks for), else kept as
a string.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"

REASONING, CONTENT, TOOL_CALL = "reasoning", "content", "tool_call"


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        if index is not None:
            out["index"] = index
        return out


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class GlmOutputParser:
    """Feed text deltas with `feed`; call `finish` once at the end. Each returns what became certain."""

    def __init__(self, reasoning: bool = True, tools: bool = True, start_in: str = CONTENT,
                 tool_schemas: dict[str, dict] | None = None, prefix: str = ""):
        self.reasoning_enabled = reasoning
        self.tools_enabled = tools
        self.state = REASONING if (start_in == REASONING and reasoning) else CONTENT
        self.start_decided = self.state == REASONING or not reasoning  # may the output still open <think>?
        self.strip_leading = True  # content starts without the whitespace GLM puts after tags
        self.schemas = tool_schemas or {}
        self.buffer = prefix  # text seen but not yet decided
        self.num_calls = 0

    def feed(self, text: str, last: bool = False) -> ParsedDelta:
        """What `text` decides; with `last`, also what finish() releases (the output has ended)."""
        self.buffer += text
        out = ParsedDelta()
        while self._step(out, final=False):
            pass
        if last:
            tail = self.finish()
            out.reasoning, out.content = out.reasoning + tail.reasoning, out.content + tail.content
            out.tool_calls += tail.tool_calls
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        while self._step(out, final=True):
            pass
        if self.buffer:  # an unterminated block: its text stays where it was heading
            if self.state == REASONING:
                out.reasoning += self.buffer
            else:
                out.content += self.buffer
            self.buffer = ""
        return out

    def _step(self, out: ParsedDelta, final: bool) -> bool:
        """Consume what the buffer decides; True when the state changed (so run again)."""
        if self.state == REASONING:
            return self._reasoning_step(out, final)
        if self.state == TOOL_CALL:
            return self._tool_call_step(out)
        return self._content_step(out, final)

    def _reasoning_step(self, out: ParsedDelta, final: bool) -> bool:
        index = self.buffer.find(THINK_END)
        if index >= 0:
            out.reasoning += self.buffer[:index]
            self.buffer = self.buffer[index + len(THINK_END) :]
            self.state, self.strip_leading = CONTENT, True
            return True
        keep = 0 if final else _partial_suffix(self.buffer, THINK_END)
        out.reasoning += self.buffer[: len(self.buffer) - keep]
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return False

    def _tool_call_step(self, out: ParsedDelta) -> bool:
        end = self.buffer.find(CALL_END)
        if end < 0:
            return False
        block, self.buffer = self.buffer[len(CALL_START) : end], self.buffer[end + len(CALL_END) :]
        call = parse_tool_call(block, self.schemas)
        if call is None:
            out.content += CALL_START + block + CALL_END
        else:
            out.tool_calls.append(call)
            self.num_calls += 1
        self.state, self.strip_leading = CONTENT, True
        return True

    def _content_step(self, out: ParsedDelta, final: bool) -> bool:
        if self.strip_leading:
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return False
            self.strip_leading = False
        if not self.start_decided:
            if self.buffer.startswith(THINK_START):  # the model opened its reasoning itself
                self.buffer = self.buffer[len(THINK_START) :]
                self.state, self.start_decided = REASONING, True
                return True
            if not final and THINK_START.startswith(self.buffer):
                return False
            self.start_decided = True
        keep = 0
        if self.tools_enabled:
            index = self.buffer.find(CALL_START)
            if index >= 0:
                out.content += self.buffer[:index]
                self.buffer = self.buffer[index:]
                self.state = TOOL_CALL
                return True
            keep = 0 if final else _partial_suffix(self.buffer, CALL_START)
        out.content += self.buffer[: len(self.buffer) - keep]
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return False


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_tool_call(block: str, schemas: dict[str, dict]) -> ToolCall | None:
    """NAME<arg_key>K</arg_key><arg_value>V</arg_value>… → ToolCall, or None if it is not one."""
    first = block.find(KEY_START)
    name = (block if first < 0 else block[:first]).strip()
    if not name or "<" in name or "\n" in name:
        return None
    schema = schemas.get(name)
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}  # (a malformed schema converts nothing)
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


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
               "array": list, "null": type(None)}


def convert_value(raw: str, schema: dict | None):
    """JSON when it parses, else the string; a schema type narrows that choice. Never raises: a schema it cannot
    read keeps the raw text."""
    wanted = schema.get("type") if isinstance(schema, dict) else None
    wanted = wanted if isinstance(wanted, list) else [wanted] if wanted else []
    if "string" in wanted and len(wanted) == 1:
        return raw
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, ValueError):
        return raw
    if not wanted:
        return value
    for t in wanted:
        py = _JSON_TYPES.get(t) if isinstance(t, str) else None
        if py is not None and isinstance(value, py) and not (t in ("integer", "number") and isinstance(value, bool)):
            return value
    return raw
