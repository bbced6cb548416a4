"""Model output parsing: `<think>…</think>` reasoning, content, and tool-call blocks in a model family's format.

One incremental state machine serves streaming and non-streaming alike (non-streaming feeds the
whole text at once), so both produce the same result whatever the chunking. Text that could be the
start of a tag is held back until it is known not to be one, so partial tags never reach `content`.

The reasoning markers are GLM's and DeepSeek's alike (`--reasoning-parser glm45` / `deepseek_v3`); the tool-call
block is the family's ToolCallFormat: GLM's `<tool_call>…</tool_call>` (parsers/glm.py, `glm47`) or DeepSeek-V3.2's
DSML `<｜DSML｜function_calls>…</｜DSML｜function_calls>` (parsers/dsml.py, `deepseek_v32`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

THINK_START, THINK_END = "<think>", "</think>"

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


@dataclass(frozen=True)
class CallGrammar:
    """A format's tool calls as EBNF pieces (parsers/tool_call_grammar.py puts them together)."""

    pair: Callable[[str, str, bool], str]  # (key, value rule, value is raw text) → one argument
    call: Callable[[str, str], str]  # (function name, arguments rule) → one whole call after the opening
    named_root: Callable[[str], str]  # arguments rule → the rest after a prefix that opens and names the call
    calls_root: Callable[[str, bool], str]  # (call rule, parallel) → the rest after a prefix that opens a call
    raw_text: str  # a raw string value: any text in which the markup that ends it cannot begin


@dataclass(frozen=True)
class ToolCallFormat:
    """How a family writes tool calls: a block between `start` and `end` that `parse` reads."""

    name: str  # the --tool-call-parser value
    start: str
    end: str
    parse: Callable[[str, dict[str, dict]], list[ToolCall] | None]  # the block's body → its calls, or None
    forced_prefix: Callable[[str | None], str]  # what a forced tool_choice (a function name, or any) opens
    grammar: CallGrammar  # what follows forced_prefix, as a grammar
    trims_before: bool = False  # whitespace right before a block is part of the markup, not content


class OutputParser:
    """Feed text deltas with `feed`; call `finish` once at the end. Each returns what became certain."""

    def __init__(self, tool_format: ToolCallFormat, reasoning: bool = True, tools: bool = True,
                 start_in: str = CONTENT, tool_schemas: dict[str, dict] | None = None, prefix: str = ""):
        self.format = tool_format
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
        start, end = self.format.start, self.format.end
        index = self.buffer.find(end)
        if index < 0:
            return False
        block, self.buffer = self.buffer[len(start) : index], self.buffer[index + len(end) :]
        calls = self.format.parse(block, self.schemas)
        if calls is None:
            out.content += start + block + end
        else:
            out.tool_calls += calls
            self.num_calls += len(calls)
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
            start = self.format.start
            index = self.buffer.find(start)
            if index >= 0:
                before = self.buffer[:index]
                out.content += before.rstrip() if self.format.trims_before else before
                self.buffer = self.buffer[index:]
                self.state = TOOL_CALL
                return True
            keep = 0 if final else _partial_suffix(self.buffer, start)
            if self.format.trims_before and not final:  # held until it is known not to precede a block
                decided = self.buffer[: len(self.buffer) - keep]
                keep += len(decided) - len(decided.rstrip())
        out.content += self.buffer[: len(self.buffer) - keep]
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return False


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def property_schemas(schemas: dict[str, dict], name: str) -> dict:
    """The schemas of tool `name`'s arguments by name ({} for an unknown tool or a malformed schema)."""
    schema = schemas.get(name)
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return properties if isinstance(properties, dict) else {}


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
