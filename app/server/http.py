"""How `colibri serve` meets the network: the uvicorn configuration (`build_config`, `Server`) and an HTTP/1.1
protocol that hostile or careless clients cannot hang, exhaust or flood the log with.

uvicorn's h11 protocol alone keeps a connection that never finishes its request head for ever, answers an
oversized head with a 400 and a reset, and applies `limit_concurrency` only to requests that arrived, so idle
half-open connections pile up until accept() fails with EMFILE. `GuardedH11Protocol` adds, per `HttpLimits`:

- a head deadline: a request head must arrive within `head_timeout` s of the connection opening (or of the
  previous answer, on a kept-alive connection); else 408, or a plain close if not a byte came;
- a body deadline: the body must be complete within `body_timeout` s of its head; else 408, and the app's read
  of it ends as a disconnect, so no generation starts;
- a connection limit: past `max_connections`, the connection that has waited longest for a request head is
  closed to make room (nothing was asked on it yet: nginx reclaims idle keep-alive connections the same way),
  so a flood of idle connections cannot lock out /health; when every connection carries a request, the
  newcomer gets 503 with `Retry-After` (the OpenAI client retries it) rather than a reset;
- 431 for a request head over `max_head` bytes (h11's own limit), and 400 for malformed requests;
- a lingering close after any such refusal: the answer is sent, then what the client still sends is read and
  dropped for up to `linger` s, so that it reads the answer instead of a connection reset;
- each refusal in the error shape of the API the request's path belongs to (app.server.errors.shape_of): the
  path is read from the request line as far as it came (a refused newcomer's 503 waits up to `linger` s for its
  request line, read apart from h11, so that an Anthropic or Ollama client gets an answer it can parse);
- a bounded log: each repeated warning, and asyncio's "out of system resource" accept errors, at most once per
  `LOG_EVERY` s, with the count of those left out (an EMFILE storm once wrote 31 MB of tracebacks in 10 s).
"""

from __future__ import annotations

import asyncio
import functools
import http
import json
import logging
import resource
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from app.server.errors import error_payload, shape_of
from engine.errors import ColibriError

LOG_EVERY = 10.0        # seconds between two log records of one kind
FD_RESERVE = 256        # open files kept for the model's files, reader threads, /proc reads, the log
LINGER_CAP = 64         # refused connections read-and-dropped at once; past it a refusal closes at once
SAMPLE = 2048           # bytes of a request head kept to read its path from, when h11 has not parsed it


@dataclass(frozen=True)
class HttpLimits:
    """What one client may hold of the server (the defaults suit `--host 0.0.0.0`)."""

    max_connections: int = 512      # open connections, idle ones included
    head_timeout: float = 10.0      # seconds for a request line and headers to arrive
    body_timeout: float = 30.0      # seconds for the body to arrive after its head (4 MiB at 140 KB/s)
    keep_alive: float = 5.0         # seconds an idle connection is kept after an answer
    max_head: int = 16 * 1024       # bytes of a request head (h11's default); more gets 431
    linger: float = 2.0             # seconds a refused connection's input is drained before closing


def build_config(app: Any, *, host: str = "127.0.0.1", port: int = 8080, limits: HttpLimits = HttpLimits(),
                 log_level: str = "warning") -> uvicorn.Config:
    """The uvicorn configuration `colibri serve` runs `app` with (tests and the soak use it too); run it with
    `Server(config)`, one server per configuration."""
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level,
        http=functools.partial(GuardedH11Protocol, limits=limits),      # type: ignore[arg-type]
        ws="none",                              # no WebSocket route: an upgrade request is answered as HTTP
        timeout_keep_alive=limits.keep_alive,   # type: ignore[arg-type]   (call_later takes a float)
        h11_max_incomplete_event_size=limits.max_head,
        timeout_graceful_shutdown=2,            # a remote app holds /v1/telemetry open for ever: stop after 2 s
    )


def check_fd_limit(max_connections: int) -> int:
    """Raise this process's open-file limit to fit `max_connections` sockets if it is lower (up to the hard
    limit); the limit in force, or ColibriError saying how to make room."""
    need = max_connections + LINGER_CAP + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard))
    except (ValueError, OSError):
        pass
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft < need:
        raise ColibriError(f"--max-connections {max_connections} needs about {need} open files, but this process "
                           f"may open {soft}: pass a smaller --max-connections, or raise the limit (`ulimit -n {need}`)")
    return soft


# --------------------------------------------------------------------------- the log


