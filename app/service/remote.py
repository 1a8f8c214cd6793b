"""A Colibri server on another machine as an engine service: `RemoteService` offers what the desktop
app uses of `app.service.local.EngineService` (load, generate, cancel, update_settings, subscribe,
subscribe_tiers, snapshot, info, close, running) over the server's HTTP API, and emits the same
service events (ModelLoaded, Generation with TokenEvent / DoneEvent / ErrorEvent, SettingsApplied ...).

Standard library only (http.client; the wire format, its parser and the words of its errors are in
`app.service.wire`), two threads:
- the request thread answers requests one after another, as the engine thread does: load is
  "connect" (GET /v1/models and /v1/atlas), generate is a streamed POST /v1/chat/completions read
  as server-sent events. Stop shuts the completion's socket, which cancels it on the server.
- the telemetry thread holds GET /v1/telemetry open while anyone subscribes, turns each event into a
  `Snapshot` (its `recent` records kept across events, so the Time tab sees more than one event's
  worth) and an int8 tier grid, and reconnects with backoff when the stream drops; a
  `ConnectionChanged` event says when it is lost (why, and the fix) and regained.

The server's settings are set where it runs: `update_settings` and `compute_atlas` are answered at
once, on the caller's thread, with the reason and change nothing.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import queue
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np

from app.service.messages import (
    AtlasFailed,
    ChatMessage,
    GenerateRequest,
    Generation,
    LoadFailed,
    LoadOptions,
    LoadProgress,
    LoadRequest,
    ModelInfo,
    ModelLoaded,
    ModelUnloaded,
    Request,
    ServiceEvent,
    SettingsApplied,
    SettingsChange,
    UnloadRequest,
    _Shutdown,
    chat_message,
)
from app.service.wire import (
    CONNECT_TIMEOUT,
    SETTINGS,
    Endpoint,
    RemoteError,
    completion_body,
    fixed_reason,
    iter_sse,
    model_info,
    read_lines,
    refusal,
    token_scores,
    unreachable,
)
from engine.events import DoneEvent, ErrorEvent, GenerationStats, TokenEvent
from engine.generation.grammar import Grammar
from engine.generation.sampling import SamplingParams
from engine.telemetry import Snapshot, Subscription

log = logging.getLogger(__name__)

STREAM_TIMEOUT = 600.0          # s a streamed answer may stay silent (a long prompt on a slow server)
TELEMETRY_TIMEOUT = 15.0        # s without an event or keep-alive before the stream counts as dropped
TELEMETRY_INTERVAL = 0.25       # s between telemetry events asked of the server, at least (4 Hz across a network)
RECENT_PER_EVENT = 32           # per-token records each event carries
RECORDS_KEPT = 512              # records the client keeps across events (the engine's own history)
RECONNECT_DELAYS = (0.5, 1.0, 2.0, 4.0, 5.0)    # s before each retry of the telemetry stream; the last repeats
UNKNOWN_TOKEN = -1              # the id of a token the client saw only as text (the API sends no ids)


# ---- what the service adds to the engine service's events ---------------------------------------


@dataclass(frozen=True)
class ConnectionChanged:
    """The telemetry stream of the server was regained (connected) or lost (message: why, and the fix)."""

    url: str
    connected: bool
    message: str


# ---- the service --------------------------------------------------------------------------------


class RemoteService:
    """A Colibri server driven like a local EngineService (see the module's header)."""

    def __init__(self, url: str, api_key: str | None = None, on_event: Callable[[ServiceEvent], None] | None = None,
                 *, telemetry_interval: float = TELEMETRY_INTERVAL):
        self.endpoint = Endpoint.parse(url)
        self.url = self.endpoint.url
        self.api_key = api_key or None
        self.telemetry_interval = telemetry_interval
        self._on_event = on_event
        self._queue: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._lock = threading.Condition()      # guards the fields below; the telemetry thread waits on it
        self._active: tuple[int, threading.Event] | None = None
        self._cancelled: set[int] = set()
        self._cancel_below = 0
        self._sockets: set[socket.socket] = set()   # open connections, shut down by cancel / close
        self._request_socket: socket.socket | None = None
        self._telemetry_socket: socket.socket | None = None
        self._subs: dict[Subscription, bool] = {}    # each subscription -> whether it wants the tier grid
        self._stream_params: tuple[float, bool] | None = None   # (interval, tiers) the open stream was asked for
        self._snapshot: Snapshot | None = None
        self._records: deque = deque(maxlen=RECORDS_KEPT)   # TokenTimes kept across events, oldest first
        self._last_total: int | None = None     # tokens + prefill tokens of the last event of this stream
        self._connected: bool | None = None     # the telemetry stream's state as last reported
        self._info: ModelInfo | None = None
        self._closed = False
        self.events_received = 0                # telemetry events, and their bytes (diagnostics, tests)
        self.bytes_received = 0
        self._thread = threading.Thread(target=self._loop, name="colibri-remote", daemon=True)
        self._thread.start()
        self._telemetry_thread: threading.Thread | None = None

    # --- any thread ----------------------------------------------------------------------------------

    def load(self, path: str | Path | None = None, options: LoadOptions = LoadOptions()) -> int:
        """Connect: read the served model's description and atlas (path and options are the server's to choose)."""
        return self._put(lambda i: LoadRequest(i, str(path or self.url), options))

    def unload(self) -> int:
        """Forget the served model (the server keeps running it)."""
        return self._put(UnloadRequest)

    def generate(self, prompt: Sequence[int] | None = None, *, messages: Sequence[ChatMessage | Mapping] | None = None,
                 sampling: SamplingParams = SamplingParams(), max_tokens: int = 256, stop: Sequence[str] = (),
                 logprobs: int | None = None, grammar: Grammar | None = None) -> int:
        """A streamed completion from token ids or chat messages; events come back as `Generation` with this id.
        With `logprobs`, each TokenEvent carries its token's log-probability and that many alternatives' (their
        text in `pieces`: the server sends no ids). A `grammar` made from a JSON schema or a JSON object goes to
        the server as its `response_format`; another is refused (an ErrorEvent)."""
        if (prompt is None) == (messages is None):
            raise ValueError("generate: give either prompt token ids or chat messages")
        msgs = None if messages is None else tuple(chat_message(m) for m in messages)
        ids = None if prompt is None else tuple(int(t) for t in prompt)
        return self._put(lambda i: GenerateRequest(i, ids, msgs, sampling, int(max_tokens), tuple(stop),
                                                   logprobs=logprobs, grammar=grammar))

    def compute_atlas(self) -> int:
        """Refused: the atlas of a served model is computed where it runs (answered at once)."""
        i = self._next_id()
        self._emit(AtlasFailed(i, f"the atlas of the model served at {self.url} is computed where it runs: "
                                  "`colibri atlas MODEL` on that machine, then reconnect"))
        return i

    def cancel(self, request: int | None = None) -> None:
        """Stop request `request` (running or queued); None stops the running one and everything queued."""
        with self._lock:
            if request is None:
                self._cancel_below = next(self._ids)
            else:
                self._cancelled.add(request)
            active, sock = self._active, self._request_socket
        if active is not None and (request is None or active[0] == request):
            active[1].set()
            _shut(sock)       # wakes the read; the server sees the client leave and stops generating

    def update_settings(self, change: SettingsChange) -> int:
        """Refused: a server's settings are set where it runs (answered at once with the reason)."""
        i = self._next_id()
        asked = [name.replace("_", " ") for name in SETTINGS if getattr(change, name) is not None]
        self._emit(SettingsApplied(i, self._info, (
            f"{', '.join(asked) or 'settings'}: {fixed_reason(self.url)}",)))
        return i

    def subscribe(self, callback: Callable[[Snapshot], None], min_interval: float = 0.0) -> Subscription:
        """The server's telemetry snapshots, at most every min_interval s (and as often as the stream brings them)."""
        return self._subscribe(Subscription(callback, min_interval, on_close=self._unsubscribe), tiers=False)

    def subscribe_tiers(self, callback: Callable[[Any], None], min_interval: float = 0.0) -> Subscription:
        """The served experts' tiers as a read-only int8 grid [layers, experts] (None when the server sends none)."""
        return self._subscribe(Subscription(callback, min_interval, on_close=self._unsubscribe), tiers=True)

    def snapshot(self) -> Snapshot | None:
        """The latest snapshot the stream brought, or None before the first."""
        return self._snapshot

    @property
    def info(self) -> ModelInfo | None:
        """The served model as of the last load (connect)."""
        return self._info

    @property
    def connected(self) -> bool | None:
        """Whether the telemetry stream is up (None: not tried yet)."""
        return self._connected

    @property
    def running(self) -> bool:
        """Whether the request thread is alive."""
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Stop what runs, close every connection and end both threads; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sockets = list(self._sockets)
            self._lock.notify_all()
        self.cancel()
        self._queue.put(_Shutdown())
        for sock in sockets:
            _shut(sock)
        for thread in (self._thread, self._telemetry_thread):
            if thread is not None:
                thread.join(timeout)
                if thread.is_alive():
                    log.warning("%s did not stop within %.0f s", thread.name, timeout)

    def __enter__(self) -> RemoteService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _next_id(self) -> int:
        with self._lock:
            if self._closed:
                raise RuntimeError("the remote service is closed")
            return next(self._ids)

    def _put(self, make: Callable[[int], Request]) -> int:
        i = self._next_id()
        self._queue.put(make(i))
        return i

    def _emit(self, event: ServiceEvent | ConnectionChanged) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception:  # a broken listener must not stop the service
            log.exception("remote service listener failed on %s", type(event).__name__)

    # --- HTTP ------------------------------------------------------------------------------------------

    def _open(self, method: str, path: str, body: Any = None, timeout: float = CONNECT_TIMEOUT,
              slot: str | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request; (connection, response) of a 2xx answer, else RemoteError saying what went wrong."""
        e = self.endpoint
        if e.scheme == "https":
            conn = http.client.HTTPSConnection(e.host, e.port, timeout=CONNECT_TIMEOUT,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(e.host, e.port, timeout=CONNECT_TIMEOUT)
        headers = {"Accept": "application/json, text/event-stream", "User-Agent": "colibri-gui"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.connect()
            conn.sock.settimeout(timeout)
            with self._lock:
                if self._closed:
                    raise RemoteError("the remote service is closed")
                self._sockets.add(conn.sock)
                if slot is not None:
                    setattr(self, slot, conn.sock)
            conn.request(method, e.prefix + path, body=data, headers=headers)
            response = conn.getresponse()
        except RemoteError:
            self._close(conn)
            raise
        except (OSError, http.client.HTTPException) as exc:
            self._close(conn)
            raise RemoteError(unreachable(self.endpoint, exc)) from None
        if response.status >= 400:
            try:
                raise refusal(self.endpoint, self.api_key, response)
            finally:
                self._close(conn)
        return conn, response

    def _get_json(self, path: str) -> Any:
        conn, response = self._open("GET", path)
        try:
            return json.loads(response.read())
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise RemoteError(f"{self.url}{path} answered something else than JSON ({exc})") from None
        finally:
            self._close(conn)

    def _close(self, conn: http.client.HTTPConnection) -> None:
        sock = conn.sock
        with self._lock:
            self._sockets.discard(sock)
            if self._request_socket is sock:
                self._request_socket = None
            if self._telemetry_socket is sock:
                self._telemetry_socket = None
        conn.close()

    # --- the request thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            req = self._queue.get()
            if isinstance(req, _Shutdown):
                return
            cancel = threading.Event()
            with self._lock:
                if req.id < self._cancel_below or req.id in self._cancelled or self._closed:
                    cancel.set()
                self._cancelled.discard(req.id)
                self._active = (req.id, cancel)
            try:
                if isinstance(req, LoadRequest):
                    self._connect(req, cancel)
                elif isinstance(req, GenerateRequest):
                    self._generate(req, cancel)
                elif isinstance(req, UnloadRequest):
                    self._info = None
                    self._emit(ModelUnloaded(req.id))
            except Exception as exc:  # the thread outlives any request
                log.exception("remote request %r failed", req)
                message = f"internal error: {type(exc).__name__}: {exc}"
                if isinstance(req, LoadRequest):
                    self._emit(LoadFailed(req.id, message))
                elif isinstance(req, GenerateRequest):
                    self._emit(Generation(req.id, ErrorEvent(message)))
            finally:
                with self._lock:
                    self._active = None

    def _connect(self, req: LoadRequest, cancel: threading.Event) -> None:
        self._emit(LoadProgress(req.id, 0.0, f"connecting to {self.url}"))
        try:
            if cancel.is_set():
                raise RemoteError("cancelled")
            models = self._get_json("/v1/models")
            info = model_info(models, self.url)
            self._emit(LoadProgress(req.id, 0.5, f"reading the atlas of {info.name}"))
            try:
                atlas = self._get_json("/v1/atlas")
            except RemoteError as exc:
                if exc.status != 404:
                    log.warning("the atlas of %s is not shown: %s", info.name, exc)
                atlas = None
            if not isinstance(atlas, dict):
                atlas = None
        except RemoteError as exc:
            if cancel.is_set():
                self._emit(LoadFailed(req.id, f"connecting to {self.url} was cancelled", cancelled=True))
            else:
                self._emit(LoadFailed(req.id, str(exc)))
            return
        self._info = info
        self._emit(LoadProgress(req.id, 1.0, "connected"))
        self._emit(ModelLoaded(req.id, info, atlas))

    def _generate(self, req: GenerateRequest, cancel: threading.Event) -> None:
        t0 = time.perf_counter()
        if cancel.is_set():
            self._emit(Generation(req.id, DoneEvent("cancelled", (), "", GenerationStats(0, 0, 0.0, 0.0, 0.0))))
            return
        chat = req.messages is not None
        try:
            body = completion_body(req, self._info.name if self._info is not None else "default")
        except RemoteError as exc:
            self._emit(Generation(req.id, ErrorEvent(str(exc))))
            return
        pieces: list[str] = []
        thoughts: list[str] = []     # the reasoning the server sends apart (`reasoning_content`)
        first = last = None
        usage: Mapping[str, Any] = {}
        finish: str | None = None
        conn = None
        route = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            try:
                conn, response = self._open("POST", route, body, timeout=STREAM_TIMEOUT, slot="_request_socket")
            except RemoteError as exc:
                if (exc.code, exc.param) != ("context_length_exceeded", "max_tokens"):
                    raise
                # the answer may not fill max_tokens: let it run to the end of the context, as an engine here does
                body.pop("max_tokens")
                conn, response = self._open("POST", route, body, timeout=STREAM_TIMEOUT, slot="_request_socket")
            if cancel.is_set():
                raise RemoteError("cancelled")
            for event in iter_sse(read_lines(response)):
                if event.data == "[DONE]":
                    break
                payload = json.loads(event.data)
                if payload.get("error"):
                    message = payload["error"].get("message") if isinstance(payload["error"], dict) else None
                    self._emit(Generation(req.id, ErrorEvent(f"{self.url}: {message or payload['error']}")))
                    return
                if payload.get("usage"):
                    usage = payload["usage"]
                for choice in payload.get("choices") or ():
                    delta = (choice.get("delta") or {}) if chat else {}
                    text = delta.get("content") if chat else choice.get("text")
                    thought = delta.get("reasoning_content") or ""
                    scores = token_scores(choice, chat)
                    if text or thought or scores:
                        last = time.perf_counter()
                        first = first or last
                    # one event per token scored (the chunk's text on the first), else one for the chunk's text
                    tokens = [TokenEvent(0, UNKNOWN_TOKEN, "", "", logprob, tuple((UNKNOWN_TOKEN, p) for _, p in top),
                                         (token, *(t for t, _ in top))) for token, logprob, top in scores]
                    if text or thought:
                        tokens[:1] = [replace(tokens[0] if tokens else TokenEvent(0, UNKNOWN_TOKEN, ""),
                                              text=text or "", reasoning=thought)]
                    for token in tokens:
                        token = replace(token, index=len(pieces))
                        self._emit(Generation(req.id, token))
                        pieces.append(token.text)
                        thoughts.append(token.reasoning)
                    finish = choice.get("finish_reason") or finish
            else:
                if not cancel.is_set():
                    raise RemoteError(f"the answer from {self.url} ended before it was complete; is the server "
                                      "still running?")
        except (RemoteError, OSError, http.client.HTTPException, ValueError, AttributeError) as exc:
            if not cancel.is_set():
                message = str(exc) if isinstance(exc, RemoteError) else (
                    f"the connection to {self.url} dropped mid-answer ({type(exc).__name__}: {exc}); is the "
                    "server still running?")
                self._emit(Generation(req.id, ErrorEvent(message)))
                return
        finally:
            if conn is not None:
                self._close(conn)
        reason = "cancelled" if cancel.is_set() else (finish if finish in ("stop", "length") else "stop")
        n = int(usage.get("completion_tokens", len(pieces)))
        ttft = (first - t0) if first is not None else 0.0
        stats = GenerationStats(int(usage.get("prompt_tokens", 0)), n, ttft,
                                (last - first) if first is not None else 0.0, ttft)
        self._emit(Generation(req.id, DoneEvent(reason, (UNKNOWN_TOKEN,) * n, "".join(pieces), stats,
                                                reasoning="".join(thoughts))))

    # --- the telemetry thread --------------------------------------------------------------------------

    def _subscribe(self, sub: Subscription, tiers: bool) -> Subscription:
        with self._lock:
            if self._closed:
                raise RuntimeError("the remote service is closed")
            self._subs[sub] = tiers
            if self._telemetry_thread is None:
                self._telemetry_thread = threading.Thread(target=self._telemetry_loop, name="colibri-remote-telemetry",
                                                          daemon=True)
                self._telemetry_thread.start()
            self._lock.notify_all()
            restart = self._stream_params is not None and self._wanted() != self._stream_params
            sock = self._telemetry_socket if restart else None
        _shut(sock)   # the open stream was asked for less (no tiers, or a slower rate): open it again
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.pop(sub, None)
            idle = not self._subs
            sock = self._telemetry_socket if idle else None
        _shut(sock)   # nobody listens: no stream

    def _wanted(self) -> tuple[float, bool] | None:
        """(interval, tiers) of the stream the subscribers need, or None without subscribers (lock held)."""
        if not self._subs:
            return None
        interval = max(self.telemetry_interval, min(s.min_interval for s in self._subs))
        return round(interval, 3), any(self._subs.values())

    def _telemetry_loop(self) -> None:
        failures = 0
        while True:
            with self._lock:
                while not self._closed and self._wanted() is None:
                    self._lock.wait()
                if self._closed:
                    return
                params = self._stream_params = self._wanted()
            interval, tiers = params
            path = f"/v1/telemetry?interval={quote(str(interval))}&recent={RECENT_PER_EVENT}&tiers={int(tiers)}"
            reason = f"{self.url} ended the telemetry stream"
            conn = None
            try:
                conn, response = self._open("GET", path, timeout=TELEMETRY_TIMEOUT, slot="_telemetry_socket")
                self._last_total = None
                for event in iter_sse(read_lines(response)):
                    with self._lock:
                        if self._closed or self._wanted() != params:
                            break       # subscribers changed before the socket was there to shut
                    self._telemetry_event(event.data)
                    if failures or self._connected is not True:
                        failures = 0
                        self._set_connected(True, f"connected to {self.url}")
            except RemoteError as exc:
                reason = str(exc)
            except (TimeoutError, socket.timeout):
                reason = f"{self.url} sent no telemetry for {TELEMETRY_TIMEOUT:.0f} s"
            except (OSError, http.client.HTTPException, ValueError) as exc:
                reason = f"the telemetry stream from {self.url} dropped ({type(exc).__name__}: {exc})"
            finally:
                if conn is not None:
                    self._close(conn)
            with self._lock:
                if self._closed:
                    return
                if self._wanted() != params:    # closed on purpose: other subscribers, or none
                    continue
                delay = RECONNECT_DELAYS[min(failures, len(RECONNECT_DELAYS) - 1)]
                failures += 1
            self._set_connected(False, f"{reason}; retrying every {RECONNECT_DELAYS[-1]:.0f} s at most")
            with self._lock:
                self._lock.wait_for(lambda: self._closed, timeout=delay)

    def _set_connected(self, connected: bool, message: str) -> None:
        if self._connected is connected:
            return
        self._connected = connected
        (log.info if connected else log.warning)("%s", message)
        self._emit(ConnectionChanged(self.url, connected, message))

    def _telemetry_event(self, data: str) -> None:
        """One event of the stream: keep the records, deliver the snapshot and the tiers to the subscribers."""
        payload = json.loads(data)
        self.events_received += 1
        self.bytes_received += len(data)
        snap = self._keep_records(Snapshot.from_dict(payload))
        grid = payload.get("tiers")
        if grid is not None:
            grid = np.array(grid, np.int8)
            if grid.ndim != 2:
                grid = None
            else:
                grid.flags.writeable = False
        self._snapshot = snap
        now = time.monotonic_ns()
        with self._lock:
            subs = tuple(self._subs.items())
        for sub, tiers in subs:
            if sub.due(now):
                sub.deliver(grid if tiers else snap, now)

    def _keep_records(self, snap: Snapshot) -> Snapshot:
        """snap with `recent` grown from the records kept: each event adds the records made since the last one."""
        total = snap.tokens + snap.prefill_tokens
        last = self._last_total
        if last is None or total < last:      # the first event of a stream, or the server's telemetry was reset
            self._records.clear()
            self._records.extend(snap.recent)
        else:
            new, fresh = total - last, []
            for rec in reversed(snap.recent):
                if new <= 0:
                    break
                fresh.append(rec)
                new -= rec.n
            self._records.extend(reversed(fresh))
        self._last_total = total
        return replace(snap, recent=tuple(self._records))


def _shut(sock: socket.socket | None) -> None:
    """Wake a thread blocked reading sock (its owner closes it)."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
