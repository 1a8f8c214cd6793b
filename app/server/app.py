"""`colibri serve`: an HTTP server on FastAPI speaking the APIs local clients speak: OpenAI's, Anthropic's
Messages API and Ollama's.

`create_app` builds the application: the OpenAI routes (app.server.openai: /v1/models, /v1/chat/completions,
/v1/completions), the Anthropic routes (app.server.anthropic: /v1/messages, /v1/messages/count_tokens), the
Ollama routes (app.server.ollama: /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version), the
routes that watch the engine (app.server.telemetry: /health, /metrics, /v1/atlas, /v1/telemetry), and around
them the API key check, CORS, the body size limit and the error handlers that answer every mistake in the error
shape of the API its path belongs to (app.server.errors): malformed JSON, a body over the size limit, a missing
or wrong API key, never a bare 500 page (a 500 counts in `colibri_request_errors_total`).
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.server.anthropic import add_anthropic_routes
from app.server.engine import Served
from app.server.errors import ApiError, BodyLimit, error, validation_message
from app.server.ollama import add_ollama_routes
from app.server.openai import add_openai_routes
from app.server.telemetry import add_telemetry_routes
from app.service.local import EngineService

MAX_BODY = 4 << 20          # bytes of a request body (4 MiB)


def create_app(service: EngineService, *, api_key: str | None = None, cors_origins: tuple[str, ...] = (),
               max_body: int = MAX_BODY) -> FastAPI:
    """The FastAPI application serving the model loaded in `service` (the engine service the desktop app
    also drives; it batches the requests)."""
    app = FastAPI(title="Colibri", version="1", docs_url=None, redoc_url=None)
    engine = Served(service)
    app.state.served = engine

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error(400, message, param=param, path=request.url.path)

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return error(exc.status, exc.message, exc.kind, exc.param, exc.code, exc.headers, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error",
                     path=request.url.path)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):    # never a bare 500 page; the server stays up
        engine.counters.errors += 1                         # a fault of ours, counted like an engine error
        return error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", path=request.url.path)

    app.add_middleware(ApiKeyCheck, key=api_key)
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "x-api-key", "anthropic-version", "content-type"])
    app.add_middleware(BodyLimit, limit=max_body)

    add_telemetry_routes(app, engine)
    add_openai_routes(app, engine)
    add_anthropic_routes(app, engine)
    add_ollama_routes(app, engine)
    return app


class ApiKeyCheck:
    """ASGI middleware: with a key set, every request but `/health` and CORS preflights (OPTIONS) must carry
    `Authorization: Bearer KEY` or (as Anthropic's clients send it) `x-api-key: KEY`, or gets 401. Pure ASGI, not
    `@app.middleware("http")`: Starlette's BaseHTTPMiddleware hides a client's `http.disconnect` from the routes,
    which cancel a request whose client left (app.server.generation)."""

    def __init__(self, app: ASGIApp, key: str | None):
        self.app, self.key = app, key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.key is not None and scope["path"] != "/health" and scope["method"] != "OPTIONS":
            headers = Headers(scope=scope)
            given = headers.get("authorization", "")
            tokens = [given[7:] if given[:7].lower() == "bearer " else "", headers.get("x-api-key", "")]
            # both compared, whatever the first gives: the time taken says nothing of which header was right
            right = [hmac.compare_digest(t.encode(), self.key.encode()) for t in tokens]
            if not any(right):
                answer = error(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY' "
                                    "or 'x-api-key: KEY'", "authentication_error", code="invalid_api_key",
                               path=scope["path"])
                return await answer(scope, receive, send)
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except ApiError as exc:             # raised while reading the body (size limit)
            if started:
                raise
            await error(exc.status, exc.message, exc.kind, exc.param, exc.code, exc.headers,
                        path=scope["path"])(scope, receive, send)
