"""The bridge between the asyncio server and the single-threaded engine.

The engine (:class:`~kvopt.engine.LLMEngine`) is not thread-safe and one ``step`` is a CPU-bound
forward pass, so it lives on one dedicated thread: that thread loads the model, then runs
commands (add, abort, a metrics snapshot) between steps and steps while requests are unfinished.
Each step's outputs go back to the event loop in one ``call_soon_threadsafe``, where they are
put on per-request queues; handlers read them through :class:`RequestStream`. The event loop
never calls the engine, so it stays responsive while a forward pass runs.

A request whose ``kv_method`` needs a one-time preparation first (a calibration: minutes on a CPU,
:meth:`~kvopt.engine.LLMEngine.preparation`) waits for it alone: it runs on a second thread, one
spec at a time and each once however many requests ask for it, while the engine thread steps the
other requests; then the request is added. The engine's own ``kv_method`` was prepared while it loaded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import queue
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from kvopt.engine.requests import RequestSchemaError
from kvopt.errors import KVOptError

if TYPE_CHECKING:
    from kvopt.engine import LLMEngine, RequestOutput, SamplingParams
    from kvopt.engine.conversations import SessionPrompt
    from kvopt.engine.llm_engine import ChunkedPrompt

logger = logging.getLogger("kvopt.serving")

#: What the engine thread runs between steps: a function of the engine, and where its result goes (or None).
Command = tuple[Callable[["LLMEngine"], Any], "concurrent.futures.Future | None"]
#: What the preparation thread runs (:meth:`~kvopt.engine.LLMEngine.preparation`'s work), and where its result goes.
Preparation = tuple[Callable[[], list], concurrent.futures.Future]


class EngineUnavailableError(RuntimeError):
    """The engine is still loading, failed to load, failed while running, or has stopped."""


class RequestStream:
    """One request's outputs (cumulative, one per engine step that advanced it), in order.

    ``close()`` must be called when the handler is done (a ``finally``): it unregisters the
    request and, if it has not finished, aborts it so its blocks return to the pool.
    """

    def __init__(self, client: EngineClient, request_id: str) -> None:
        self.client, self.request_id = client, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.closed = False
        #: Set on the engine thread once the engine queued the request: an error output before that is a refusal
        #: (too long, ids outside the vocabulary: a 400), after it the engine's own failure on this request (a 500).
        self.admitted = False
        self.arrival = time.perf_counter()
        #: When each output reached the event loop (the server's view of TTFT and inter-token latency).
        self.delivered: list[float] = []

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.client.streams.pop(self.request_id, None)
        if not self.finished:
            self.abort()

    def abort(self) -> None:
        """Stop the unfinished request in the engine (its blocks return to the pool)."""
        self.client.submit(lambda engine: engine.abort(self.request_id))


class EngineClient:
    """Owns the engine thread: ``start`` loads the model there, ``add`` / ``call`` talk to it.

    ``load`` builds the engine (it runs on the engine thread, so ``/health`` answers 503 while it
    does); ``on_failure`` is called (from the engine thread) if loading or a step fails, e.g. to
    stop the HTTP server.
    """

    def __init__(self, load: Callable[[], LLMEngine], on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.load, self.on_failure = load, on_failure
        self.engine: LLMEngine | None = None
        #: A copy of the engine's tokenizer for the server's tokenizer thread (the engine's own
        #: tokenizer is used by the engine thread while detokenizing).
        self.tokenizer = None
        self.failure: BaseException | None = None
        self.streams: dict[str, RequestStream] = {}
        #: Why requests are no longer accepted (:meth:`end_requests`); None while they are.
        self.ended: str | None = None
        self.commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        #: Preparations of requests' kv_methods by spec, until a request hands one to the engine (engine thread).
        self.preparations: dict[str, concurrent.futures.Future] = {}
        #: What the preparation thread (started when first needed) runs: ``(work, its future)``, None to stop.
        self.to_prepare: queue.SimpleQueue[Preparation | None] = queue.SimpleQueue()
        self.preparer: threading.Thread | None = None

    # -- state ------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.engine is not None and self.failure is None and self.thread is not None and self.thread.is_alive()

    @property
    def state(self) -> str:
        """``loading``, ``ready``, ``failed`` or ``stopped``."""
        if self.failure is not None:
            return "failed"
        if self.ready:
            return "ready"
        return "loading" if self.thread is not None and self.thread.is_alive() else "stopped"

    def check_ready(self) -> None:
        if not self.ready:
            raise EngineUnavailableError(self.describe_state())

    def describe_state(self) -> str:
        if self.failure is not None:
            return f"the engine failed: {self.failure}"
        if self.state == "loading":
            return "the model is still loading; retry in a few seconds"
        return "the engine is not running"

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread = threading.Thread(target=self._run, name="kvopt-engine", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Let the engine thread finish its current step and exit (requests still open are abandoned)."""
        if self.preparer is not None:
            self.to_prepare.put(None)  # a preparation under way is left to finish on its daemon thread
        if self.thread is not None and self.thread.is_alive():
            self.commands.put(None)
            self.thread.join(timeout)

    # -- requests (event-loop side) -----------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: list[int] | ChunkedPrompt | SessionPrompt,
            params: SamplingParams) -> RequestStream:
        """Queue a request on the engine; its outputs arrive on the returned stream."""
        self.check_ready()
        if self.ended is not None:
            raise EngineUnavailableError(self.ended)
        stream = RequestStream(self, request_id)
        self.streams[request_id] = stream

        def add(engine: LLMEngine, preparation: concurrent.futures.Future | None = None) -> None:
            if stream.closed:  # its client left while its kv_method was prepared
                return
            try:
                if params.kv_method is not None:
                    if preparation is None:
                        preparation = self._preparation(engine, params.kv_method)
                    if preparation is not None and not preparation.done():  # it waits alone; the others step on
                        preparation.add_done_callback(lambda done: self.submit(partial(add, preparation=done)))
                        return
                    self._check_method(engine, params.kv_method, preparation)
                engine.add_request(request_id, prompt_token_ids, params)
            except Exception as error:  # noqa: BLE001 - refused before queueing: the stream raises it
                self.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
            else:
                stream.admitted = request_id in engine.requests

        self.submit(add)
        return stream

    def _preparation(self, engine: LLMEngine, spec: str) -> concurrent.futures.Future | None:
        """The preparation of ``spec`` on the preparation thread, started by the first request that needs it (engine
        thread); None when the engine serves ``spec`` without one."""
        future = self.preparations.get(spec)
        if future is None:
            work = engine.preparation(spec)
            if work is None:
                return None
            future = self.preparations[spec] = concurrent.futures.Future()
            if self.preparer is None:
                self.preparer = threading.Thread(target=self._prepare, name="kvopt-prepare", daemon=True)
                self.preparer.start()
            self.to_prepare.put((work, future))
        return future

    def _prepare(self) -> None:
        """The preparation thread: one preparation at a time, while the engine thread steps."""
        while (job := self.to_prepare.get()) is not None:
            work, future = job
            try:
                future.set_result(work())
            except BaseException as error:  # noqa: BLE001 - the requests waiting for it are refused with it
                future.set_exception(error)

    def _check_method(self, engine: LLMEngine, spec: str, preparation: concurrent.futures.Future | None) -> None:
        """A request's own ``kv_method`` as the engine checks it on its model (``window:size`` beyond the context, a
        ``fastkv:tsp_layer`` past the last layer, a calibration that failed), refused as that field's error
        (``param: "kv_method"``); a finished ``preparation`` is handed to the engine first (engine thread)."""
        try:
            if preparation is not None:
                if self.preparations.get(spec) is preparation:
                    del self.preparations[spec]  # the engine keeps it once adopted; a failed one is tried anew
                engine.adopt_kv_method(spec, preparation.result())  # raises what the preparation raised
            engine.check_kv_method(spec)
        except KVOptError as error:
            raise RequestSchemaError(f"kv_method={spec!r} cannot run on this model: {error}", "kv_method") from None

    def submit(self, function: Callable[[LLMEngine], Any]) -> None:
        """Run ``function(engine)`` on the engine thread between steps; no result."""
        self.commands.put((function, None))

    async def call(self, function: Callable[[LLMEngine], Any]) -> Any:
        """Run ``function(engine)`` on the engine thread between steps and return its result."""
        self.check_ready()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.commands.put((function, future))
        return await asyncio.wrap_future(future)

    @property
    def num_requests(self) -> int:
        """Requests handed to the engine and not yet finished or aborted."""
        return len(self.streams)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for output in outputs:
            stream = self.streams.get(output.request_id)
            if stream is not None:
                stream.delivered.append(now)
                stream.queue.put_nowait(output)

    def end_requests(self, reason: str) -> None:
        """Fail every open request with ``reason`` (a 503), and refuse new ones so: the engine failed, or the server
        is shutting down and its open requests ran out of time (event-loop side)."""
        self.ended = reason
        for stream in list(self.streams.values()):
            stream.queue.put_nowait(EngineUnavailableError(reason))

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self.load()
            self.tokenizer = copy.deepcopy(engine.tokenizer)
        except BaseException as error:  # noqa: BLE001 - reported to the CLI, which names it
            self._failed(error, "loading the model failed")
            return
        self.engine = engine
        logger.info("engine ready: max_model_len=%d, %d KV blocks", engine.max_model_len, engine.block_manager.num_blocks)
        try:
            self._serve(engine)
        finally:
            self._refuse_pending()
            engine.close()  # blocks on their way to the KV tiers are written before the process exits

    def _serve(self, engine: LLMEngine) -> None:
        while self._run_commands(block=not engine.has_unfinished_requests()):
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as error:  # noqa: BLE001 - a bug or out of memory: every open request fails
                self._failed(error, "an engine step failed")
                self.loop.call_soon_threadsafe(self.end_requests, f"the engine failed: {error}")
                return
            if outputs:
                for output in outputs:  # later steps append to these; hand over this step's state
                    output.metrics = copy.copy(output.metrics)
                    for completion in output.outputs:
                        if completion.logprobs is not None:
                            completion.logprobs = list(completion.logprobs)
                self.loop.call_soon_threadsafe(self._deliver, outputs)

    def _refuse_pending(self) -> None:
        """Fail the results still awaited once the thread stops, so no handler waits forever."""
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            if command is not None and command[1] is not None:
                command[1].set_exception(EngineUnavailableError(self.describe_state()))

    def _run_commands(self, block: bool) -> bool:
        """Run the queued commands (waiting for one when ``block``); False once asked to stop."""
        while True:
            try:
                command = self.commands.get(block=block)
            except queue.Empty:
                return True
            if command is None:
                return False
            function, future = command
            try:
                result = function(self.engine)
            except Exception as error:  # noqa: BLE001 - goes back to the caller that awaits it
                if future is None:
                    logger.exception("engine command failed")
                else:
                    future.set_exception(error)
            else:
                if future is not None:
                    future.set_result(result)
            block = False

    def _failed(self, error: BaseException, what: str) -> None:
        self.failure = error
        logger.error("%s: %s", what, error, exc_info=not isinstance(error, KVOptError))
        if self.on_failure is not None:
            self.on_failure(error)

