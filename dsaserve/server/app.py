"""The FastAPI app: routes, OpenAI error bodies, API key, body size limit, disconnect handling."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsaserve.engine.admission import RequestRejected
from dsaserve.sampling_params import SamplingParamsError
from dsaserve.server.chat import admit_chat, chat_full, chat_stream, prepare_chat
from dsaserve.server.completions import admit_prompts, completion_full, completion_stream, prepare_prompts
from dsaserve.server.input_checks import MEDIA_PARTS, check_encodable, media_refusal
from dsaserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from dsaserve.server.response_pieces import new_id, now
from dsaserve.server.responses_endpoint import ResponsesRequest, ResponseStore
from dsaserve.server.responses_endpoint import respond as respond_to_responses
from dsaserve.server.state import ServerState

logger = logging.getLogger(__name__)


class ErrorJSONResponse(JSONResponse):
    """Error bodies may quote client text, which can hold lone surrogates: they become "?" (valid UTF-8)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8", errors="replace")


RETRY_AFTER = "5"  # seconds, on every 503: draining, a stopped engine, too many connections


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER} if error.status == 503 else None
    return ErrorJSONResponse(error.body(), status_code=error.status, headers=headers)


class GuardMiddleware:
    """Counts requests in flight (for idle shutdown and draining); refuses a Host that is not allowed; on /v1
    refuses new requests while draining (503, Retry-After) and enforces the API key; limits the body's size and
    the time a client may take to send it."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        state.in_flight += 1
        state.last_activity = time.monotonic()
        try:
            error = self._check_host(scope) or self._check_draining(scope) or self._check_key(scope)
            if error is None:
                state.running += 1  # (a drain waits for it)
                try:
                    body, error = await self._read_body(scope, receive)
                    if error is None:
                        return await self._forward(scope, receive, send, body)
                finally:
                    state.running -= 1
            return await error_response(error)(scope, receive, send)
        finally:
            state.in_flight -= 1
            state.last_activity = time.monotonic()

    async def _forward(self, scope, receive, send, body: bytes) -> None:
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the client's disconnect

        await self.app(scope, replay, send)

    def _check_host(self, scope) -> APIError | None:
        """The Host header against --allowed-hosts: a page on another origin cannot reach a loopback server by
        resolving its own name to 127.0.0.1 (DNS rebinding). /health is exempt: probes address a server by its IP,
        and it tells a page nothing."""
        allowed = self.state.config.allowed_hosts
        host = dict(scope["headers"]).get(b"host")
        if allowed is None or "*" in allowed or host is None or scope["path"] == "/health":
            return None
        name = host.decode("latin-1").strip().lower()
        name = name[1:name.find("]")] if name.startswith("[") else name.rsplit(":", 1)[0] if ":" in name else name
        if name in allowed:
            return None
        return APIError(400, f"Host {name!r} is not allowed; this server answers {', '.join(allowed)} "
                             "(--allowed-hosts)", param="host", code="invalid_host")

    def _check_draining(self, scope) -> APIError | None:
        if self.state.draining and scope["path"].startswith("/v1"):
            return APIError(503, "the server is shutting down; retry on another instance", type_="service_unavailable",
                            code="server_shutting_down")
        return None

    def _check_key(self, scope) -> APIError | None:
        key = self.state.config.api_key
        if not key or not scope["path"].startswith("/v1"):
            return None
        sent = [value for name, value in scope["headers"] if name == b"authorization"]
        if len(sent) > 1:
            return APIError(400, f"{len(sent)} Authorization headers; send one", param="authorization",
                            code="invalid_api_key")
        scheme, _, given = (sent[0] if sent else b"").strip().partition(b" ")
        # The scheme is case-insensitive (RFC 7235); keys compare as UTF-8 bytes, in constant time.
        if hmac.compare_digest(given.strip(), key.encode("utf-8")) and scheme.lower() == b"bearer":
            return None
        return APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                        type_="invalid_request_error", code="invalid_api_key")

    async def _read_body(self, scope, receive) -> tuple[bytes, APIError | None]:
        limit = self.state.config.max_body_bytes
        too_big = APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return b"", too_big
        chunks, size = [], 0
        deadline = time.monotonic() + self.state.config.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return b"", APIError(408, "the request body did not arrive within "
                                          f"{self.state.config.body_timeout:g} s", code="request_timeout")
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return b"", too_big
            if not message.get("more_body", False):
                break
        return b"".join(chunks), None


async def until_disconnect(request: Request, coro):
    """Run coro; cancel it (aborting its engine request) if the client goes away first."""
    task = asyncio.ensure_future(coro)
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if not done and await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
        return task.result()
    finally:
        if not task.done():
            task.cancel()


async def respond(request: Request, stream: bool, streamed, full, args: tuple):
    """Server-sent events from streamed(*args) when streaming, else full(*args) as one JSON body."""
    if stream:
        return StreamingResponse(streamed(*args), media_type="text/event-stream")
    return JSONResponse(await until_disconnect(request, full(*args)))


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def field_path(loc) -> list[str]:
    """The request field of a validation error: its location without 'body' and pydantic's union-member tags."""
    path = []
    for item in loc:
        if item == "body":
            continue
        if isinstance(item, str) and (item in _TYPE_TAGS or not re.fullmatch(r"[a-z_][a-z0-9_]*", item)):
            break
        path.append(str(item))
    return path