class Throttle:
    """At most one record per key every `every` seconds; the next one let through says how many were left out."""

    def __init__(self, every: float = LOG_EVERY, clock=time.monotonic):
        self.every, self.clock = every, clock
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}
        self._lock = threading.Lock()

    def admit(self, key: str) -> int | None:
        """None to drop this record; else how many of its kind were dropped since the last one admitted."""
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.every:
                self._dropped[key] = self._dropped.get(key, 0) + 1
                return None
            self._last[key] = now
            return self._dropped.pop(key, 0)


class ThrottleFilter(logging.Filter):
    """A logging filter passing each message (by its first line) at most once per `LOG_EVERY` seconds."""

    def __init__(self, every: float = LOG_EVERY):
        super().__init__()
        self.throttle = Throttle(every)

    def filter(self, record: logging.LogRecord) -> bool:
        dropped = self.throttle.admit(str(record.msg).split("\n", 1)[0])
        if dropped is None:
            return False
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it in the last {self.throttle.every:g} s not logged)"
        return True


def throttled_exception_handler(throttle: Throttle):
    """An asyncio exception handler logging each kind of error (its message) at the throttle's rate; asyncio
    reports every failed accept() of a full file table, up to the listen backlog of them per tick."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        dropped = throttle.admit(str(context.get("message", "")))
        if dropped is None:
            return
        if dropped:
            context = {**context, "message": f"{context.get('message')} ({dropped} more in the last "
                                              f"{throttle.every:g} s not logged)"}
        loop.default_exception_handler(context)

    return handle


class Server(uvicorn.Server):
    """uvicorn's server with its log bounded: asyncio's errors and uvicorn's warnings throttled while it runs."""

    async def serve(self, sockets=None) -> None:
        """Serve until told to stop, with the throttles in place."""
        asyncio.get_running_loop().set_exception_handler(throttled_exception_handler(Throttle()))
        log = logging.getLogger("uvicorn.error")
        throttle = ThrottleFilter()
        log.addFilter(throttle)
        try:
            await super().serve(sockets)
        finally:
            log.removeFilter(throttle)


# --------------------------------------------------------------------------- the protocol


class _Registry:
    """What the connections of one server share: those waiting for a request head, oldest first, and how
    many refused connections are being drained."""

    def __init__(self) -> None:
        self.waiting: dict[GuardedH11Protocol, None] = {}     # insertion order = waiting since
        self.lingering = 0


_REGISTRIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # uvicorn's ServerState -> _Registry


