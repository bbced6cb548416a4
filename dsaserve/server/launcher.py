"""`dsaserve serve`: build the engine and app, run uvicorn, stop on SIGTERM or after an idle window."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time

import uvicorn
from starlette.middleware.cors import CORSMiddleware

from dsaserve.chat_format import ChatFormat, chat_format
from dsaserve.demo import demo_model_dir
from dsaserve.engine.async_llm_engine import AsyncLLMEngine
from dsaserve.engine_args import EngineArgs
from dsaserve.model_family import ModelFamily
from dsaserve.server.app import GuardMiddleware, build_app
from dsaserve.server.connection_limits import limited_protocol
from dsaserve.server.metrics import ServerMetrics
from dsaserve.server.state import ServerConfig, ServerState

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "dsaserve-demo"


def load_chat_template(engine: AsyncLLMEngine, override: str | None, mode: str = "auto") -> ChatFormat | None:
    source = None
    if override:
        with open(override) as f:
            source = f.read()
    found = chat_format(engine.tokenizer, engine.model_config.family, source, mode)
    if found is None:
        logger.warning("no chat template: /v1/chat/completions will answer 400 (give --chat-template FILE)")
    return found


def with_family_parsers(config: ServerConfig, family: ModelFamily) -> ServerConfig:
    """--reasoning-parser / --tool-call-parser "auto": the model family's own."""
    reasoning, tools = config.reasoning_parser, config.tool_call_parser
    config = dataclasses.replace(config, reasoning_parser=family.reasoning_parser if reasoning == "auto" else reasoning,
                                 tool_call_parser=family.tool_call_parser if tools == "auto" else tools)
    logger.info("output parsers: reasoning %s, tool calls %s", config.reasoning_parser or "off",
                config.tool_call_parser or "off")
    return config


async def watch_idle(state: ServerState, server: uvicorn.Server, idle: float) -> None:
    """Ask uvicorn to exit once nothing has run, waited or arrived for `idle` seconds."""
    while not server.should_exit:
        await asyncio.sleep(min(1.0, idle / 4))
        busy = state.in_flight > 0 or state.engine.num_unfinished > 0 or state.engine.has_unfinished_requests()
        quiet_since = max(state.last_activity, state.engine.last_activity)
        if not busy and time.monotonic() - quiet_since >= idle:
            logger.info("idle for %.0fs: shutting down", idle)
            server.should_exit = True


async def watch_draining(state: ServerState, server: uvicorn.Server) -> None:
    """Once draining (a first SIGTERM or SIGINT): ask uvicorn to exit when no request is being answered. Until then
    the listener stays open and new requests get 503. Past --shutdown-timeout, the requests still running end with
    an error (a stream: an error event, then [DONE]) and uvicorn exits, closing within CUT_GRACE whatever a client
    has not read."""
    while not server.should_exit:
        await asyncio.sleep(0.1)
        if not state.draining:
            continue
        if state.running == 0:
            server.should_exit = True
        elif time.monotonic() > state.cut_at:
            logger.warning("shutdown timeout (%g s) passed with %d requests running: ending them",
                           state.config.shutdown_timeout, state.running)
            state.cut_running()
            server.should_exit = True


class Server(uvicorn.Server):
    """uvicorn on a side thread: the main thread steps the engine (see AsyncLLMEngine) and owns the
    signal handlers. The first signal drains (watch_draining); a second one stops at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    @contextlib.contextmanager
    def capture_signals(self):
        yield  # signals are handled on the main thread, in serve()

    def handle_signal(self, sig, _frame) -> None:
        if self.state.draining:  # a second signal stops waiting for in-flight requests
            self.force_exit = self.should_exit = True
            return
        logger.info("draining: new requests get 503; exiting once the %d running finish (at most %g s)",
                    self.state.running, self.state.config.shutdown_timeout)
        self.state.start_draining()


LOOPBACK_HOSTS = ["localhost", "127.0.0.1", "::1"]
CUT_EXIT_CODE = 3  # stopped, but some requests were ended by --shutdown-timeout
CUT_GRACE = 5.0  # seconds uvicorn waits, once told to exit, for responses still being sent


def serve(engine_args: EngineArgs, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          chat_template: str | None = None, tokenizer_mode: str = "auto") -> int:
    """config.model_name None: the model's path (or the demo's name); config.api_key None: DSASERVE_API_KEY;
    config.allowed_hosts None: the loopback names when bound to loopback, any otherwise. Returns the exit code: 0,
    1 when the server did not start or a rank failed, CUT_EXIT_CODE when requests were cut at shutdown."""
    if engine_args.model is None:
        engine_args = dataclasses.replace(engine_args, model=demo_model_dir())
        config = dataclasses.replace(config, model_name=config.model_name or DEMO_MODEL_NAME)
    config = dataclasses.replace(config, model_name=config.model_name or engine_args.model,
                                 api_key=config.api_key or os.environ.get("DSASERVE_API_KEY") or None)
    if config.allowed_hosts is None and host in LOOPBACK_HOSTS:
        config = dataclasses.replace(config, allowed_hosts=LOOPBACK_HOSTS)
    idle_shutdown = config.idle_shutdown
    engine = AsyncLLMEngine.from_engine_args(engine_args, start_thread=False)
    config = with_family_parsers(config, engine.model_config.family)
    state = ServerState(engine, config, load_chat_template(engine, chat_template, tokenizer_mode),
                        ServerMetrics(engine.stats, config.model_name))
    server: uvicorn.Server | None = None

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        watchers = [asyncio.create_task(watch_draining(state, server))]
        if idle_shutdown:
            watchers.append(asyncio.create_task(watch_idle(state, server, idle_shutdown)))
        logger.info("dsaserve serving %s on http://%s:%d (hosts: %s; stored responses: at most %d bytes)",
                    config.model_name, host, port, ", ".join(config.allowed_hosts or ["any"]),
                    config.responses_store_max_bytes)
        try:
            yield
        finally:
            for watcher in watchers:
                watcher.cancel()
            engine.shutdown()  # aborts whatever is still running

    app = build_app(state, lifespan=lifespan)
    # CORS outside the guard: a browser's preflight carries no key, and every answer (errors included)
    # needs the Access-Control-* headers.
    outer = CORSMiddleware(GuardMiddleware(app, state), allow_origins=config.allowed_origins,
                           allow_methods=config.allowed_methods, allow_headers=config.allowed_headers,
                           allow_credentials=config.allow_credentials)
    # watch_draining tells uvicorn to exit only once nothing runs, or past --shutdown-timeout: its own wait is short.
    uv_config = uvicorn.Config(outer, host=host, port=port, log_level="info", lifespan="on",
                               timeout_graceful_shutdown=CUT_GRACE, access_log=False,
                               http=limited_protocol(config.header_timeout, config.max_connections))
    server = Server(uv_config, state)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_signal)
    http_thread = threading.Thread(target=server.run, name="dsaserve-http", daemon=True)
    http_thread.start()
    engine.run(should_stop=lambda: not http_thread.is_alive())  # returns once uvicorn has shut down
    if engine.fatal_error:  # a rank failed: the requests have their errors; stop serving, exit non-zero
        logger.error("shutting down: %s", engine.fatal_error)
        server.should_exit = True
        http_thread.join(CUT_GRACE + 5)
        return 1
    http_thread.join()
    return (CUT_EXIT_CODE if state.cut else 0) if server.started else 1
