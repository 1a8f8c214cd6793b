"""`colibri serve`: an OpenAI-compatible HTTP server on FastAPI (the convention of local inference servers).

`create_app` builds the application: the OpenAI routes (app.server.openai: /v1/models, /v1/chat/completions,
/v1/completions), the routes that watch the engine (app.server.telemetry: /health, /metrics, /v1/atlas,
/v1/telemetry), and around them the API key check, CORS, the body size limit and the error handlers that
answer every mistake in OpenAI's error shape (app.server.errors): malformed JSON, a body over the size limit,
a missing or wrong API key, never a bare 500 page.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.server.engine import Served
from app.server.errors import ApiError, BodyLimit, error, validation_message
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
        return error(400, message, param=param)

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return error(exc.status, exc.message, exc.kind, exc.param, exc.code, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):    # never a bare 500 page; the server stays up
        return error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path != "/health" and request.method != "OPTIONS":
            given = request.headers.get("authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), api_key.encode()):
                return error(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'",
                             "authentication_error", code="invalid_api_key")
        try:
            return await call_next(request)
        except ApiError as exc:             # raised while reading the body (size limit)
            return error(exc.status, exc.message, exc.kind, exc.param, exc.code, exc.headers)

    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.add_middleware(BodyLimit, limit=max_body)

    add_telemetry_routes(app, engine)
    add_openai_routes(app, engine)
    return app
