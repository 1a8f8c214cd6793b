"""The routes that watch the engine rather than use it: `GET /health`, `GET /metrics` (Prometheus text),
`GET /v1/atlas` (the served model's atlas sidecar) and `GET /v1/telemetry` (server-sent events of the engine's
telemetry snapshots, with the expert tiers on request: what a remote desktop app draws).
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from app.server.engine import Served
from app.server.errors import SSE_EVENT, ApiError, responses
from app.server.errors import sse as _sse


def add_telemetry_routes(app: FastAPI, engine: Served) -> None:
    """Health, metrics, atlas and the telemetry stream of the model `engine` serves."""
    service = engine.service

    @app.get("/health", responses=responses())
    async def health():
        return {"status": "ok", "model": engine.name, "running": service.batch, "queued": service.queue_depth}

    @app.get("/v1/atlas", responses=responses(401, 404))
    async def atlas():
        from app.service.model import read_atlas

        found = read_atlas(engine.info.path)
        if found is None:
            # the model's path stays on the server: it tells a client nothing and a stranger too much
            raise ApiError(404, f"{engine.name} has no atlas yet; compute it where the server runs: "
                                f"`colibri atlas` on the served model", code="not_found")
        return found

    @app.get("/metrics", response_class=PlainTextResponse, responses=responses(401, text=True))
    async def metrics():
        return PlainTextResponse(prometheus(engine), media_type="text/plain; version=0.0.4")

    @app.get("/v1/telemetry", response_class=StreamingResponse, responses={**responses(400, 401, 404), 200: {
        "description": "Server-sent events, each `data: {snapshot}`, for as long as the client reads",
        "content": {"text/event-stream": {"schema": SSE_EVENT}}}})
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
        if "draft_tokens" in snap.gauges:
            metric("draft_tokens_total", "counter", "Draft tokens verified (speculative decoding).",
                   int(snap.gauges["draft_tokens"]))
            metric("draft_accepted_total", "counter", "Draft tokens accepted.", int(snap.gauges["draft_accepted"]))
    memory = rss()
    if memory is not None:
        metric("rss_bytes", "gauge", "Resident memory of the server process.", memory)
    return "\n".join(lines) + "\n"
