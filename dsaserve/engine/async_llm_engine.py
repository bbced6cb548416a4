"""AsyncLLMEngine: the engine stepping in a background thread, streaming to asyncio consumers.

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=path, ...))
    async for out in engine.generate(prompt, params, request_id):
        ...  # out carries what is new since the previous output

A server calls `make_request` first (the engine's one admission check, so bad input fails before a
response starts), then `stream(request)`; `generate` does both. Requests reach the stepping thread
through a queue; only that thread touches the engine's state. By default a background thread steps
the engine. A server should instead call `run()` on the main thread and put its event loop on another
thread: torch's OpenMP parallel regions cost more when started from a non-main thread, enough to slow
whole decode steps (docs/architecture.md#measurements has the numbers). Cancelling or closing the consumer aborts
the request and frees its blocks. A request whose logits go non-finite ends with finish_reason
"error"; an exception inside a step fails every running request (the step does not say which one
broke it) and the loop carries on with the waiting ones and new arrivals. A failed rank of a
distributed executor is different: no step can run any more, so the loop stops, every request fails
with the rank's error and `fatal_error` says why (the server then exits non-zero). The stepping thread
shuts the executor's workers down when the loop ends.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from dsaserve.config import ModelConfig
from dsaserve.engine.admission import EngineRequest
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.stats import EngineStats
from dsaserve.engine.workers.executor import ExecutorFailure
from dsaserve.engine_args import EngineArgs
from dsaserve.outputs import RequestOutput
from dsaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """The engine failed while running this request; other requests continue."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is already closed
            pass


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, start_thread: bool = True):
        self.engine = engine
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._stopped = threading.Event()
        self._running = False
        self.fatal_error: str | None = None  # why the engine cannot run any more (a failed rank)
        self._ended = False  # the stepping loop has returned: nothing runs new requests any more
        self.last_activity = time.monotonic()
        self._thread = None
        engine.executor.add_failure_listener(self._on_executor_failure)
        if start_thread:
            self._thread = threading.Thread(target=self.run, name="dsaserve-engine", daemon=True)
            self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, start_thread: bool = True) -> "AsyncLLMEngine":
        return cls(LLMEngine(args), start_thread=start_thread)

    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.scheduler.config.max_num_seqs

    @property
    def model_dir(self) -> str:
        return self.engine.model_dir

    @property
    def num_unfinished(self) -> int:
        """Requests with a consumer, queued or running."""
        return len(self._streams)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> EngineRequest:
        """The engine's admission check (raises RequestRejected); safe on any thread."""
        return self.engine.make_request(request_id, prompt, params)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        async for out in self.stream(self.make_request(request_id, prompt, params)):
            yield out

    async def stream(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Run an admitted request; yields its outputs until it finishes."""
        self._raise_if_stopped()
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        if self._ended:  # the loop ended after the check above, maybe before it failed this stream
            self._streams.pop(request_id, None)
            self._raise_if_stopped()
        self._submit(("add", request))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(("abort", request_id))

    def _raise_if_stopped(self) -> None:
        if self._stopped.is_set() or self._ended:
            raise EngineStepError(f"the engine has stopped: {self.fatal_error}" if self.fatal_error
                                  else "the engine has stopped")

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def end_all(self, error: Exception) -> None:
        """Abort every request and end each stream with `error` (a server's shutdown deadline)."""
        self._submit(("end all", error))

    def _on_executor_failure(self, cause: str) -> None:
        self.fatal_error = self.fatal_error or cause
        self._wakeup.set()

    def _submit(self, op) -> None:
        self.last_activity = time.monotonic()
        self._ops.put(op)
        self._wakeup.set()

    # ---- the stepping loop ------------------------------------------------------------------------

    def run(self, should_stop=None) -> None:
        """Step the engine until shutdown() (or should_stop() is true); aborts what is left at the end."""
        self._running = True
        try:
            self._loop(should_stop or (lambda: False))
        finally:
            self._running = False
            self._ended = True
            for request_id in self.engine.unfinished_request_ids():
                self.engine.abort_request(request_id)
            reason = f"the engine stopped: {self.fatal_error}" if self.fatal_error else "the engine stopped"
            for stream in list(self._streams.values()):
                stream.put(EngineStepError(reason))
            try:
                self.engine.shutdown()
            except Exception:
                logger.exception("shutting the executor down failed")

    def _loop(self, should_stop) -> None:
        while not self._stopped.is_set() and not should_stop() and not self.fatal_error:
            try:
                self._apply_ops()
            except Exception:  # never let one bad operation stop the loop
                logger.exception("applying a queued add/abort failed")
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except ExecutorFailure as e:  # a rank is gone: nothing can run any more
                self.fatal_error = self.fatal_error or str(e)
                logger.error("engine stopped: %s", self.fatal_error)
                return
            except Exception as e:  # a bug or a device error: fail what was running, keep serving
                logger.exception("engine step failed")
                try:
                    self._fail_running(e)
                except Exception:  # the loop must survive even a broken clean-up
                    logger.exception("failing the requests of a broken step failed")
                continue
            self.last_activity = time.monotonic()
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)

    def _apply_ops(self) -> None:
        while True:
            try:
                op = self._ops.get_nowait()
            except queue.Empty:
                return
            if op[0] == "add":
                request = op[1]
                if request.request_id not in self._streams:  # cancelled before it started
                    continue
                try:
                    self.engine.enqueue(request)
                except Exception as e:
                    stream = self._streams.get(request.request_id)
                    if stream is not None:
                        stream.put(e)
            elif op[0] == "end all":
                for request_id in self.engine.unfinished_request_ids():
                    self.engine.abort_request(request_id)
                for stream in list(self._streams.values()):
                    stream.put(op[1])
            else:
                self.engine.abort_request(op[1])

    def _fail_running(self, error: Exception) -> None:
        for request_id in self.engine.failed_step_request_ids():
            self.engine.abort_request(request_id)
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(EngineStepError(f"request {request_id} failed inside the engine: {error}"))
