"""`colibri serve`: an OpenAI-compatible HTTP server on FastAPI (the convention of local inference servers).

Routes: `GET /health`, `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`
(streamed as server-sent events ending with `data: [DONE]`, or whole), `GET /metrics` (Prometheus
text) and `GET /v1/telemetry` (server-sent events of the engine's telemetry snapshots, the ones
the desktop app draws).

Every client mistake gets a 4xx answer in OpenAI's error shape, `{"error": {"message", "type",
"param", "code"}}`: malformed JSON, a field of the wrong type, a value out of range, an unknown
model, a prompt longer than the context (with the numbers), a body over the size limit, a missing
or wrong API key. A full queue answers 429 with `Retry-After`. A client that disconnects cancels
its generation; its KV blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from typing import Any, Literal, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.server.engine import QueueFull, Served, Ticket
from app.service.local import EngineService
from engine.errors import ColibriError
from engine.events import DoneEvent, ErrorEvent, TokenEvent
from engine.generation.sampling import SamplingParams

MAX_BODY = 4 << 20          # bytes of a request body (4 MiB)
RETRY_AFTER = 2             # seconds a client is told to wait when the queue is full
DISCONNECT_POLL = 0.25      # seconds between checks that a non-streaming client is still there


# --------------------------------------------------------------------------- request bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")   # unknown fields (user, logprobs=false ...) are ignored

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)     # an extension (as in vLLM): the desktop app's
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: "StreamOptions | None" = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)


class CompletionBody(_Body):
    prompt: Union[str, list[int], list[str]]
    echo: bool = False


_Body.model_rebuild()
ChatBody.model_rebuild()
CompletionBody.model_rebuild()


# --------------------------------------------------------------------------- errors


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


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})", None
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if param is None and first.get("type") == "missing":
        return "the request body is missing: send a JSON object", None
    return (f"{param}: {msg}" if param else msg), param


# --------------------------------------------------------------------------- the app


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


def create_app(service: EngineService, *, api_key: str | None = None, cors_origins: tuple[str, ...] = (),
               max_body: int = MAX_BODY) -> FastAPI:
    """The FastAPI application serving the model loaded in `service` (the engine service the desktop app
    also drives; it batches the requests)."""
    app = FastAPI(title="Colibri", version="1", docs_url=None, redoc_url=None)
    engine = Served(service)
    app.state.served = engine
    tokenizer = service.tokenizer

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
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

    # --- routes ---

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.name, "running": service.batch, "queued": service.queue_depth}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": int(engine.started),
                                            "owned_by": "colibri", "colibri": model_description(engine.info)}]}

    @app.get("/v1/atlas")
    async def atlas():
        from app.service.model import read_atlas

        found = read_atlas(engine.info.path)
        if found is None:
            raise ApiError(404, f"{engine.name} has no atlas yet; compute it where the server runs: "
                                f"`colibri atlas {engine.info.path}`", code="not_found")
        return found

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        _check_model(body.model)
        if tokenizer is None or not tokenizer.has_chat_template:
            raise ApiError(400, f"{engine.name} has no chat template; use /v1/completions", "messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = tokenizer.encode_chat(messages, add_generation_prompt=True)
        except ColibriError as exc:
            raise ApiError(400, str(exc), "messages") from None
        return await _generate(body, prompt, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        _check_model(body.model)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(400, "only one prompt per request is supported (n=1)", "prompt")
            p = p[0]
        if isinstance(p, str):
            if tokenizer is None:
                raise ApiError(400, f"{engine.name} has no tokenizer: send the prompt as token ids", "prompt")
            prompt = tokenizer.encode(p)
        else:
            prompt = list(p)
            vocab = engine.info.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt")
        return await _generate(body, prompt, request, chat=False)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(engine), media_type="text/plain; version=0.0.4")

    @app.get("/v1/telemetry")
    async def telemetry(request: Request, interval: float = 0.5, recent: int = 32, tiers: bool = False):
        if service.snapshot() is None:
            raise ApiError(404, "no model is loaded, so there is no telemetry", code="not_found")
        interval = min(max(interval, 0.05), 10.0)
        recent = min(max(recent, 0), 512)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(maxsize=4)
        grid: list = [None]         # the latest expert tiers (they come with each snapshot, just before it)

        def push(snap) -> None:     # engine thread
            def put():
                if queue.full():
                    queue.get_nowait()
                queue.put_nowait(snap)
            try:
                loop.call_soon_threadsafe(put)
            except RuntimeError:     # the event loop is closed
                pass

        def payload(snap) -> dict:
            out = snap.to_dict(recent)
            if tiers:
                now = grid[0] if grid[0] is not None else service.tiers()
                out["tiers"] = now.tolist() if now is not None else None
            return out

        async def stream():
            subs = [service.subscribe_tiers(lambda g: grid.__setitem__(0, g), interval)] if tiers else []
            subs.append(service.subscribe(push, interval))
            try:
                first = service.snapshot()
                if first is not None:
                    yield _sse(payload(first))
                while not await request.is_disconnected():
                    try:
                        snap = await asyncio.wait_for(queue.get(), timeout=max(interval, 1.0))
                    except asyncio.TimeoutError:
                        yield ": keep-alive\n\n"
                        continue
                    yield _sse(payload(snap))
            finally:
                for sub in subs:
                    sub.close()

        return StreamingResponse(stream(), media_type="text/event-stream")

    # --- generation ---

    def _check_model(name: str) -> None:
        if name not in (engine.name, "colibri", "default"):
            raise ApiError(404, f"model {name!r} is not served here; GET /v1/models lists {engine.name!r}",
                           "model", "model_not_found")

    async def _generate(body: _Body, prompt: list[int], request: Request, chat: bool):
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        room = engine.ctx - len(prompt)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens but the context holds {engine.ctx}; "
                                "shorten it", "messages" if chat else "prompt", "context_length_exceeded")
        limit = body.max_completion_tokens or body.max_tokens
        if limit is not None and limit > room:
            raise ApiError(400, f"max_tokens {limit} does not fit: the prompt has {len(prompt)} tokens and the "
                                f"context holds {engine.ctx}, leaving {room}", "max_tokens", "context_length_exceeded")
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stops) > 4:
            raise ApiError(400, f"stop: at most 4 sequences, got {len(stops)}", "stop")
        sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                                  presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                  repetition_penalty=body.repetition_penalty)
        try:
            sampling.validate()
        except ColibriError as exc:
            raise ApiError(400, str(exc)) from None
        try:
            ticket = engine.submit(list(prompt), max_tokens=limit or room, sampling=sampling, stop=stops,
                                   loop=asyncio.get_running_loop())
        except QueueFull as exc:
            raise ApiError(429, str(exc), kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER)}) from None
        except ColibriError as exc:
            raise ApiError(503, str(exc), kind="server_error") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(ticket, rid, created, chat, include_usage, len(prompt)),
                                     media_type="text/event-stream")
        return await _whole(ticket, rid, created, chat, len(prompt), request)

    def _finish(event: DoneEvent) -> str:
        return "length" if event.finish_reason == "length" else "stop"

    def _usage(prompt_tokens: int, done: DoneEvent) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": len(done.tokens),
                "total_tokens": prompt_tokens + len(done.tokens)}

    async def _whole(ticket: Ticket, rid: str, created: int, chat: bool, n_prompt: int, request: Request):
        try:
            while True:
                try:
                    event = await asyncio.wait_for(ticket.events.get(), timeout=DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        ticket.cancel()
                        return error(499, "the client closed the request")
                    continue
                if isinstance(event, ErrorEvent):
                    raise ApiError(400, event.message)
                if isinstance(event, DoneEvent):
                    break
        finally:
            ticket.cancel()          # a no-op once done; frees the blocks of a request abandoned mid-way
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": event.text},
                      "finish_reason": _finish(event), "logprobs": None}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": event.text, "finish_reason": _finish(event), "logprobs": None}
            kind = "text_completion"
        return {"id": rid, "object": kind, "created": created, "model": engine.name, "choices": [choice],
                "usage": _usage(n_prompt, event)}

    async def _stream(ticket: Ticket, rid: str, created: int, chat: bool, include_usage: bool, n_prompt: int):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: dict | str, finish: str | None) -> str:
            if chat:
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
            payload = {"id": rid, "object": kind, "created": created, "model": engine.name, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return _sse(payload)

        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""}, None)
            while True:
                event = await ticket.events.get()
                if isinstance(event, TokenEvent):
                    if event.text:
                        yield chunk({"content": event.text} if chat else event.text, None)
                elif isinstance(event, ErrorEvent):
                    yield _sse({"error": {"message": event.message, "type": "invalid_request_error",
                                          "param": None, "code": None}})
                    break
                elif isinstance(event, DoneEvent):
                    if event.tail:
                        yield chunk({"content": event.tail} if chat else event.tail, None)
                    yield chunk({} if chat else "", _finish(event))
                    if include_usage:
                        yield _sse({"id": rid, "object": kind, "created": created, "model": engine.name,
                                    "choices": [], "usage": _usage(n_prompt, event)})
                    break
            yield "data: [DONE]\n\n"
        finally:
            ticket.cancel()          # the client left (or we are done): stop and free the KV blocks

    return app


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def model_description(info) -> dict:
    """The served model as /v1/models describes it under "colibri" (what a remote desktop app shows)."""
    s = info.settings
    return {"name": info.name, "architecture": info.architecture, "n_layers": info.n_layers,
            "n_experts": info.n_experts, "top_k": info.top_k, "chat": info.chat, "max_context": info.max_context,
            "streaming": info.streaming, "budget_range": list(info.budget_range) if info.budget_range else None,
            "settings": {"memory_budget": s.memory_budget, "prefetch_depth": s.prefetch_depth,
                         "io_threads": s.io_threads, "context_length": s.context_length}}


def prometheus(engine: Served) -> str:
    """The /metrics text: counters of the server, figures of the engine's telemetry and memory."""
    from app.service.model import rss

    c, service = engine.counters, engine.service
    lines = []

    def metric(name: str, kind: str, help_text: str, value: float) -> None:
        lines.extend([f"# HELP colibri_{name} {help_text}", f"# TYPE colibri_{name} {kind}", f"colibri_{name} {value}"])

    metric("requests_total", "counter", "Requests accepted.", c.requests)
    metric("requests_rejected_total", "counter", "Requests refused because the queue was full.", c.rejected)
    metric("requests_cancelled_total", "counter", "Requests whose client went away.", c.cancelled)
    metric("request_errors_total", "counter", "Requests that ended with an error.", c.errors)
    metric("prompt_tokens_total", "counter", "Prompt tokens processed.", c.prompt_tokens)
    metric("generated_tokens_total", "counter", "Tokens generated.", c.generated_tokens)
    metric("queue_depth", "gauge", "Requests waiting for room in the batch.", service.queue_depth)
    metric("running", "gauge", "Requests in the batch.", service.batch)
    kv_bytes, kv_blocks = service.kv_usage()
    metric("kv_bytes", "gauge", "Bytes of KV blocks in use or cached.", kv_bytes)
    metric("kv_blocks_used", "gauge", "KV blocks held by running requests.", kv_blocks)
    snap = service.snapshot()
    if snap is not None:
        metric("tokens_per_second", "gauge", "Decode speed over the recent tokens.", round(snap.tok_per_s, 3))
        metric("expert_hit_rate", "gauge", "Share of routed experts found in memory.", round(snap.hit_rate, 4))
        metric("bytes_read_total", "counter", "Bytes of streamed weights read from disk.", snap.bytes_read)
    memory = rss()
    if memory is not None:
        metric("rss_bytes", "gauge", "Resident memory of the server process.", memory)
    return "\n".join(lines) + "\n"
