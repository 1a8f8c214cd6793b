"""The engine service: the one way front ends (the GUI, the HTTP server) drive the engine.

One engine thread owns the loaded model. Requests go in through a queue as frozen dataclasses
(load, generate, unload, atlas); events come out through one callback, called on the engine
thread, each carrying the id of the request it answers (and to a listener given with the request).
Nothing here imports Qt or a web framework: the GUI's bridge turns the callback into queued
signals, the server into asyncio queues.

Generations run together: each joins the loaded model's scheduler between two steps, up to the
load's `max_batch` at once, the rest waiting their turn (past `max_queue` waiting, `generate`
raises QueueFull). Load, unload and atlas requests wait until the generations before them end, and
the generations after them wait for them: requests take effect in the order they were made.

Live settings (memory budget, prefetch depth, reader threads, context length) never wait in the
queue behind a generation: they go into a pending slot that the engine thread applies between
two steps (or at once when idle). Cancelling sets the request's flag, which the engine checks at
every step, prefill chunk or loaded layer.

Each loaded model gets its own `Telemetry`; `subscribe` hands out subscriptions that survive
model changes, so a view subscribes once and keeps receiving snapshots of whatever is loaded.

This module is the public facade (it satisfies `app.service.protocol.Service`); what the engine
thread does with each request is in app/service/engine_thread.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from app.service.engine_thread import PROGRESS_INTERVAL, EngineThread, _Feed  # noqa: F401 - PROGRESS_INTERVAL re-exported
from app.service.loading import DEFAULT_CONTEXT  # noqa: F401 - re-exported
from app.service.messages import (  # noqa: F401 - re-exported: front ends import the messages from here
    TIER_CACHED,
    TIER_DISK,
    TIER_NONE,
    TIER_PINNED,
    TIER_RESIDENT,
    AtlasFailed,
    AtlasProgress,
    AtlasReady,
    AtlasRequest,
    ChatMessage,
    EngineSettings,
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
    _ApplySettings,
    _Shutdown,
    chat_message,
)
from engine.errors import ColibriError
from engine.generation.grammar import Grammar
from engine.generation.sampling import SamplingParams
from engine.telemetry import Snapshot, Subscription
from engine.tokenizer.reasoning import ReasoningFormat

log = logging.getLogger(__name__)


class QueueFull(ColibriError):
    """Too many generations are waiting; the caller should retry later."""


class EngineService(EngineThread):
    """Runs one model on its own thread; requests in, typed events out (see the module's header)."""

    def __init__(self, on_event: Callable[[ServiceEvent], None] | None = None, *, name: str = "colibri-engine",
                 max_queue: int | None = None):
        """`max_queue`: generations that may wait for room in the batch before `generate` raises QueueFull
        (None: no limit)."""
        if max_queue is not None and max_queue < 0:
            raise ValueError(f"max_queue {max_queue}: use 0 or more (None: no limit)")
        super().__init__(on_event, max_queue)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # --- any thread ----------------------------------------------------------------------------------

    def load(self, path: str | Path, options: LoadOptions = LoadOptions(),
             listener: Callable[[ServiceEvent], None] | None = None) -> int:
        """Open a model folder, container, .gguf file or pulled name (the current model is closed first)."""
        return self._put(lambda i: LoadRequest(i, str(path), options), listener)

    def load_and_wait(self, path: str | Path, options: LoadOptions = LoadOptions(),
                      timeout: float | None = None) -> ModelInfo:
        """Load and block until the model is ready; raises ColibriError with the load's message if it fails."""
        done = threading.Event()
        answer: list[ServiceEvent] = []

        def listen(event: ServiceEvent) -> None:
            if isinstance(event, (ModelLoaded, LoadFailed)):
                answer.append(event)
                done.set()

        request = self.load(path, options, listen)
        if not done.wait(timeout):
            self.cancel(request)
            raise ColibriError(f"loading {path} took longer than {timeout:.0f} s; it was cancelled")
        if isinstance(answer[0], LoadFailed):
            raise ColibriError(answer[0].message)
        return answer[0].info

    def unload(self) -> int:
        """Close the loaded model and free its memory."""
        return self._put(UnloadRequest)

    def generate(self, prompt: Sequence[int] | None = None, *, messages: Sequence[ChatMessage | Mapping] | None = None,
                 sampling: SamplingParams = SamplingParams(), max_tokens: int = 256, stop: Sequence[str] = (),
                 listener: Callable[[ServiceEvent], None] | None = None,
                 reasoning: ReasoningFormat | None = None, logprobs: int | None = None,
                 grammar: Grammar | None = None, speculative: bool | str | None = None) -> int:
        """Generate from token ids or chat messages; the events come back as `Generation` with this id (to
        `listener` too, on the engine thread, from before this returns). Raises QueueFull when `max_queue`
        generations already wait for room in the batch. A chat's answer comes with its reasoning apart when the
        model's template has a reasoning format; for token ids, `reasoning` (`ReasoningFormat.after` the prompt's
        text) asks for that split. A message's `reasoning_content` goes back to the template. With `logprobs`, each
        TokenEvent carries its token's log-probability and that many alternatives. With `grammar`
        (engine.generation.grammar), the answer is decoded to match it. `speculative` turns drafting on or off for
        this generation (None: as the load's options say; True: on, by the load's mode; "lookup" by prompt lookup,
        "mtp" by the model's MTP head); the answer is the same either way."""
        if (prompt is None) == (messages is None):
            raise ValueError("generate: give either prompt token ids or chat messages")
        msgs = None if messages is None else tuple(chat_message(m) for m in messages)
        ids = None if prompt is None else tuple(int(t) for t in prompt)
        with self._lock:
            waiting = self._generations - self._max_batch
            if self.max_queue is not None and waiting >= self.max_queue:
                raise QueueFull(f"{max(waiting, 0)} requests are already waiting (--max-queue {self.max_queue}); "
                                "retry shortly")
            self._generations += 1
        try:
            return self._put(lambda i: GenerateRequest(i, ids, msgs, sampling, int(max_tokens), tuple(stop), reasoning,
                                                       logprobs, grammar, speculative), listener)
        except BaseException:
            with self._lock:
                self._generations -= 1
            raise

    def compute_atlas(self) -> int:
        """Route the probe prompts through the loaded MoE and save its atlas sidecar beside it."""
        return self._put(AtlasRequest)

    def cancel(self, request: int | None = None) -> None:
        """Stop request `request` (running or queued); None stops every request made so far."""
        with self._lock:
            flags = list(self._flags.values()) if request is None else [self._flags.get(request)]
        for flag in flags:
            if flag is not None:
                flag.set()

    def update_settings(self, change: SettingsChange) -> int:
        """Apply live settings between tokens (at once when idle); answered by `SettingsApplied`."""
        with self._lock:
            i = next(self._ids)
            self._pending = change if self._pending is None else self._pending.merged(change)
            self._pending_id = i
        self._queue.put(_ApplySettings())
        return i

    def subscribe(self, callback: Callable[[Snapshot], None], min_interval: float = 0.0) -> Subscription:
        """Telemetry snapshots of the loaded model (and of every model loaded later), at most every min_interval s."""
        return self._subscribe(callback, min_interval, callback)

    def subscribe_tiers(self, callback: Callable[[Any], None], min_interval: float = 0.0) -> Subscription:
        """Each expert's tier as a read-only int8 grid [layers, experts] (TIER_* codes; None for a model without
        routed experts), delivered on the engine thread with the snapshots, at most every min_interval s."""
        return self._subscribe(callback, min_interval, lambda _snap: callback(self._tiers()))

    def subscribe_cache(self, callback: Callable[[Any], None], min_interval: float = 0.0) -> Subscription:
        """The expert cache's recent trace (`engine.offload.quality.CacheTrace`; None unless experts are streamed),
        delivered on the engine thread with the snapshots, at most every min_interval s."""
        return self._subscribe(callback, min_interval, lambda _snap: callback(self._cache_trace()))

    def subscribe_expert_counts(self, callback: Callable[[Any], None], min_interval: float = 0.0) -> Subscription:
        """Each streamed expert's counters (`engine.offload.story.ExpertCounts`; None unless experts are streamed),
        delivered on the engine thread with the snapshots, at most every min_interval s."""
        return self._subscribe(callback, min_interval, lambda _snap: callback(self._expert_counts()))

    def tiers(self):
        """The expert tiers as the engine last published them (after loading, each settings change and
        generation, and with every tiers subscription's delivery); None without routed experts."""
        return self._last_tiers

    def snapshot(self) -> Snapshot | None:
        """The loaded model's latest telemetry snapshot, or None without a model."""
        with self._lock:
            tel = self._telemetry
        return tel.snapshot() if tel is not None else None

    @property
    def info(self) -> ModelInfo | None:
        """The loaded model as of its last load or settings change."""
        return self._info

    @property
    def tokenizer(self):
        """The loaded model's tokenizer (None without a model or tokenizer); encoding is safe from any thread."""
        model = self._model
        return model.loaded.tokenizer if model is not None else None

    @property
    def queue_depth(self) -> int:
        """Generations waiting for room in the batch."""
        return self._waiting()

    @property
    def batch(self) -> int:
        """Generations in the batch now."""
        return self._batch

    def kv_usage(self) -> tuple[int, int]:
        """(bytes of KV blocks in use or cached, blocks held by running generations) of the loaded model."""
        model = self._model
        pool = model.pool if model is not None else None
        return (pool.nbytes, pool.used_blocks) if pool is not None else (0, 0)

    @property
    def running(self) -> bool:
        """Whether the engine thread is alive."""
        return self._thread.is_alive()

    def close(self, timeout: float = 60.0) -> None:
        """Stop what runs, close the model (saving its usage history) and end the thread; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.cancel()
        self._queue.put(_Shutdown())
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine thread did not stop within %.0f s", timeout)

    def __enter__(self) -> EngineService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _put(self, make: Callable[[int], Request], listener: Callable[[ServiceEvent], None] | None = None) -> int:
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine service is closed")
            i = next(self._ids)
            self._flags[i] = threading.Event()
            if listener is not None:
                self._listeners[i] = listener
        self._queue.put(make(i))
        return i

    def _subscribe(self, callback: Callable[[Any], None], min_interval: float,
                   deliver: Callable[[Snapshot], None]) -> Subscription:
        """A subscription fed by every model loaded from now on through `deliver`."""
        sub = Subscription(callback, min_interval, on_close=self._unsubscribe)
        feed = _Feed(deliver, min_interval)
        with self._lock:
            self._feeds[sub] = feed
            if self._telemetry is not None:
                feed.inner = self._telemetry.subscribe(deliver, min_interval)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        """Stop feeding `sub` (waits for a delivery running on the engine thread)."""
        with self._lock:
            feed = self._feeds.pop(sub, None)
            inner = feed.inner if feed is not None else None
            if feed is not None:
                feed.inner = None
        if inner is not None:
            inner.close()
