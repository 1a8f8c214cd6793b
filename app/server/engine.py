"""The engine service as `colibri serve` sees it: a request from the web server's event loop becomes
a generation of the shared `app.service.local.EngineService` (the one the desktop app drives), and its
events come back on the request's own asyncio queue.

Only the engine thread touches the model; its listener hands each event to the event loop with
`loop.call_soon_threadsafe`. The service batches generations and bounds the waiting ones: past
its `max_queue`, `submit` raises QueueFull (the server answers 429). A cancelled ticket (its client
left) ends at the engine's next step: a queued one leaves the queue, a running one gives its KV blocks back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from app.service.local import EngineService, Generation, QueueFull, ServiceEvent
from engine.errors import ColibriError
from engine.events import DoneEvent, ErrorEvent
from engine.generation.grammar import Grammar
from engine.generation.sampling import SamplingParams
from engine.tokenizer.reasoning import ReasoningFormat

__all__ = ["Counters", "QueueFull", "Served", "Ticket"]


@dataclass(eq=False)
class Ticket:
    """One request as the web server sees it: its events arrive on `events`, ending with a DoneEvent
    or an ErrorEvent; `cancel()` asks the engine to stop it, `watch()` does so when the client leaves."""

    service: EngineService
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: int = 0
    submitted: float = field(default_factory=time.monotonic)
    watcher: asyncio.Task | None = None

    def cancel(self) -> None:
        """Stop generating (the client went away); takes effect at the engine's next step, queued or running."""
        if self.request:
            self.service.cancel(self.request)

    def watch(self, receive: Callable[[], Awaitable[dict]]) -> None:
        """Cancel as soon as the client disconnects, whether the answer streams or not and whether it runs or
        still waits: a task awaits the request's ASGI `receive` (its body already read) for `http.disconnect`.
        Polling `Request.is_disconnected()` misses it, and a queued stream sends nothing that could fail."""

        async def wait() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.cancel()      # also when the server finished the answer: a no-op then

        self.watcher = asyncio.get_running_loop().create_task(wait())

    def close(self) -> None:
        """The answer is complete or abandoned: stop the generation (a no-op once done) and the watcher."""
        self.cancel()
        if self.watcher is not None:
            self.watcher.cancel()


@dataclass
class Counters:
    """What /metrics reports besides the telemetry snapshot (updated on the engine thread)."""

    requests: int = 0
    rejected: int = 0
    cancelled: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


class Served:
    """The model loaded in `service`, served to concurrent web requests."""

    def __init__(self, service: EngineService):
        if service.info is None:
            raise ColibriError("the engine service has no model loaded: load one before serving it")
        self.service = service
        self.counters = Counters()
        self.started = time.time()

    @property
    def info(self):
        """The served model (app.service.local.ModelInfo)."""
        info = self.service.info
        if info is None:
            raise ColibriError("the model is no longer loaded")
        return info

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def ctx(self) -> int:
        """Tokens of context per request."""
        return self.info.settings.context_length

    def submit(self, prompt: list[int], *, max_tokens: int, sampling: SamplingParams, stop: tuple[str, ...],
               loop: asyncio.AbstractEventLoop, reasoning: ReasoningFormat | None = None,
               logprobs: int | None = None, grammar: Grammar | None = None,
               speculative: bool | None = None) -> Ticket:
        """Start a generation (its text split into reasoning and answer by `reasoning`, when given; its tokens'
        log-probabilities with `logprobs` alternatives each, when given; decoded to match `grammar`, when given);
        raises QueueFull when too many wait for room in the batch."""
        ticket = Ticket(self.service)

        def listen(event: ServiceEvent) -> None:     # engine thread
            if not isinstance(event, Generation):
                return
            self._count(event.event)
            try:
                loop.call_soon_threadsafe(ticket.events.put_nowait, event.event)
            except RuntimeError:     # the event loop is closed: the server is stopping
                pass

        try:
            ticket.request = self.service.generate(prompt, sampling=sampling, max_tokens=max_tokens, stop=stop,
                                                   listener=listen, reasoning=reasoning, logprobs=logprobs,
                                                   grammar=grammar, speculative=speculative)
        except QueueFull:
            self.counters.rejected += 1
            raise
        except RuntimeError as exc:    # the service is closed
            raise ColibriError(f"the server is shutting down ({exc})") from None
        self.counters.requests += 1
        return ticket

    def _count(self, event) -> None:
        c = self.counters
        if isinstance(event, DoneEvent):
            c.prompt_tokens += event.stats.prompt_tokens
            c.generated_tokens += event.stats.generated_tokens
            c.cancelled += event.finish_reason == "cancelled"
        elif isinstance(event, ErrorEvent):
            c.errors += 1