def error_bytes(status: int, message: str, code: str | None, headers: tuple[tuple[str, str], ...] = (),
                path: str = "") -> bytes:
    """A whole HTTP/1.1 answer in the error shape of the API `path` belongs to (OpenAI's without a path), closing
    the connection (written outside h11)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps(error_payload(shape_of(path), status, message, kind, None, code)).encode()
    lines = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}", "content-type: application/json",
             f"content-length: {len(body)}", "connection: close", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def request_path(head: bytes) -> str:
    """The path of the request line at the start of `head` ("" until it has come to its end)."""
    line = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) < 3 and b"\n" not in head:      # the target may still be arriving
        return ""
    target = parts[1] if len(parts) > 1 else b""
    return target.split(b"?", 1)[0].decode("latin-1")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines, the connection limit, 431 and lingering closes of this module."""

    def __init__(self, config: uvicorn.Config, server_state, app_state: dict, _loop=None, *,
                 limits: HttpLimits = HttpLimits()) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.registry: _Registry = _REGISTRIES.setdefault(server_state, _Registry())
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0            # bytes received while waiting for the current head
        self._head_sample = b""         # their first SAMPLE bytes, to read the path from
        self._refusal: tuple | None = None      # a refusal waiting for the request line (its path picks the shape)
        self._dropping = False          # answered and closing: what still arrives is read and dropped
        self._lingering = False
        self._protocol_error: h11.RemoteProtocolError | None = None
        next_event = self.conn.next_event

        def next_event_kept() -> Any:    # uvicorn drops h11's error, whose status hint says 431 or 400
            try:
                return next_event()
            except h11.RemoteProtocolError as exc:
                self._protocol_error = exc
                raise

        self.conn.next_event = next_event_kept    # type: ignore[method-assign]

    # --- uvicorn's hooks

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections and not self._make_room():
            self._refuse_on_request_line(503, f"the server holds {self.limits.max_connections} connections, each with "
                                              "a request in progress: retry shortly", "server_busy",
                                         (("retry-after", "1"),))
            return
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            self._head_sample += data[: SAMPLE - len(self._head_sample)]
            if b"\n" in self._head_sample or len(self._head_sample) >= SAMPLE:
                self._refuse(*self._refusal, path=request_path(self._head_sample))
            return
        if self._dropping:
            return
        if self in self.registry.waiting:
            self._head_bytes += len(data)
            self._head_sample += data[: SAMPLE - len(self._head_sample)]
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self._dropping:
            return
        if self.cycle is not cycle:             # a request head arrived
            self._head_arrived()
        if self._body_timer is not None and not self.cycle.more_body:
            self._body_timer.cancel()
            self._body_timer = None

    def on_response_complete(self) -> None:
        if not self.transport.is_closing() and not self._dropping:
            self._await_head()                  # before uvicorn takes a pipelined request, which ends the wait
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        status = getattr(self._protocol_error, "error_status_hint", 400)
        path = request_path(self._head_sample)
        if status == 431:
            self._refuse(431, f"the request head is over {self.limits.max_head} bytes: send fewer or shorter headers",
                         "request_header_fields_too_large", path=path)
        else:
            self._refuse(400, f"malformed HTTP request: {self._protocol_error or msg}", "bad_http_request", path=path)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._linger_timer = None
        self.registry.waiting.pop(self, None)
        if self._lingering:
            self._lingering = False
            self.registry.lingering -= 1
        super().connection_lost(exc)

    # --- deadlines

    def _await_head(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self._head_timer is not None:
            self._head_timer.cancel()
        self.registry.waiting.pop(self, None)
        self.registry.waiting[self] = None
        self._head_bytes = 0
        self._head_sample = b""
        self._head_timer = self.loop.call_later(self.limits.head_timeout, self._head_late)

    def _head_arrived(self) -> None:
        self.registry.waiting.pop(self, None)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self.cycle is not None and self.cycle.more_body:
            self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if self._head_bytes:
            self._refuse(408, f"the request head did not arrive within {self.limits.head_timeout:g} s",
                         "request_timeout", path=request_path(self._head_sample))
        else:                                   # not a byte: nobody is reading an answer
            self.registry.waiting.pop(self, None)
            self.transport.close()

    def _body_late(self) -> None:
        self._body_timer = None
        if self.cycle is None or not self.cycle.more_body:
            return
        if not self.cycle.response_started:
            self._refuse(408, f"the request body did not arrive within {self.limits.body_timeout:g} s of its head",
                         "request_timeout", path=self.cycle.scope.get("path", ""))
        else:                                   # answered already (the body was not needed): just close
            self._end_cycle()
            self.transport.close()

    # --- the connection limit and refusals

    def _make_room(self) -> bool:
        """Close the connection that has waited longest for a request head; False if none waits."""
        for victim in self.registry.waiting:
            if victim is not self:
                self.registry.waiting.pop(victim)
                if victim._head_timer is not None:
                    victim._head_timer.cancel()
                    victim._head_timer = None
                victim.transport.close()
                return True
        return False

    def _end_cycle(self) -> None:
        """The app's request ends as a disconnect: its reads say so, its writes are dropped."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()

    def _refuse_on_request_line(self, status: int, message: str, code: str,
                                headers: tuple[tuple[str, str], ...] = ()) -> None:
        """Refuse a connection on which nothing came yet: wait up to `linger` s for its request line, whose path
        picks the error's shape, then answer. Counted with the drained ones: past LINGER_CAP, answer at once."""
        self.connections.discard(self)          # no longer uvicorn's; the registry bounds the waiting ones
        if self.registry.lingering >= LINGER_CAP:
            self._refuse(status, message, code, headers)
            return
        self.registry.lingering += 1
        self._lingering = True
        self._refusal = (status, message, code, headers)
        self._head_timer = self.loop.call_later(self.limits.linger, lambda: self._refuse(
            status, message, code, headers, path=request_path(self._head_sample)))

    def _refuse(self, status: int, message: str, code: str, headers: tuple[tuple[str, str], ...] = (),
                path: str = "") -> None:
        """Answer `status` (in the error shape of `path`'s API) outside h11 and close after draining what the
        client still sends."""
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
        self._refusal = None
        self.registry.waiting.pop(self, None)
        self._end_cycle()
        if self.transport.is_closing():
            return
        self._dropping = True
        self.transport.write(error_bytes(status, message, code, headers, path))
        self.connections.discard(self)          # no longer uvicorn's; the registry bounds the drained ones
        if (not self._lingering and self.registry.lingering >= LINGER_CAP) or not self.transport.can_write_eof():
            self.transport.close()
            return
        if not self._lingering:
            self.registry.lingering += 1
            self._lingering = True
        self.transport.write_eof()
        self.transport.resume_reading()         # drain even if uvicorn had paused reading a large body
        self._linger_timer = self.loop.call_later(self.limits.linger, self.transport.abort)
