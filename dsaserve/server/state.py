"""What the request handlers share: the engine, server settings, metrics, and request → SamplingParams."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dsaserve.chat_format import ChatFormat
from dsaserve.engine.admission import EngineRequest, RequestRejected
from dsaserve.engine.async_llm_engine import AsyncLLMEngine
from dsaserve.outputs import RequestOutput
from dsaserve.sampling_params import SamplingParams, SamplingParamsError
from dsaserve.server.metrics import ServerMetrics
from dsaserve.server.parsers import TOOL_CALL_FORMATS, ToolCallFormat
from dsaserve.server.protocol import APIError, SamplingFields

# A token's text is at most Tokenizer.max_token_chars; Unicode normalization can merge a few input
# characters into one (a letter and its combining accent), so the character pre-check allows this many.
NORMALIZATION_SLACK = 4


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    body_timeout: float = 30.0  # seconds a client may take to send its request body
    reasoning_parser: str | None = "auto"  # "auto": the model family's (serve() resolves it); None: off
    tool_call_parser: str | None = "auto"
    idle_shutdown: float | None = None
    responses_store_max_bytes: int = 64 << 20  # stored /v1/responses conversations, for previous_response_id
    allowed_hosts: list[str] | None = None  # Host header names answered (None: any)
    shutdown_timeout: float = 600.0  # seconds in-flight requests may take to finish after SIGTERM
    header_timeout: float = 30.0  # seconds a connection may take to send a request's headers
    max_connections: int | None = 1000  # open connections; one past it is answered 503 and closed
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])  # CORS, vLLM's defaults
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    config: ServerConfig
    chat_template: ChatFormat | None
    metrics: ServerMetrics
    in_flight: int = 0  # HTTP requests at the guard, refused ones included
    running: int = 0  # those past its checks, being answered
    last_activity: float = field(default_factory=time.monotonic)
    draining: bool = False  # set on SIGTERM: new /v1 requests get 503
    cut_at: float | None = None  # while draining: when requests still running are ended with an error
    cut: bool = False  # some were

    @property
    def tool_format(self) -> ToolCallFormat:
        """How tool calls are written: --tool-call-parser's format, the model family's when that is none (a forced
        tool_choice still opens a call in it)."""
        name = self.config.tool_call_parser
        if name in (None, "auto"):
            name = self.engine.model_config.family.tool_call_parser
        return TOOL_CALL_FORMATS[name]

    def start_draining(self) -> None:
        self.draining = True
        self.cut_at = time.monotonic() + self.config.shutdown_timeout

    def cut_running(self) -> None:
        """End every request still running with a 503 (in a stream: an error event, then [DONE])."""
        self.cut = True
        self.engine.end_all(APIError(503, "the server shut down before this request finished (--shutdown-timeout "
                                          f"{self.config.shutdown_timeout:g} s)", code="server_shutting_down"))

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * self.engine.tokenizer.max_token_chars * NORMALIZATION_SLACK

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.config.model_name}`",
                           param="model", type_="NotFoundError", code="model_not_found")

    def admit(self, request_id: str, req: SamplingFields, prompt_ids: list[int], max_tokens: int | None,
              prompt_param: str, max_tokens_param: str = "max_tokens", **extra) -> EngineRequest:
        """The request's SamplingParams, through the engine's one admission check. Prompt + max_tokens over
        max_model_len is a 400 (as in vLLM); without max_tokens the output may fill the context. Everything
        the engine would refuse is refused here, before a response (or a stream) starts."""
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, and the prompt "
                                f"has {len(prompt_ids)} tokens; shorten the prompt", param=prompt_param,
                           code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {len(prompt_ids) + max_tokens} tokens "
                                f"({len(prompt_ids)} in the {prompt_param}, "
                                f"{max_tokens} in the completion). Reduce the length of the {prompt_param} or "
                                f"{max_tokens_param}.", param=max_tokens_param, code="context_length_exceeded")
        top_k = req.top_k if req.top_k not in (None, -1) else 0
        try:
            params = SamplingParams(
                n=req.n, max_tokens=max_tokens or room,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
                min_p=0.0 if req.min_p is None else req.min_p, seed=req.seed, stop=req.stop,
                stop_token_ids=req.stop_token_ids, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                logit_bias=req.logit_bias, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
                skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
                **extra,
            )
            # fixed limits only: safe off the engine thread
            return self.engine.make_request(request_id, prompt_ids, params)
        except SamplingParamsError as e:
            raise APIError(400, str(e), param=e.param) from e
        except RequestRejected as e:
            raise APIError(400, str(e), param=_param(e.param, req, prompt_param)) from e

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Engine outputs with TTFT / inter-token latency recorded."""
        start = time.monotonic()
        last = None
        async for out in self.engine.stream(request):
            t = time.monotonic()
            if any(c.token_ids for c in out.outputs):
                if last is None:
                    self.metrics.ttft.observe(t - start)
                else:
                    self.metrics.itl.observe(t - last)
                last = t
            if out.finished:
                self.metrics.e2e.observe(t - start)
            yield out


def _param(param: str, req: SamplingFields, prompt_param: str) -> str:
    """The engine's name for a rejected field, as the client spelled it."""
    if param == "prompt":
        return prompt_param
    if param == "structured_outputs" and req.response_format is not None:
        return "response_format"
    return param
