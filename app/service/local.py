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
"""

from __future__ import annotations

import argparse
import itertools
import logging
from collections import deque
import queue
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.service.messages import (  # noqa: F401 - re-exported: front ends import the messages from here
    TIER_CACHED, TIER_DISK, TIER_NONE, TIER_PINNED, TIER_RESIDENT, AtlasFailed, AtlasProgress, AtlasReady,
    AtlasRequest, ChatMessage, EngineSettings, GenerateRequest, Generation, LoadFailed, LoadOptions, LoadProgress,
    LoadRequest, ModelInfo, ModelLoaded, ModelUnloaded, Request, ServiceEvent, SettingsApplied, SettingsChange,
    UnloadRequest, _ApplySettings, _Shutdown,
)
from app.service.model import ALL, Engaged, available_memory, full_budget, n_experts, peek_spec, read_atlas, rss
from app.service.subscription import Subscription
from engine.errors import ColibriError
from engine.events import DoneEvent, ErrorEvent, Event, GenerationStats, TokenEvent
from engine.generation.sampling import SamplingParams
from engine.telemetry import Snapshot, Telemetry

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 4096      # context length when the options name none (capped by the model's own limit)
PROGRESS_INTERVAL = 0.05    # seconds between load/atlas progress events (the last one always goes out)


class QueueFull(ColibriError):
    """Too many generations are waiting; the caller should retry later."""


@dataclass(eq=False)
class _Running:
    """A generation inside the scheduler (engine thread only)."""

    request: int
    t0: float
    first: bool = True


class EngineService:
    """Runs one model on its own thread; requests in, typed events out (see the module's header)."""

    def __init__(self, on_event: Callable[[ServiceEvent], None] | None = None, *, name: str = "colibri-engine",
                 max_queue: int | None = None):
        """`max_queue`: generations that may wait for room in the batch before `generate` raises QueueFull
        (None: no limit)."""
        if max_queue is not None and max_queue < 0:
            raise ValueError(f"max_queue {max_queue}: use 0 or more (None: no limit)")
        self._on_event = on_event
        self.max_queue = max_queue
        self._queue: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()           # guards the fields below that other threads touch
        self._subs: list[Subscription] = []
        self._telemetry: Telemetry | None = None
        self._pending: SettingsChange | None = None
        self._pending_id = 0
        self._flags: dict[int, threading.Event] = {}    # request id -> its cancel flag, until it is answered
        self._listeners: dict[int, Callable[[ServiceEvent], None]] = {}
        self._generations = 0                   # generate requests not yet answered by their last event
        self._batch = 0                         # generations in the scheduler's batch now
        self._max_batch = LoadOptions().max_batch
        self._info: ModelInfo | None = None
        self._last_tiers = None                 # see tiers()
        self._closed = False
        self._model: Engaged | None = None      # engine thread only, like the two below
        self._backlog: deque[Request] = deque()  # requests taken from the queue that wait for the batch to end
        self._live: dict[int, _Running] = {}    # scheduler sequence id -> its generation
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
                 listener: Callable[[ServiceEvent], None] | None = None) -> int:
        """Generate from token ids or chat messages; the events come back as `Generation` with this id (to
        `listener` too, on the engine thread, from before this returns). Raises QueueFull when `max_queue`
        generations already wait for room in the batch."""
        if (prompt is None) == (messages is None):
            raise ValueError("generate: give either prompt token ids or chat messages")
        msgs = None if messages is None else tuple(
            m if isinstance(m, ChatMessage) else ChatMessage(str(m["role"]), str(m["content"])) for m in messages)
        ids = None if prompt is None else tuple(int(t) for t in prompt)
        with self._lock:
            waiting = self._generations - self._max_batch
            if self.max_queue is not None and waiting >= self.max_queue:
                raise QueueFull(f"{max(waiting, 0)} requests are already waiting (--max-queue {self.max_queue}); "
                                "retry shortly")
            self._generations += 1
        try:
            return self._put(lambda i: GenerateRequest(i, ids, msgs, sampling, int(max_tokens), tuple(stop)), listener)
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
        sub = Subscription(self, callback, min_interval)
        with self._lock:
            self._subs.append(sub)
            sub._attach(self._telemetry)
        return sub

    def subscribe_tiers(self, callback: Callable[[Any], None], min_interval: float = 0.0) -> Subscription:
        """Each expert's tier as a read-only int8 grid [layers, experts] (TIER_* codes; None for a model without
        routed experts), delivered on the engine thread with the snapshots, at most every min_interval s."""
        sub = Subscription(self, callback, min_interval, deliver=lambda _snap: callback(self._tiers()))
        with self._lock:
            self._subs.append(sub)
            sub._attach(self._telemetry)
        return sub

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
        with self._lock:
            return max(self._generations - self._batch, 0)

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

    # --- engine thread -----------------------------------------------------------------------------

    def _emit(self, event: ServiceEvent) -> None:
        listener = self._listeners.get(getattr(event, "request", None))
        for call in (self._on_event, listener):
            if call is None:
                continue
            try:
                call(event)
            except Exception:  # a broken listener must not stop the engine
                log.exception("engine service listener failed on %s", type(event).__name__)

    def _answered(self, request: int) -> None:
        """Request `request` sent its last event: forget its flag and listener."""
        with self._lock:
            self._flags.pop(request, None)
            self._listeners.pop(request, None)

    def _loop(self) -> None:
        from app.config.settings import use_process_threads

        use_process_threads()          # numba's thread count is per thread: take the one --threads chose
        try:
            while True:
                if self._live:
                    self._intake()
                    self._step()
                    continue
                req = self._backlog.popleft() if self._backlog else self._queue.get()
                if isinstance(req, _Shutdown):
                    break
                try:
                    self._handle(req)
                except Exception as exc:  # noqa: BLE001 - the thread outlives any request
                    log.error("engine request %r failed:\n%s", req, traceback.format_exc())
                    self._fail(req, f"internal error: {type(exc).__name__}: {exc}")
                finally:
                    if not isinstance(req, (GenerateRequest, _ApplySettings)):
                        self._answered(req.id)
        finally:
            self._end_generations("the engine stopped")
            self._close_model()

    def _intake(self) -> None:
        """Between two steps: start the generations that came in, apply settings, and hold back the rest
        (and every request after it) until the batch has ended."""
        while True:
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(req, _ApplySettings):
                self._apply_pending()
            elif isinstance(req, GenerateRequest) and not self._backlog:
                self._start(req)
            else:
                self._backlog.append(req)

    def _handle(self, req: Request) -> None:
        if isinstance(req, _ApplySettings):
            self._apply_pending()
            return
        if isinstance(req, GenerateRequest):
            self._start(req)
            return
        cancel = self._flags.get(req.id) or threading.Event()
        if isinstance(req, LoadRequest):
            self._load(req, cancel)
        elif isinstance(req, UnloadRequest):
            self._close_model()
            self._emit(ModelUnloaded(req.id))
        elif isinstance(req, AtlasRequest):
            self._atlas(req, cancel)

    def _fail(self, req: Request, message: str) -> None:
        """Answer a request that raised, so that no front end waits for it forever."""
        if isinstance(req, LoadRequest):
            self._close_model()
            self._emit(LoadFailed(req.id, message))
        elif isinstance(req, GenerateRequest):
            self._answer(req.id, ErrorEvent(message))
        elif isinstance(req, AtlasRequest):
            self._emit(AtlasFailed(req.id, message))
        elif isinstance(req, _ApplySettings):
            self._emit(SettingsApplied(self._pending_id, self._info, (message,)))

    # --- loading ---

    def _load(self, req: LoadRequest, cancel: threading.Event) -> None:
        from engine.loader import LoadCancelled, load_model

        self._close_model()   # first: memory is what this engine is short of
        last = [0.0]

        def progress(fraction: float, message: str) -> bool:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_INTERVAL or fraction >= 1.0:
                last[0] = now
                self._emit(LoadProgress(req.id, fraction, message))
            return not cancel.is_set()

        try:
            if cancel.is_set():
                raise LoadCancelled("loading cancelled")
            progress(0.0, f"opening {Path(req.path).name}")
            path, spec, container, offload, budget, ctx = self._plan_load(req.path, req.options)
            telemetry = Telemetry(spec.n_layers, n_experts(spec))
            baseline = rss()     # the interpreter and libraries: outside the budget, reported apart
            loaded = load_model(path, progress, offload, telemetry)
        except LoadCancelled:
            self._emit(LoadFailed(req.id, f"loading {Path(req.path).name} was cancelled", cancelled=True))
            return
        except (ColibriError, OSError, ValueError) as exc:
            self._emit(LoadFailed(req.id, _message(exc)))
            return
        settings = EngineSettings(budget, req.options.prefetch_depth if offload is not None else 0,
                                  req.options.io_threads, ctx)
        model = Engaged.open(loaded, telemetry, settings, req.options)
        self._model = model
        with self._lock:
            self._telemetry = telemetry
            for sub in self._subs:
                sub._attach(telemetry)
        self._info = model.info
        with self._lock:
            self._max_batch = req.options.max_batch
        if baseline is not None:
            telemetry.set_gauge("rss_baseline", baseline)
        model.set_gauges()
        self._tiers()
        telemetry.flush()
        self._emit(ModelLoaded(req.id, model.info, read_atlas(path)))

    def _plan_load(self, model: str, options: LoadOptions):
        """(path, spec, container or None, OffloadOptions or None, budget or None, context length) for a load."""
        from app.hub.pull import resolve_model
        from app.service.loading import offload_options
        from engine.formats.container import is_container
        from engine.loader import open_checkpoint
        from engine.offload.budget import plan_memory

        path = resolve_model(model)
        container = None
        if path.is_dir() and is_container(path):
            ckpt = open_checkpoint(path, verify=False, verify_experts=False)
            spec, container = ckpt.spec, ckpt.source
        else:
            spec = peek_spec(path)
        ctx = options.context_length or min(spec.max_position, DEFAULT_CONTEXT)
        if not 1 <= ctx <= spec.max_position:
            raise ColibriError(f"context length {ctx}: the model supports 1 to {spec.max_position} tokens")
        budget = options.max_memory
        wants = options.stream if options.stream is not None else (container is not None and n_experts(spec) > 0)
        if budget is None and wants and container is not None:
            full = full_budget(plan_memory(container, spec, ALL, ctx, options.prefetch_depth))
            least = plan_memory(container, spec, full, ctx, options.prefetch_depth).minimum
            avail = available_memory()
            budget = full if avail is None else max(least, min(full, int(avail * 0.75)))
        if budget is None:
            if options.stream:
                raise ColibriError(f"{path.name}: streaming needs a memory budget (max_memory)")
            return path, spec, container, None, None, ctx
        args = argparse.Namespace(max_memory=f"{budget}b", io=options.io, io_threads=options.io_threads,
                                  prefetch_depth=options.prefetch_depth, cache_policy=options.cache_policy,
                                  resident_layers=options.resident_layers, no_history=not options.history, ctx=ctx)
        return path, spec, container, offload_options(args, path, quiet=True), budget, ctx

    def _close_model(self) -> None:
        model, self._model = self._model, None
        with self._lock:
            self._telemetry = None
            for sub in self._subs:
                sub._attach(None)
        self._info = self._last_tiers = None
        if model is not None:
            try:
                model.loaded.close()
            except Exception:  # noqa: BLE001 - a failed history save must not keep the model alive
                log.exception("closing %s failed", model.info.name)

    # --- generation ---

    def _answer(self, request: int, event: Event) -> None:
        """The last event of a generation that never reached the scheduler."""
        with self._lock:
            self._generations -= 1
        self._emit(Generation(request, event))
        self._answered(request)

    def _start(self, req: GenerateRequest) -> None:
        """Put a generation into the scheduler's batch (it runs from the next step)."""
        from engine.generation.generate import GenerationRequest

        cancel = self._flags.get(req.id) or threading.Event()
        model = self._model
        if cancel.is_set():
            self._answer(req.id, DoneEvent("cancelled", (), "", GenerationStats(0, 0, 0.0, 0.0, 0.0)))
            return
        if model is None:
            self._answer(req.id, ErrorEvent("no model is loaded: open one first"))
            return
        try:
            prompt = req.prompt if req.prompt is not None else tuple(self._chat_prompt(model.loaded, req.messages))
            sched = model.batcher()
        except ColibriError as exc:
            self._answer(req.id, ErrorEvent(_message(exc)))
            return
        request = GenerationRequest(prompt=prompt, max_tokens=req.max_tokens, sampling=req.sampling, stop=req.stop)
        if not self._live:
            model.telemetry.begin()
        seq = sched.submit(request, cancel)
        self._live[seq.id] = _Running(req.id, time.perf_counter())
        self._deliver(seq)

    def _step(self) -> None:
        """One step of the batch, its events out, then what may happen between two tokens."""
        model = self._model
        sched, tel = model.scheduler, model.telemetry
        try:
            touched = sched.step()
        except Exception as exc:  # noqa: BLE001 - a fault fails the batch's requests, not the service
            log.error("a generation step failed:\n%s", traceback.format_exc())
            touched = sched.abort(f"internal error while generating: {type(exc).__name__}: {exc}")
        for seq in touched:
            self._deliver(seq)
        self._batch = len(sched.running)
        # between two tokens: the only moment settings may change under a running generation
        if self._pending is not None:
            self._apply_pending()
        tel.set_gauge("kv_bytes", model.pool.nbytes)
        tel.set_gauge("queue_depth", self.queue_depth)
        tel.set_gauge("running", self._batch)
        model.gauge_rss()
        if not self._live:
            self._tiers()
            tel.flush()
        time.sleep(0)   # numba kernels hold the GIL: hand it to the UI thread once per token

    def _deliver(self, seq) -> None:
        live = self._live.get(seq.id)
        if live is None:
            return
        tel = self._model.telemetry
        for event in seq.drain():
            if live.first and isinstance(event, TokenEvent):
                live.first = False
                tel.set_gauge("ttft", time.perf_counter() - live.t0)
            elif isinstance(event, DoneEvent) and event.stats.generated_tokens:
                tel.set_gauge("ttft", event.stats.ttft_s)
            self._emit(Generation(live.request, event))
        if seq.done:
            del self._live[seq.id]
            with self._lock:
                self._generations -= 1
            self._answered(live.request)

    def _end_generations(self, message: str) -> None:
        """Answer every generation still held (the engine is stopping)."""
        model = self._model
        if model is not None and model.scheduler is not None:
            for seq in model.scheduler.abort(message):
                self._deliver(seq)
        for req in self._backlog:
            if isinstance(req, GenerateRequest):
                self._answer(req.id, ErrorEvent(message))

    @staticmethod
    def _chat_prompt(loaded, messages: tuple[ChatMessage, ...]) -> list[int]:
        if loaded.tokenizer is None or not loaded.tokenizer.has_chat_template:
            raise ColibriError(f"{loaded.name} has no chat template, so it cannot chat; "
                               "send token ids, or open an instruction-tuned model")
        return loaded.tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in messages],
                                            add_generation_prompt=True)

    # --- live settings ---

    def _apply_pending(self) -> None:
        with self._lock:
            change, self._pending = self._pending, None
            request = self._pending_id
        if change is None:
            return
        model = self._model
        if model is None:
            self._emit(SettingsApplied(request, None, ("no model is loaded: the settings apply to a loaded model",)))
            return
        problems = model.apply(change)
        self._info = model.info
        model.set_gauges()
        self._tiers()
        model.telemetry.flush()
        self._emit(SettingsApplied(request, model.info, tuple(problems)))

    def _tiers(self):
        """The loaded model's expert tiers now (engine thread: the store is touched nowhere else); kept for
        `tiers()` callers on other threads."""
        model = self._model
        self._last_tiers = model.tiers() if model is not None else None
        return self._last_tiers

    # --- the atlas ---

    def _atlas(self, req: AtlasRequest, cancel: threading.Event) -> None:
        from app.atlas.build import AtlasCancelled, write_atomic, build_atlas, default_sidecar, model_hash, route_probes
        from app.atlas.probes import load_probes

        model = self._model
        if model is None:
            self._emit(AtlasFailed(req.id, "no model is loaded: open a Mixture-of-Experts model first"))
            return
        last = [0.0]

        def progress(fraction: float, message: str) -> bool:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_INTERVAL or fraction >= 1.0:
                last[0] = now
                self._emit(AtlasProgress(req.id, fraction, message))
            return not cancel.is_set()

        path = model.info.path
        try:
            if cancel.is_set():
                raise AtlasCancelled("atlas cancelled")
            topics = load_probes(None)
            model.telemetry.begin()
            counts, tokens = route_probes(model.loaded, topics, progress, 0.0, 0.95)
            atlas = build_atlas(path, topics, counts, tokens, model_hash(path), "assets/probes")
            sidecar = default_sidecar(path)
            write_atomic(sidecar, atlas)
        except AtlasCancelled:
            self._emit(AtlasFailed(req.id, "the atlas was cancelled; nothing was written", cancelled=True))
            return
        except (ColibriError, OSError) as exc:
            self._emit(AtlasFailed(req.id, _message(exc)))
            return
        finally:
            model.telemetry.flush()
        self._emit(AtlasProgress(req.id, 1.0, "done"))
        self._emit(AtlasReady(req.id, sidecar, atlas))


def _message(exc: BaseException) -> str:
    """A user-facing message: a ColibriError's own words, anything else with its kind."""
    if isinstance(exc, ColibriError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
