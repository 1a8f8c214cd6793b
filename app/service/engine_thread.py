"""The engine thread of the engine service (app/service/local.py): the state it shares with the public
facade, and the handling of every request it takes off the queue.

Load, unload and atlas requests run one at a time; generations join the loaded model's scheduler
between two steps and run together, and whatever comes after a request that must wait for the batch
to end waits behind it, so that requests take effect in the order they were made. Live settings are
applied between two steps. Each loaded model gets its own `Telemetry`; the service's subscriptions
follow whatever model is loaded.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from app.service.messages import (
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
)
from app.service.model import Engaged, available_memory, n_experts, peek_spec, read_atlas, rss
from engine.errors import ColibriError
from engine.events import DoneEvent, ErrorEvent, Event, GenerationStats, TokenEvent
from engine.telemetry import Snapshot, Subscription, Telemetry

log = logging.getLogger(__name__)

PROGRESS_INTERVAL = 0.05    # seconds between load/atlas progress events (the last one always goes out)


@dataclass(eq=False)
class _Running:
    """A generation inside the scheduler (engine thread only)."""

    request: int
    t0: float
    first: bool = True


@dataclass(eq=False)
class _Feed:
    """A service subscription's source: what the loaded model's telemetry calls, and its subscription there."""

    deliver: Callable[[Snapshot], None]
    min_interval: float
    inner: Subscription | None = None       # on the current model's Telemetry (None: no model)


class EngineThread:
    """The engine thread's half of `EngineService` (see the module's header); the facade adds the public calls."""

    def __init__(self, on_event: Callable[[ServiceEvent], None] | None, max_queue: int | None):
        self._on_event = on_event
        self.max_queue = max_queue
        self._queue: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()           # guards the fields below that other threads touch
        self._feeds: dict[Subscription, _Feed] = {}
        self._telemetry: Telemetry | None = None
        self._pending: SettingsChange | None = None
        self._pending_id = 0
        self._flags: dict[int, threading.Event] = {}    # request id -> its cancel flag, until it is answered
        self._listeners: dict[int, Callable[[ServiceEvent], None]] = {}
        self._generations = 0                   # generate requests not yet answered by their last event
        self._batch = 0                         # generations in the scheduler's batch now
        self._max_batch = LoadOptions().max_batch
        self._info: ModelInfo | None = None
        self._last_tiers = None                 # see EngineService.tiers()
        self._closed = False
        self._model: Engaged | None = None      # engine thread only, like the two below
        self._baseline: int | None = None       # RSS before the model in use loaded (what closing it gives back)
        self._loaded_by: LoadRequest | None = None   # the request that loaded it (to open it again)
        self._backlog: deque[Request] = deque()  # requests taken from the queue that wait for the batch to end
        self._live: dict[int, _Running] = {}    # scheduler sequence id -> its generation

    def _waiting(self) -> int:
        """Generations waiting for room in the batch."""
        with self._lock:
            return max(self._generations - self._batch, 0)

    def _follow(self, telemetry: Telemetry | None) -> None:
        """Feed every subscription from `telemetry` (None: no model); the caller holds the lock."""
        for feed in self._feeds.values():
            if feed.inner is not None:
                feed.inner.close()
            feed.inner = telemetry.subscribe(feed.deliver, feed.min_interval) if telemetry is not None else None

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
                except Exception as exc:  # the thread outlives any request
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
        if self._backlog:
            self._drop_cancelled()

    def _drop_cancelled(self) -> None:
        """Answer the generations held back in the backlog whose cancel flag is set: they stop counting against
        `max_queue` now, not once the batch has ended (the scheduler does the same for those waiting in it)."""
        for req in [r for r in self._backlog if isinstance(r, GenerateRequest)]:
            flag = self._flags.get(req.id)
            if flag is not None and flag.is_set():
                self._backlog.remove(req)
                self._answer(req.id, DoneEvent("cancelled", (), "", GenerationStats(0, 0, 0.0, 0.0, 0.0)))

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
        """Plan the load (files read, budget chosen, a GGUF to stream converted) with the model in use still
        loaded, so that a model that cannot open leaves it as it was; then close it (memory is what this engine is
        short of) and load. A load that fails after that (a file unreadable or corrupt past its header) opens the
        model that was in use again, with its live settings, and says it is still loaded."""
        from engine.loader import LoadCancelled

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
            plan = self._plan_load(req.path, req.options, progress)
        except (ColibriError, OSError, ValueError) as exc:
            self._emit(_load_failed(req, exc, kept=self._info))
            return
        before, live = self._loaded_by, self._info.settings if self._info is not None else None
        self._close_model()
        try:
            if cancel.is_set():
                raise LoadCancelled("loading cancelled")
            self._open(req, plan, progress)
        except (ColibriError, OSError, ValueError) as exc:
            self._emit(_load_failed(req, exc, kept=self._reopen(before, live, exc)))
            return
        self._emit(ModelLoaded(req.id, self._info, read_atlas(plan.path)))

    def _reopen(self, req: LoadRequest | None, live: EngineSettings | None, why: BaseException) -> ModelInfo | None:
        """After a load failed past closing the model in use: that model opened again (by its own request, then
        its live settings), or None when there was none or it cannot open either."""
        if req is None:
            return None
        try:
            self._open(req, self._plan_load(req.path, req.options, lambda fraction, message: True), None)
        except (ColibriError, OSError, ValueError):
            log.exception("%s could not be opened again after another model failed to load (%s)", req.path, why)
            self._close_model()
            return None
        if live is not None and self._model is not None:
            self._apply(self._model, SettingsChange(live.memory_budget, live.prefetch_depth, live.io_threads,
                                                    live.context_length))
        return self._info

    def _open(self, req: LoadRequest, plan, progress: Callable[[float, str], bool] | None) -> None:
        """Load the planned model and make it the one in use (raises what loading raises)."""
        from engine.loader import load_model

        if req.options.threads is not None:     # numba's count is per thread: this one runs the model
            from app.config.settings import apply_threads

            apply_threads(req.options.threads, "the app's compute threads setting")
        telemetry = Telemetry(plan.spec.n_layers, n_experts(plan.spec))
        baseline = rss()     # the interpreter and libraries: outside the budget, reported apart
        loaded = load_model(plan.path, progress, plan.offload, telemetry)
        settings = EngineSettings(plan.budget, req.options.prefetch_depth if plan.offload is not None else 0,
                                  req.options.io_threads, plan.context_length)
        model = Engaged.open(loaded, telemetry, settings, req.options)
        self._model, self._baseline, self._loaded_by = model, baseline, req
        with self._lock:
            self._telemetry = telemetry
            self._follow(telemetry)
        self._info = model.info
        with self._lock:
            self._max_batch = req.options.max_batch
        if baseline is not None:
            telemetry.set_gauge("rss_baseline", baseline)
        model.set_gauges()
        self._tiers()
        telemetry.flush()

    def _plan_load(self, model: str, options: LoadOptions, progress: Callable[[float, str], bool]):
        """The LoadPlan of a load: the container's spec and manifest are read, the budget chosen from free memory.

        A GGUF file to stream (a budget, or offload asked for) is converted once, as published, into a container
        (app/hub/gguf_cache.py), its progress reported through `progress` (False: cancelled)."""
        from app.config.paths import usage_dir
        from app.hub.gguf_cache import container_for, is_gguf
        from app.hub.progress import HubEvent, Progress
        from app.hub.pull import resolve_model
        from app.service.loading import plan_load
        from engine.formats.container import is_container
        from engine.loader import LoadCancelled, open_checkpoint

        path = resolve_model(model)
        if is_gguf(path) and (options.max_memory is not None or options.offload):
            last = [0.0]

            def report(event: HubEvent) -> None:
                if isinstance(event, Progress):
                    last[0] = event.fraction
                if not progress(last[0], event.message):
                    raise LoadCancelled("loading cancelled")    # the conversion resumes at the next load

            path = container_for(path, report)
        container = None
        if path.is_dir() and is_container(path):
            ckpt = open_checkpoint(path, verify=False, verify_experts=False)
            spec, container = ckpt.spec, ckpt.source
        else:
            spec = peek_spec(path)
        # exact KV rows in the budget's split, as the live settings (app.service.model) divide it again
        available = available_memory()
        if available is not None and self._model is not None and self._baseline is not None:
            now = rss()    # the model in use is closed before this one loads: its memory counts as free
            available += max(now - self._baseline, 0) if now is not None else 0
        return plan_load(replace(options, kv_bits=32), path, spec, container, available=available,
                         history_dir=usage_dir() if options.history else None)

    def _close_model(self) -> None:
        model, self._model, self._loaded_by = self._model, None, None
        with self._lock:
            self._telemetry = None
            self._follow(None)
        self._info = self._last_tiers = None
        if model is not None:
            try:
                model.loaded.close()
            except Exception:  # a failed history save must not keep the model alive
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
            prompt, reasoning = (req.prompt, req.reasoning) if req.prompt is not None else \
                self._chat_prompt(model.loaded, req.messages)
            sched = model.batcher()
            speculative = model.speculation(req.speculative)
        except ColibriError as exc:
            self._answer(req.id, ErrorEvent(_message(exc)))
            return
        request = GenerationRequest(prompt=prompt, max_tokens=req.max_tokens, sampling=req.sampling, stop=req.stop,
                                    reasoning=reasoning, logprobs=req.logprobs, grammar=req.grammar,
                                    speculative=speculative)
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
        except Exception as exc:  # a fault fails the batch's requests, not the service
            log.error("a generation step failed:\n%s", traceback.format_exc())
            touched = sched.abort(f"internal error while generating: {type(exc).__name__}: {exc}")
        for seq in touched:
            self._deliver(seq)
        self._batch = len(sched.running)
        # between two tokens: the only moment settings may change under a running generation
        if self._pending is not None:
            self._apply_pending()
        model.gauge_kv()
        d = sched.drafting      # the drafting counters of the answers that have ended
        if d.sequences:
            tel.set_gauge("draft_tokens", d.drafted)
            tel.set_gauge("draft_accepted", d.accepted)
        tel.set_gauge("queue_depth", self._waiting())
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
    def _chat_prompt(loaded, messages: tuple[ChatMessage, ...]):
        """The prompt ids of a conversation and the reasoning format its answer is split with (None: none)."""
        tokenizer = loaded.tokenizer
        if tokenizer is None or not tokenizer.has_chat_template:
            raise ColibriError(f"{loaded.name} has no chat template, so it cannot chat; "
                               "send token ids, or open an instruction-tuned model")
        chat = [{"role": m.role, "content": m.content, "reasoning_content": m.reasoning or None} for m in messages]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        fmt = tokenizer.reasoning_format
        return tuple(tokenizer.encode(text, add_special_tokens=False)), fmt.after(text) if fmt is not None else None

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
        problems = self._apply(model, change)
        self._emit(SettingsApplied(request, model.info, tuple(problems)))

    def _apply(self, model: Engaged, change: SettingsChange) -> list[str]:
        """Apply live settings to the model in use and publish its new state; why any could not be applied."""
        problems = model.apply(change)
        self._info = model.info
        model.set_gauges()
        self._tiers()
        model.telemetry.flush()
        return problems

    def _tiers(self):
        """The loaded model's expert tiers now (engine thread: the store is touched nowhere else); kept for
        `tiers()` callers on other threads."""
        model = self._model
        self._last_tiers = model.tiers() if model is not None else None
        return self._last_tiers

    def _cache_trace(self):
        """The loaded model's expert cache trace now (engine thread, as `_tiers`); None unless experts stream."""
        model = self._model
        return model.cache_trace() if model is not None else None

    def _expert_counts(self):
        """The loaded model's per-expert cache counters now (engine thread, as `_tiers`); None unless experts stream."""
        model = self._model
        return model.expert_counts() if model is not None else None

    # --- the atlas ---

    def _atlas(self, req: AtlasRequest, cancel: threading.Event) -> None:
        from app.atlas.build import AtlasCancelled, build_atlas, default_sidecar, model_hash, route_probes, write_atomic
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



def _load_failed(req: LoadRequest, exc: BaseException, kept: ModelInfo | None = None) -> LoadFailed:
    """What a load that raised EXC answers (a cancel said as such); KEPT: the model still loaded."""
    from engine.loader import LoadCancelled

    if isinstance(exc, LoadCancelled):
        return LoadFailed(req.id, f"loading {Path(req.path).name} was cancelled", cancelled=True, kept=kept)
    return LoadFailed(req.id, _message(exc), kept=kept)


def _message(exc: BaseException) -> str:
    """A user-facing message: a ColibriError's own words, anything else with its kind."""
    if isinstance(exc, ColibriError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
