"""The OpenAI-compatible HTTP API on the engine: completions, chat, models, tokenize, health, metrics.

A request's life: FastAPI validates the body (:mod:`protocol`); the prompt is tokenized on the
tokenizer thread; limits are checked (prompt and output tokens, the waiting queue); the request
goes to the engine thread (:mod:`engine_client`) and its outputs come back one per engine step.
A non-streamed request waits for the last one; a streamed request waits for the first (so a
request the engine refuses still gets a 400, not a broken stream), then sends a server-sent event
per step. A client that disconnects, or a request past ``request_timeout``, is aborted in the
engine and its KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kvopt.engine import RequestOutput, SamplingParams
from kvopt.engine.conversations import SessionPrompt
from kvopt.engine.llm_engine import ChunkedPrompt
from kvopt.engine.requests import RequestSchemaError, max_tokens_within, unserved_model
from kvopt.serving.engine_client import EngineClient, EngineUnavailableError, RequestStream
from kvopt.serving.errors import APIError, BodyLimitMiddleware, error_body, install_error_handlers
from kvopt.serving.metrics import ServerMetrics
from kvopt.serving.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest, GenerateRequest
from kvopt.serving.responses import DeltaTracker, Formatter, sse, whole
from kvopt.serving.tokenizer import AsyncTokenizer

ROUTES = "/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /health, /metrics (and /docs)"
#: Seconds a client is asked to wait after a 429 (queue full) or a 503 while the model loads.
RETRY_AFTER_FULL_S = 1
RETRY_AFTER_LOADING_S = 5
#: OpenAI's default ``max_tokens`` for completions (chat defaults to the room left in the context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass
class ServerSettings:
    #: The name clients pass as ``model`` (and ``/v1/models`` lists).
    model_name: str
    #: Required as ``Authorization: Bearer KEY`` on /v1/* and /tokenize when set.
    api_key: str | None = None
    #: Longest prompt accepted; None: the model's context minus one token.
    max_prompt_tokens: int | None = None
    #: Largest ``max_tokens`` accepted; None: the model's context minus one token.
    max_output_tokens: int | None = None
    #: Requests that may wait beyond the engine's ``max_num_seqs`` running ones before new ones get 429.
    max_waiting: int = 256
    max_body_bytes: int = 4 * 2**20
    #: Seconds a request may take from admission to its last token.
    request_timeout: float = 600.0
    #: Seconds open requests may take to finish after SIGTERM; those still open then end with a 503.
    shutdown_timeout: float = 30.0


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class OpenAIServer:
    """The handlers and their shared state; :func:`build_app` mounts them on a FastAPI app."""

    def __init__(self, client: EngineClient, settings: ServerSettings) -> None:
        self.client, self.settings = client, settings
        self.metrics = ServerMetrics(settings.model_name)
        self.created = int(time.time())
        #: Set on SIGTERM: requests still arriving on open connections get 503 while open ones finish.
        self.draining = False
        self._tokenizer: AsyncTokenizer | None = None

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        self.client.start(asyncio.get_running_loop())  # loads the model on the engine thread
        yield
        await asyncio.to_thread(self.client.stop)
        if self._tokenizer is not None:
            self._tokenizer.close()

    def drain(self) -> None:
        """A shutdown signal arrived (called in the signal handler): refuse new requests at once, and end those still
        open after ``shutdown_timeout`` with a 503 (a stream: an ``error`` event, then ``[DONE]``) so none is left for
        uvicorn to cancel (a text/plain 500 or a cut stream, and a ``CancelledError`` traceback, each)."""
        if self.draining:
            return
        self.draining = True
        loop, timeout = self.client.loop, self.settings.shutdown_timeout
        reason = (f"the server shut down before this request finished (it waited --shutdown-timeout {timeout:g} s); "
                  "retry on another instance")  # fmt: skip
        if loop is not None:
            loop.call_soon_threadsafe(loop.call_later, timeout, self.client.end_requests, reason)

    @property
    def tokenizer(self) -> AsyncTokenizer:
        if self._tokenizer is None:
            self._tokenizer = AsyncTokenizer(self.client.tokenizer)
        return self._tokenizer

    # -- checks -------------------------------------------------------------------------------
    async def guard(self, request: Request) -> None:
        """Before any /v1 or /tokenize request: not shutting down, the API key, the model loaded."""
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another instance", headers={"Connection": "close"})
        key = self.settings.api_key
        if key is not None:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
                raise APIError(401, "missing or wrong API key; send the header 'Authorization: Bearer KEY' with the "
                                    "key the server was started with (--api-key)", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        if not self.client.ready:
            loading = self.client.state == "loading"
            raise APIError(503, self.client.describe_state(),
                           headers={"Retry-After": str(RETRY_AFTER_LOADING_S)} if loading else None)  # fmt: skip

    def _check_model(self, name: str | None) -> None:
        problem = unserved_model(name, self.settings.model_name)
        if problem:
            raise APIError(404, f"{problem} (GET /v1/models)", param="model", code="model_not_found")

    def _sampling_params(self, body: GenerateRequest, prompt_tokens: int, chat: bool) -> SamplingParams:
        """The request's engine settings, within the server's limits (400s name the limit and the way out)."""
        context = self.client.engine.max_model_len
        prompt_limit = min(self.settings.max_prompt_tokens or context - 1, context - 1)
        if prompt_tokens > prompt_limit:
            raise APIError(400, f"the prompt has {prompt_tokens} tokens; this server accepts at most {prompt_limit} "
                                f"(--max-prompt-tokens; the model's context is {context}); shorten the prompt",
                           param="messages" if chat else "prompt", code="context_length_exceeded")  # fmt: skip
        default = context if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        try:
            max_tokens = max_tokens_within(body.requested_max_tokens, prompt_tokens, context, default,
                                           body.max_tokens_field, self.settings.max_output_tokens,
                                           " (--max-output-tokens)")  # fmt: skip
            return body.sampling_params(max_tokens)
        except RequestSchemaError as error:
            code = "context_length_exceeded" if "context" in str(error) else None
            raise APIError(400, str(error).removeprefix("SamplingParams."), param=error.param, code=code) from None

    def _check_capacity(self) -> None:
        running = self.client.engine.config.max_num_seqs
        in_flight = self.client.num_requests
        if in_flight >= running + self.settings.max_waiting:
            raise APIError(429, f"the server is full: {in_flight} requests in flight ({running} run at once, "
                                f"{self.settings.max_waiting} may wait: --max-num-seqs, --max-waiting); "
                                f"retry in {RETRY_AFTER_FULL_S} s", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_FULL_S)})  # fmt: skip

    # -- endpoints ----------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        self._check_stream_options(body)
        prompt = body.prompt if isinstance(body.prompt, list) else await self.tokenizer.encode(body.prompt)
        return await self._generate(request, body, prompt, chat=False)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        self._check_stream_options(body)
        messages = [message.as_template_input() for message in body.messages]
        if body.documents:  # kvopt's extension: documents reused by content (engine/requests.py)
            prompt, length = await self.tokenizer.encode_chat_documents(messages, body.documents)
            return await self._generate(request, body, prompt, chat=True, prompt_tokens=length)
        prompt = await self.tokenizer.encode_chat(messages)
        return await self._generate(request, body, prompt, chat=True)

    async def models(self) -> dict:
        engine = self.client.engine
        card = {"id": self.settings.model_name, "object": "model", "created": self.created, "owned_by": "kvopt",
                "max_model_len": engine.max_model_len, "kv_method": engine.config.kv_method}  # fmt: skip
        return {"object": "list", "data": [card]}

    async def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's ``/tokenize``: the token ids of a prompt, or of messages in the chat template."""
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of \"prompt\" (text) or \"messages\" (a chat)", param="prompt")
        if body.prompt is not None:
            tokens = await self.tokenizer.encode(body.prompt, body.add_special_tokens)
        else:
            tokens = await self.tokenizer.encode_chat([message.as_template_input() for message in body.messages])
        return {"count": len(tokens), "max_model_len": self.client.engine.max_model_len, "tokens": tokens}

    async def health(self) -> JSONResponse:
        """200 once the model is loaded and the engine runs; 503 while loading, after a failure, or shutting down."""
        if self.client.ready and not self.draining:
            return JSONResponse({"status": "ok"})
        state, message = ("shutting down", "the server is shutting down") if self.draining else (
            self.client.state, self.client.describe_state())  # fmt: skip
        return JSONResponse(error_body(503, message) | {"status": state}, 503)

    async def prometheus(self) -> Response:
        snapshot = await self.client.call(lambda engine: engine.metrics()) if self.client.ready else None
        return Response(self.metrics.render(snapshot), media_type=CONTENT_TYPE_LATEST)

    # -- generation ---------------------------------------------------------------------------
    def _check_stream_options(self, body: GenerateRequest) -> None:
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with \"stream\": true", param="stream_options")

    async def _generate(self, request: Request, body: GenerateRequest, prompt: list[int] | ChunkedPrompt, chat: bool,
                        prompt_tokens: int | None = None) -> Response:  # fmt: skip
        params = self._sampling_params(body, len(prompt) if prompt_tokens is None else prompt_tokens, chat)
        if body.session:  # kvopt's extension: a turn of a long conversation (engine/conversations.py)
            prompt = SessionPrompt(body.session, prompt)
        self._check_capacity()
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        form = Formatter(request_id, int(time.time()), self.settings.model_name, chat, params.logprobs)
        stream = self.client.add(request_id, prompt, params)
        deadline = asyncio.get_running_loop().time() + self.settings.request_timeout
        streaming = False
        try:
            first = await self._until(deadline, request, anext(stream))
            _raise_for(first, stream)
            if body.stream:
                streaming = True  # the event generator owns the stream from here
                events = self._events(stream, first, form, body, deadline)
                return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            final = first if first.finished else await self._until(deadline, request, _last(stream))
            _raise_for(final, stream)
            self.metrics.observe(stream)
            deltas = [whole(choice) for choice in final.outputs]
            return JSONResponse(form.body(final, await self._token_strings(form, deltas)))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the request was aborted
        except TimeoutError:
            raise APIError(408, self._timeout_message(), code="request_timeout") from None
        finally:
            if not streaming:
                stream.close()

    async def _events(
        self, stream: RequestStream, first: RequestOutput, form: Formatter, body: GenerateRequest, deadline: float
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per engine step that produced text, then usage and ``[DONE]``.

        A disconnect cancels this generator (Starlette watches the connection), and closing the
        stream aborts the request in the engine.
        """
        usage = body.include_usage
        tracker = DeltaTracker(body.n, body.stop)
        try:
            if form.chat:
                yield sse(form.role_chunk(body.n, usage))
            output = first
            while output.error is None:
                deltas = tracker.advance(output)
                if deltas:
                    yield sse(form.chunk(deltas, await self._token_strings(form, deltas), usage))
                if output.finished:
                    break
                async with asyncio.timeout_at(deadline):
                    output = await anext(stream)
            if output.error is not None:
                failure = _failure(output, stream)
                yield sse(error_body(failure.status_code, failure.detail))
            else:
                self.metrics.observe(stream)
                if usage:
                    yield sse(form.usage_chunk(output))
        except TimeoutError:
            yield sse(error_body(408, self._timeout_message(), code="request_timeout"))
        except EngineUnavailableError as error:
            yield sse(error_body(503, str(error)))
        finally:
            stream.close()
        yield sse("[DONE]")

    async def _token_strings(self, form: Formatter, deltas) -> dict[int, str]:
        needed = form.needed_strings(deltas)
        return await self.tokenizer.token_strings(needed) if needed else {}

    async def _until(self, deadline: float, request: Request, work: Awaitable):
        """``work``'s result; TimeoutError past ``deadline``, ClientGone if the client disconnects first."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            async with asyncio.timeout_at(deadline):
                done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            task.cancel()  # a no-op once done; otherwise (timeout, disconnect) the stream's close aborts the request
        if task not in done:
            raise ClientGone
        return task.result()

    def _timeout_message(self) -> str:
        return (f"the request did not finish within the server's request timeout of {self.settings.request_timeout:g} s "
                "(--request-timeout); ask for fewer tokens or retry later")  # fmt: skip


def _raise_for(output: RequestOutput, stream: RequestStream) -> None:
    if output.error is not None:
        raise _failure(output, stream)


def _failure(output: RequestOutput, stream: RequestStream) -> APIError:
    """A request with an error: one the engine refused as given (a 400), or one it failed on once queued (a 500, in
    the engine's failure isolation: the other requests went on)."""
    return APIError(500 if stream.admitted else 400, output.error)


async def _last(stream: RequestStream) -> RequestOutput:
    async for output in stream:
        last = output
    return last


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is already read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(client: EngineClient, settings: ServerSettings, server_type: type[OpenAIServer] = OpenAIServer) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine thread (which loads the model) and stops it. ``server_type``:
    the handlers' class (:mod:`kvopt.cluster` passes one whose client reaches engine replicas over Ray Serve)."""
    from kvopt._version import __version__

    server = server_type(client, settings)
    app = FastAPI(title="kvopt", version=__version__, lifespan=server.lifespan,
                  description="OpenAI-compatible API on kvopt's engine (paged, prefix-cached KV blocks).")  # fmt: skip
    app.state.server = server
    guarded = [Depends(server.guard)]
    app.post("/v1/completions", dependencies=guarded)(server.completions)
    app.post("/v1/chat/completions", dependencies=guarded)(server.chat_completions)
    app.get("/v1/models", dependencies=guarded)(server.models)
    app.post("/tokenize", dependencies=guarded)(server.tokenize)
    app.get("/health")(server.health)
    app.get("/metrics")(server.prometheus)
    install_error_handlers(app, ROUTES)
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    return app