def validation_message(loc: list[str], msg: str) -> str:
    """pydantic's message with the field's path: a validator that names its own path from the field's parent
    ("function.parameters.properties.city must be …") gets the rest of the path in front of it."""
    msg = msg.removeprefix("Value error, ")
    for k in range(len(loc), 0, -1):
        own = ".".join(loc[-k:])
        if msg.startswith(own + ".") or msg.startswith(own + " "):
            return ".".join(loc[:-k] + [msg])
    return f"{'.'.join(loc)}: {msg}" if loc else msg


def unserved_media(errors) -> APIError | None:
    """A content part carrying an image, video or audio (GLM-5.3-Flash has a vision tower; dsaserve serves its text
    model only): a 400 that says so, instead of pydantic's "Input should be 'text'"."""
    for error in errors:
        raw = tuple(error.get("loc", ()))
        if error.get("type") == "literal_error" and raw[-1:] == ("type",) and error.get("input") in MEDIA_PARTS:
            return media_refusal(error["input"], ".".join(field_path(raw)))
    return None


def build_app(state: ServerState, lifespan=None) -> FastAPI:
    app = FastAPI(title="dsaserve", lifespan=lifespan)
    app.state.dsaserve = state
    response_store = ResponseStore(max_bytes=state.config.responses_store_max_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):
        media = unserved_media(exc.errors())
        if media is not None:
            return error_response(media)
        first = exc.errors()[0] if exc.errors() else {}
        loc = field_path(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return error_response(APIError(400, f"the request body is not valid JSON: {first.get('msg', '')}"))
        param = ".".join(loc) or None
        return error_response(APIError(400, validation_message(loc, first.get("msg", "invalid value")), param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(SamplingParamsError)
    async def _params_error(_, exc: SamplingParamsError):
        return error_response(APIError(400, str(exc), param=exc.param))

    @app.exception_handler(RequestRejected)
    async def _rejected(_, exc: RequestRejected):
        return error_response(APIError(400, str(exc), param=exc.param))

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        logger.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    chat_page = (resources.files("dsaserve.server") / "static" / "chat.html").read_text(encoding="utf-8")

    @app.get("/", include_in_schema=False)
    async def page():
        """A chat page for a person trying the server (no key needed to load it; it asks for one)."""
        return HTMLResponse(chat_page)

    @app.get("/health")
    async def health():
        alive = state.engine.is_running
        if alive and state.draining:  # in-flight requests finishing, new ones refused: take this one out of rotation
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": RETRY_AFTER})
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.config.model_name, "object": "model", "created": now(), "owned_by": "dsaserve",
            "root": state.engine.model_dir, "max_model_len": state.max_model_len,
        }]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        request_id = new_id("chatcmpl")
        # Rendering and tokenizing are CPU work: off the event loop, so other streams keep flowing.
        prepared = await asyncio.to_thread(prepare_chat, state, body)
        # compiles a grammar; 400s first
        admitted = await asyncio.to_thread(admit_chat, state, body, prepared, request_id)
        return await respond(request, body.stream, chat_stream, chat_full,
                             (state, body, request_id, prepared, admitted))

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        check_encodable(body)
        if body.stream:
            return StreamingResponse(await respond_to_responses(state, body, response_store, stream=True),
                                     media_type="text/event-stream")
        return JSONResponse(await until_disconnect(request, respond_to_responses(state, body, response_store, False)))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        request_id = new_id("cmpl")
        prompts = await asyncio.to_thread(prepare_prompts, state, body)
        admitted = await asyncio.to_thread(admit_prompts, state, body, prompts, request_id)  # 400s before a stream
        return await respond(request, body.stream, completion_stream, completion_full,
                             (state, body, request_id, prompts, admitted))

    return app

