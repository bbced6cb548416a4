"""Parsers that split model output into reasoning, content and tool calls."""

from dsaserve.server.parsers.glm import CONTENT, REASONING, GlmOutputParser, ParsedDelta, ToolCall

REASONING_PARSERS = ("glm45", "none")
TOOL_CALL_PARSERS = ("glm47", "none")

__all__ = ["CONTENT", "REASONING", "REASONING_PARSERS", "TOOL_CALL_PARSERS", "GlmOutputParser", "ParsedDelta",
           "ToolCall"]
