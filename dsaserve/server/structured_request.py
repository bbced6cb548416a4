"""The request's output constraint: `response_format` (OpenAI) or `structured_outputs` (vLLM), or the
tool-call grammar a forced `tool_choice` implies, as engine StructuredOutputsParams."""

from __future__ import annotations

from dsaserve.server.parsers import ToolCallFormat
from dsaserve.server.parsers.tool_call_grammar import ToolSchemaError, tool_call_grammar
from dsaserve.server.protocol import APIError, SamplingFields
from dsaserve.structured_output import ReasoningMarkers, StructuredOutputsParams


def requested_constraint(req: SamplingFields,
                         reasoning: ReasoningMarkers | None = None) -> StructuredOutputsParams | None:
    fmt, so = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
    if fmt is not None and fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True, reasoning=reasoning)
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format type 'json_schema' needs json_schema.schema (a JSON schema object)",
                           param="response_format.json_schema.schema")
        try:
            return StructuredOutputsParams(json=fmt.json_schema.schema_, reasoning=reasoning)
        except ValueError as e:  # the size limit, named as the engine names it
            message = str(e).replace("structured_outputs.json", "response_format.json_schema.schema")
            raise APIError(400, message, param="response_format.json_schema.schema") from None
    if so is None:
        return None
    try:
        return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                       json_object=bool(so.json_object), reasoning=reasoning)
    except ValueError as e:
        raise APIError(400, str(e), param="structured_outputs") from None


def forced_tool_constraint(tool_format: ToolCallFormat, schemas: dict[str, dict], named: str | None,
                           parallel: bool) -> StructuredOutputsParams | None:
    """The grammar of the forced call(s); None without xgrammar (the call is then only opened in the prompt)."""
    try:
        import xgrammar
    except ImportError:
        return None
    try:
        return StructuredOutputsParams(grammar=tool_call_grammar(xgrammar, tool_format.grammar, schemas, named,
                                                                    parallel))
    except ToolSchemaError as e:
        raise APIError(400, str(e), param="tools") from None
    except (ValueError, RuntimeError) as e:  # too large a grammar, or a schema xgrammar cannot convert
        raise APIError(400, f"the tools' parameter schemas cannot be enforced as a grammar: {e}",
                       param="tools") from None
