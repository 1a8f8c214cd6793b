"""The server's answers to mistakes and the request body limit (app/server/app.py installs both).

Each API answers in its own error shape, chosen by the request's path (`shape_of`): OpenAI's
`{"error": {"message", "type", "param", "code"}}` by default, Anthropic's `{"type": "error", "error": {"type",
"message"}}` under /v1/messages, Ollama's `{"error": "message"}` under /api/. `ErrorBody`, `AnthropicErrorBody`
and `OllamaErrorBody` document them in the OpenAPI schema (`responses` on each route).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    """What went wrong: OpenAI's error object."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every 4xx and 5xx answer of the server."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    """What went wrong: Anthropic's error object."""

    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """Every 4xx and 5xx answer under /v1/messages."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class OllamaErrorBody(BaseModel):
    """Every 4xx and 5xx answer under /api/."""

    error: str


Shape = Literal["openai", "anthropic", "ollama"]
_BODIES: dict[str, type[BaseModel]] = {"openai": ErrorBody, "anthropic": AnthropicErrorBody, "ollama": OllamaErrorBody}

# Anthropic names its error types by status (its API reference, "Errors"); 408 and 431 have no name there
_ANTHROPIC_KIND = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                   413: "request_too_large", 429: "rate_limit_error", 431: "request_too_large",
                   500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def shape_of(path: str) -> Shape:
    """Which API's error shape answers a request for `path`."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    return "openai"


def error_payload(shape: Shape, status: int, message: str, kind: str = "invalid_request_error",
                  param: str | None = None, code: str | None = None) -> dict:
    """The JSON body of an error answer in `shape` (OpenAI's `kind`, `param` and `code` fit it to the others)."""
    if shape == "anthropic":
        return {"type": "error", "error": {"type": _ANTHROPIC_KIND.get(status, "api_error" if status >= 500
                                                                       else "invalid_request_error"),
                                           "message": message}}
    if shape == "ollama":
        return {"error": message}
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


_WHY = {400: "The request is malformed or a value is out of range (the message names it).",
        401: "The API key is missing or wrong (when the server has one).",
        404: "The model or resource is not served here.",
        408: "The request head or body did not arrive in time.",
        413: "The request body is over the server's limit.",
        429: "The queue is full: retry after the seconds in Retry-After.",
        431: "The request head is over 16 KiB.",
        503: "The server is busy or its model is not ready: retry shortly."}


# One server-sent event as OpenAPI 3.0/3.1 describe a `text/event-stream` item: the parsed fields of the event
# (what schemathesis checks each event of a stream against), its `data` a JSON chunk or `[DONE]`.
SSE_EVENT: dict[str, Any] = {"type": "object", "required": ["data"],
                             "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                            "id": {"type": "string"}, "retry": {"type": "integer"}}}


def responses(*statuses: int, stream: bool = False, text: bool = False, api: Shape = "openai",
              ndjson: bool = False) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route: its error answers in the shape of its `api`, any other error status too
    ("default"), and, for a route that streams, server-sent events (or, with `ndjson`, newline-delimited JSON)
    as the other form of its 200. A route answering plain `text` names the errors' JSON itself (FastAPI would
    give them the route's media type)."""
    body = _BODIES[api]
    shape: dict[str, Any] = ({"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}}
                             if text else {"model": body})
    out: dict[int | str, dict[str, Any]] = {s: {**shape, "description": _WHY[s]} for s in statuses}
    out["default"] = {**shape, "description": "Any other error, in the same shape."}
    if ndjson:
        out[200] = {"description": "The answer: JSON, or streamed as newline-delimited JSON objects, the last "
                                   "with `\"done\": true`.",
                    "content": {"application/json": {}, "application/x-ndjson": {}}}
    elif stream:
        out[200] = {"description": "The answer: JSON, or with `\"stream\": true` server-sent events "
                                   "(`data: {chunk}` lines; OpenAI's routes end with `data: [DONE]`).",
                    "content": {"application/json": {}, "text/event-stream": {"schema": SSE_EVENT}}}
    return out


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict | None = None, path: str = "") -> JSONResponse:
    """An error answer in the shape of the API that `path` belongs to (OpenAI's without a path)."""
    return JSONResponse(error_payload(shape_of(path), status, message, kind, param, code),
                        status_code=status, headers=headers)


class ApiError(Exception):
    """A 4xx answer decided inside a route."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind, self.headers = status, message, param, code, kind, headers


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of the problem FastAPI found in a request that says the most of what to fix."""
    errors = list(exc.errors())
    # a value refused by name says the most; else the deepest problem (of a union's branches, the one that got
    # furthest: a list of blocks with one bad block, rather than "should be a valid string")
    first = (next((e for e in errors if e.get("type") == "unsupported"), None)
             or max(errors, key=lambda e: len(e.get("loc", ())), default={}))
    # a union's branch names (`list[tagged-union[...]]`, `str`) are pydantic's, not the request's
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and "[" not in str(p)]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})", None
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if param is None and first.get("type") == "missing":
        return "the request body is missing: send a JSON object", None
    return (f"{param}: {msg}" if param else msg), param


class BodyLimit:
    """ASGI middleware refusing request bodies over `limit` bytes (declared or streamed) with 413."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        too_big = error(413, f"the request body is over {self.limit} bytes; send a shorter prompt",
                        code="request_too_large", path=scope.get("path", ""))
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await too_big(scope, receive, send)
        seen, answered = 0, False

        # An undeclared length is counted as it arrives. Past the limit the 413 is sent from here: an error raised
        # inside the app's body parsing would become FastAPI's 400. The app then reads a disconnect, and whatever
        # it answers to that is dropped.
        async def limited():
            nonlocal seen, answered
            message = await receive()
            if message["type"] == "http.request" and not answered:
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    answered = True
                    await too_big(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message):
            if not answered:
                await send(message)

        return await self.app(scope, limited, guarded)


def sse(payload: Any) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
