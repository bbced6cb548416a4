"""Parsers that split model output into reasoning, content and tool calls."""

from dsaserve.server.parsers.dsml import DEEPSEEK_V32
from dsaserve.server.parsers.glm import GLM47
from dsaserve.server.parsers.output_parser import (
    CONTENT,
    REASONING,
    THINK_END,
    THINK_START,
    OutputParser,
    ParsedDelta,
    ToolCall,
    ToolCallFormat,
)

# Both families mark reasoning with <think>…</think>; the names are vLLM's.
REASONING_PARSERS = ("glm45", "deepseek_v3", "none")
TOOL_CALL_FORMATS = {f.name: f for f in (GLM47, DEEPSEEK_V32)}
TOOL_CALL_PARSERS = (*TOOL_CALL_FORMATS, "none")

__all__ = ["CONTENT", "REASONING", "REASONING_PARSERS", "THINK_END", "THINK_START", "TOOL_CALL_FORMATS",
           "TOOL_CALL_PARSERS", "OutputParser", "ParsedDelta", "ToolCall", "ToolCallFormat"]
