"""The server's answers to mistakes, in OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`,
and the request body limit (app/server/app.py installs both)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict | None = None) -> JSONResponse:
    """An answer in OpenAI's error shape."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class ApiError(Exception):
    """A 4xx answer decided inside a route."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind, self.headers = status, message, param, code, kind, headers


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of the first problem FastAPI found in a request."""
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
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
                        code="request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await too_big(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise ApiError(413, f"the request body is over {self.limit} bytes; send a shorter prompt",
                                   code="request_too_large")
            return message

        return await self.app(scope, limited, send)


def sse(payload: Any) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
