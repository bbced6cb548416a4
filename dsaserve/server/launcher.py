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

from dsaserve.chat_template import ChatTemplate
from dsaserve.demo import demo_model_dir
from dsaserve.engine.async_llm_engine import AsyncLLMEngine
from dsaserve.engine_args import EngineArgs
from dsaserve.server.app import GuardMiddleware, build_app
from dsaserve.server.metrics import ServerMetrics
from dsaserve.server.state import ServerConfig, ServerState

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "dsaserve-demo"


def load_chat_template(engine: AsyncLLMEngine, override: str | None) -> ChatTemplate | None:
    tokenizer = engine.tokenizer
    source = tokenizer.chat_template
    if override:
        with open(override) as f:
            source = f.read()
    if source is None:
        logger.warning("no chat template: /v1/chat/completions will answer 400 (give --chat-template FILE)")
        return None
    return ChatTemplate(source, tokenizer.special_tokens)


async def watch_idle(state: ServerState, server: uvicorn.Server, idle: float) -> None:
    """Ask uvicorn to exit once nothing has run, waited or arrived for `idle` seconds."""
    while not server.should_exit:
        await asyncio.sleep(min(1.0, idle / 4))
        busy = state.in_flight > 0 or state.engine.num_unfinished > 0 or state.engine.has_unfinished_requests()
        quiet_since = max(state.last_activity, state.engine.last_activity)
        if not busy and time.monotonic() - quiet_since >= idle:
            logger.info("idle for %.0fs: shutting down", idle)
            server.should_exit = True


class Server(uvicorn.Server):
    """uvicorn on a side thread: the main thread steps the engine (see AsyncLLMEngine) and owns the
    signal handlers, which ask this server to stop gracefully: in-flight requests finish, new ones get 503."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    @contextlib.contextmanager
    def capture_signals(self):
        yield  # signals are handled on the main thread, in serve()

    def handle_signal(self, sig, _frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C stops waiting for in-flight requests
        self.state.draining = True
        self.should_exit = True


def serve(engine_args: EngineArgs, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          chat_template: str | None = None, graceful_timeout: float = 30.0) -> int:
    """config.model_name None: the model's path (or the demo's name); config.api_key None: DSASERVE_API_KEY."""
    if engine_args.model is None:
        engine_args = dataclasses.replace(engine_args, model=demo_model_dir())
        config = dataclasses.replace(config, model_name=config.model_name or DEMO_MODEL_NAME)
    config = dataclasses.replace(config, model_name=config.model_name or engine_args.model,
                                 api_key=config.api_key or os.environ.get("DSASERVE_API_KEY") or None)
    idle_shutdown = config.idle_shutdown
    engine = AsyncLLMEngine.from_engine_args(engine_args, start_thread=False)
    state = ServerState(engine, config, load_chat_template(engine, chat_template),
                        ServerMetrics(engine.stats, config.model_name))
    server: uvicorn.Server | None = None

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        watcher = asyncio.create_task(watch_idle(state, server, idle_shutdown)) if idle_shutdown else None
        logger.info("dsaserve serving %s on http://%s:%d", config.model_name, host, port)
        try:
            yield
        finally:
            if watcher:
                watcher.cancel()
            engine.shutdown()  # aborts whatever is still running

    app = build_app(state, lifespan=lifespan)
    # CORS outside the guard: a browser's preflight carries no key, and every answer (errors included)
    # needs the Access-Control-* headers.
    outer = CORSMiddleware(GuardMiddleware(app, state), allow_origins=config.allowed_origins,
                           allow_methods=config.allowed_methods, allow_headers=config.allowed_headers,
                           allow_credentials=config.allow_credentials)
    uv_config = uvicorn.Config(outer, host=host, port=port, log_level="info", lifespan="on",
                               timeout_graceful_shutdown=graceful_timeout, access_log=False)
    server = Server(uv_config, state)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_signal)
    http_thread = threading.Thread(target=server.run, name="dsaserve-http", daemon=True)
    http_thread.start()
    engine.run(should_stop=lambda: not http_thread.is_alive())  # returns once uvicorn has shut down
    if engine.fatal_error:  # a rank failed: the requests have their errors; stop serving, exit non-zero
        logger.error("shutting down: %s", engine.fatal_error)
        server.should_exit = True
        http_thread.join(graceful_timeout + 5)
        return 1
    http_thread.join()
    return 0 if server.started else 1
