"""Every refusal in OpenAI's error shape, with a message naming the problem and the fix.

``{"error": {"message", "type", "param", "code"}}`` with the status that OpenAI's client libraries
map to their exceptions (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError,
413, 429 RateLimitError, 503). Validation errors, unknown routes, oversized bodies and
unexpected failures all end here, so no response carries FastAPI's default shape or a traceback.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvopt.engine.requests import describe_validation_error
from kvopt.errors import KVOptError
from kvopt.serving.engine_client import EngineUnavailableError

ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}


class APIError(HTTPException):
    """A request the server refuses; ``message`` says what to change."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(status, message, headers)
        self.param, self.code = param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = "server_error" if status >= 500 else ERROR_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error.status_code, error.detail, error.param, error.code), error.status_code,
                        headers=error.headers)  # fmt: skip


def install_error_handlers(app: FastAPI, routes: str) -> None:
    """OpenAI-shaped responses for every error; ``routes`` lists the endpoints for 404s."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        if isinstance(error, APIError):
            return error_response(error)
        if error.status_code == 404:
            message = f"no endpoint {request.url.path}; this server has {routes}"
        elif error.status_code == 405:
            message = f"{request.url.path} does not take {request.method} requests; see /docs for each endpoint's method"
        else:
            message = str(error.detail)
        return error_response(APIError(error.status_code, message, headers=error.headers))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(error.errors())
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(KVOptError)
    async def refused(request: Request, error: KVOptError) -> JSONResponse:  # the engine refused the request as given
        return error_response(APIError(400, str(error), param=getattr(error, "param", None)))

    @app.exception_handler(EngineUnavailableError)
    async def unavailable(request: Request, error: EngineUnavailableError) -> JSONResponse:
        return error_response(APIError(503, str(error)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:  # Starlette logs the traceback
        return error_response(APIError(500, f"internal error ({type(error).__name__}); the server log has the details"))


class BodyLimitMiddleware:
    """413 for a body over ``limit`` bytes: at once from Content-Length, else while it streams in.

    A chunked body is cut off as soon as it passes the limit (the handler never sees it whole).
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.limit:
            response = error_response(self.too_large(int(declared)))
            return await response(scope, receive, send)
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise self.too_large(received)  # FastAPI passes HTTPExceptions raised while reading through
            return message

        await self.app(scope, limited, send)

    def too_large(self, size: int) -> APIError:
        return APIError(413, f"the request body has {size:,} bytes or more; this server accepts at most "
                             f"{self.limit:,} (--max-body-bytes); send a shorter prompt", code="body_too_large")  # fmt: skip
