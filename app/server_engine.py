"""The engine behind `colibri serve`: one thread runs the scheduler; requests from the web server's
event loop join the batch between steps and get their events back on their own asyncio queues.

Only the engine thread touches the model, the scheduler and the KV pool. The event loop hands it
work through a locked inbox; it hands events back with `loop.call_soon_threadsafe`. A request
waits in a bounded queue until the batch has room: past `max_queue` waiting requests, `submit`
refuses at once (the server answers 429). A cancelled request (its client left) ends at the next
step and its KV blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from engine.errors import ColibriError
from engine.events import DoneEvent, Event
from engine.generate import GenerationRequest
from engine.kv import KVPool, blocks_for
from engine.scheduler import Scheduler


class QueueFull(ColibriError):
    """Too many requests are waiting; the client should retry later."""


@dataclass(eq=False)
class Ticket:
    """One request as the web server sees it: its events arrive on `events`, ending with a DoneEvent
    or an ErrorEvent; `cancel()` asks the engine to stop it."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    stop: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)

    def cancel(self) -> None:
        """Stop generating (the client went away); takes effect at the engine's next step."""
        self.stop.set()


@dataclass
class Counters:
    """What /metrics reports besides the telemetry snapshot."""

    requests: int = 0
    rejected: int = 0
    cancelled: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


class ServerEngine:
    """A loaded model served to concurrent requests, batched by a scheduler on its own thread."""

    def __init__(self, loaded: Any, *, ctx: int, max_batch: int = 4, max_queue: int = 16,
                 pool: KVPool | None = None, telemetry: Any = None, name: str | None = None):
        if max_batch < 1 or max_queue < 0:
            raise ColibriError(f"max batch {max_batch} and max queue {max_queue}: need a batch of at least 1 "
                               "and a queue of 0 or more")
        self.loaded, self.ctx, self.max_batch, self.max_queue = loaded, ctx, max_batch, max_queue
        self.name = name or loaded.name
        self.telemetry = telemetry
        self.pool = pool if pool is not None else KVPool(loaded.spec, max_batch * (blocks_for(ctx) + 1))
        self.scheduler = Scheduler(loaded.model, self.pool, max_len=ctx, tokenizer=loaded.tokenizer,
                                   stop_ids=loaded.stop_ids, max_batch=max_batch)
        self.counters = Counters()
        self.started = time.time()
        self._inbox: list[Ticket] = []
        self._live: dict[int, Ticket] = {}        # scheduler sequence id -> ticket
        self._lock = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="colibri-serve-engine", daemon=True)
        self._thread.start()

    # --- the event loop's side ---

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Ticket:
        """Queue a request; raises QueueFull past max_queue waiting requests."""
        with self._lock:
            if self._closed:
                raise ColibriError("the server is shutting down")
            waiting = len(self._inbox) + len(self.scheduler.waiting)
            running = len(self.scheduler.running)
            if running >= self.max_batch and waiting >= self.max_queue:
                self.counters.rejected += 1
                raise QueueFull(f"{waiting} requests are already waiting (--max-queue {self.max_queue}); retry shortly")
            ticket = Ticket(request, loop)
            self._inbox.append(ticket)
            self.counters.requests += 1
            self._lock.notify()
        return ticket

    @property
    def queue_depth(self) -> int:
        """Requests waiting for room in the batch."""
        return len(self._inbox) + len(self.scheduler.waiting)

    @property
    def running(self) -> int:
        """Requests in the batch now."""
        return len(self.scheduler.running)

    def close(self) -> None:
        """Stop the engine thread (requests still running are cancelled)."""
        with self._lock:
            self._closed = True
            for ticket in self._live.values():
                ticket.cancel()
            self._lock.notify()
        self._thread.join(timeout=30)

    # --- the engine thread ---

    def _loop(self) -> None:
        from app.settings import use_process_threads

        use_process_threads()          # numba's thread count is per thread: take the one --threads chose
        sched = self.scheduler
        while True:
            with self._lock:
                while not self._inbox and not sched.busy and not self._closed:
                    self._lock.wait(timeout=0.5)
                if self._closed and not sched.busy:
                    return
                new, self._inbox = self._inbox, []
            for ticket in new:
                seq = sched.submit(ticket.request, ticket.stop)
                self._live[seq.id] = ticket
                self._deliver(seq)
            if not sched.busy:
                continue
            try:
                touched = sched.step()
            except Exception as exc:  # noqa: BLE001 - a fault in one step fails its requests, not the server
                touched = list(sched.running)
                for seq in touched:
                    sched._fail(seq, f"internal error while generating: {type(exc).__name__}: {exc}")
            for seq in touched:
                self._deliver(seq)
            if self.telemetry is not None:
                self.telemetry.set_gauge("kv_bytes", self.pool.nbytes)
                self.telemetry.set_gauge("queue_depth", self.queue_depth)
                self.telemetry.set_gauge("running", self.running)

    def _deliver(self, seq) -> None:
        ticket = self._live.get(seq.id)
        if ticket is None:
            return
        for event in seq.drain():
            self._count(event, seq)
            ticket.loop.call_soon_threadsafe(ticket.events.put_nowait, event)
        if seq.done:
            self._live.pop(seq.id, None)

    def _count(self, event: Event, seq) -> None:
        c = self.counters
        if isinstance(event, DoneEvent):
            c.prompt_tokens += event.stats.prompt_tokens
            c.generated_tokens += event.stats.generated_tokens
            c.cancelled += event.finish_reason == "cancelled"
        elif type(event).__name__ == "ErrorEvent":
            c.errors += 1
