"""Request models of the OpenAI-compatible API (pydantic, strict types) and the OpenAI error body."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dsaserve.structured_output.schema_support import misshapen

MAX_LOGPROBS = 20


class APIError(Exception):
    """A client-visible error: HTTP status + OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or ("invalid_request_error" if status < 500 else "internal_error")
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionDefinition(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def parameters_are_an_object_schema(cls, value):
        if value is not None:
            if value.get("type", "object") != "object":
                raise ValueError("function.parameters must be a JSON schema of type 'object'")
            if problem := misshapen(value, "function.parameters"):
                raise ValueError(problem)
        return value


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ContentPart(Strict):
    type: Literal["text"]
    text: str


# Ids and names a chat template does not render escape the context limit, yet a stored conversation keeps them
# (POST /v1/responses): bounded like OpenAI's own (call ids of ~30 characters).
MAX_ID_CHARS = 512
Identifier = Annotated[str, Field(max_length=MAX_ID_CHARS)]


class FunctionCall(Strict):
    name: str
    arguments: str | dict


class ToolCallMessage(Strict):
    id: Identifier | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: Identifier | None = None
    name: Identifier | None = None

    def for_template(self) -> dict:
        out = {"role": "system" if self.role == "developer" else self.role}
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out["content"] = content if content is not None else ""
        for key in ("reasoning_content", "tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


Probability = Annotated[float, Field(ge=0, le=1)]

# The efforts OpenAI's API and GLM's own API name; the chat template maps them to what the model knows (GLM-5.3:
# low, high, else max; GLM-5.2: high, else max).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class JsonSchemaFormat(Strict):
    name: str = "response"
    description: str | None = None
    schema_: Annotated[dict | None, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(Strict):
    """vLLM's `structured_outputs` request field: exactly one of these."""

    json_: Annotated[dict | str | None, Field(alias="json")] = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None  # refused with a 400 naming it


class SamplingFields(Strict):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Probability | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(ge=0.01, le=100)] = 1.0
    logit_bias: dict[str, float] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    def check_unsupported(self) -> None:
        if self.structured_outputs is not None and self.structured_outputs.structural_tag is not None:
            raise APIError(400, "structured_outputs.structural_tag is not supported; "
                                "use json, regex, choice or grammar",
                           param="structured_outputs.structural_tag")


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    parallel_tool_calls: bool | None = None
    reasoning_effort: ReasoningEffort | None = None  # passed to the chat template as `reasoning_effort`

    def template_kwargs(self) -> dict:
        """The chat template's variables beyond messages and tools: chat_template_kwargs plus reasoning_effort."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            given = kwargs.setdefault("reasoning_effort", self.reasoning_effort)
            if given != self.reasoning_effort:
                raise APIError(400, f"reasoning_effort is {self.reasoning_effort!r} but "
                                    f"chat_template_kwargs.reasoning_effort is {given!r}; set only one of them",
                               param="reasoning_effort")
        return kwargs


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: int | None = None  # only as many as n: dsaserve does not rank extra samples
    echo: bool = False
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of={self.best_of} is not supported (it would rank extra samples); "
                                "use n", param="best_of")

    @field_validator("prompt")
    @classmethod
    def prompt_not_empty(cls, value):
        if isinstance(value, list) and len(value) == 0:
            raise ValueError("prompt must not be an empty list")
        return value
