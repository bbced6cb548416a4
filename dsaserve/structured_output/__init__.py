"""Structured output: a grammar (JSON schema, regex, choice, EBNF) that every generated token must keep valid.

Compiled once per spec with xgrammar on the admitting caller's thread (never in an engine step), then
applied each step as a token bitmask on the logits of the requests that asked for it.
"""

from dsaserve.structured_output.params import ReasoningMarkers, StructuredOutputsParams

__all__ = ["ReasoningMarkers", "StructuredOutputsParams"]
