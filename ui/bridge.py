"""The bridge between the engine service and the Qt views: service events and telemetry snapshots
(delivered on the engine thread) become queued signals handled on the main thread.

The bridge owns the service: views send requests through `bridge.service` and never touch the
engine. The service is a local `EngineService` unless a factory makes another `app.service.protocol.Service`
(`app.service.remote.RemoteService`: a Colibri server on another machine). Snapshots arrive at
most SNAPSHOT_HZ times a second; views store them and redraw on their own timers, so a fast model
never makes the UI paint once per token.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, Qt, Signal

from app.service.local import (
    AtlasFailed,
    AtlasProgress,
    AtlasReady,
    EngineService,
    Generation,
    LoadFailed,
    LoadProgress,
    ModelLoaded,
    ModelUnloaded,
    ServiceEvent,
    SettingsApplied,
)
from app.service.protocol import Service
from app.service.remote import ConnectionChanged, RemoteService

ServiceFactory = Callable[[Callable[[ServiceEvent], None]], Service]   # on_event -> EngineService or RemoteService

SNAPSHOT_HZ = 30    # at most this many telemetry snapshots a second reach the views
CACHE_HZ = 1        # at most this many expert cache traces a second (the meter replays them for seconds)


class Bridge(QObject):
    """Service events as typed Qt signals on the main thread; `close` stops the engine thread."""

    loadProgress = Signal(int, float, str)      # request, fraction, message
    modelLoaded = Signal(object)                # app.service.local.ModelLoaded
    loadFailed = Signal(object)                 # app.service.local.LoadFailed
    modelUnloaded = Signal(int)                 # request
    generation = Signal(int, object)            # request, engine event (TokenEvent, DoneEvent, ...)
    settingsApplied = Signal(object)            # app.service.local.SettingsApplied
    atlasProgress = Signal(int, float, str)
    atlasReady = Signal(object)                 # app.service.local.AtlasReady
    atlasFailed = Signal(object)                # app.service.local.AtlasFailed
    snapshot = Signal(object)                   # engine.telemetry.Snapshot
    tiers = Signal(object)                      # int8 [layers, experts] (app.service.local TIER_* codes) or None
    cacheTrace = Signal(object)                 # engine.offload.quality.CacheTrace or None (a local service only)
    expertCounts = Signal(object)               # engine.offload.story.ExpertCounts or None (a local service only)
    connection = Signal(object)                 # app.service.remote.ConnectionChanged (a remote service's telemetry stream)

    _event = Signal(object)                     # emitted on the engine thread, received on the main thread
    _snapshot = Signal(object)
    _tiers = Signal(object)
    _cache = Signal(object)
    _counts = Signal(object)

    def __init__(self, parent: QObject | None = None, service: ServiceFactory | None = None):
        super().__init__(parent)
        self._event.connect(self._dispatch, Qt.ConnectionType.QueuedConnection)
        self._snapshot.connect(self._deliver_snapshot, Qt.ConnectionType.QueuedConnection)
        self._tiers.connect(self._deliver_tiers, Qt.ConnectionType.QueuedConnection)
        self._cache.connect(self._deliver_cache, Qt.ConnectionType.QueuedConnection)
        self._counts.connect(self._deliver_counts, Qt.ConnectionType.QueuedConnection)
        make = service if service is not None else (lambda on_event: EngineService(on_event=on_event))
        self.service: Service = make(self._event.emit)
        self._subscriptions = (self.service.subscribe(self._snapshot.emit, 1.0 / SNAPSHOT_HZ),
                               self.service.subscribe_tiers(self._tiers.emit, 1.0 / SNAPSHOT_HZ))
        if isinstance(self.service, EngineService):     # a server sends no trace of its cache
            self._subscriptions += (self.service.subscribe_cache(self._cache.emit, 1.0 / CACHE_HZ),
                                    self.service.subscribe_expert_counts(self._counts.emit, 1.0 / CACHE_HZ))
        self._closed = False

    def close(self) -> None:
        """Stop snapshots and the engine thread (the model is closed and its usage history saved); idempotent."""
        if self._closed:
            return
        self._closed = True
        for sub in self._subscriptions:
            sub.close()
        self.service.close()

    @property
    def closed(self) -> bool:
        """Whether close() ran."""
        return self._closed

    @property
    def remote(self) -> RemoteService | None:
        """The remote service when the app watches a server on another machine, else None."""
        return self.service if isinstance(self.service, RemoteService) else None

    def _deliver_snapshot(self, snap: object) -> None:
        if not self._closed:
            self.snapshot.emit(snap)

    def _deliver_tiers(self, grid: object) -> None:
        if not self._closed:
            self.tiers.emit(grid)

    def _deliver_cache(self, trace: object) -> None:
        if not self._closed:
            self.cacheTrace.emit(trace)

    def _deliver_counts(self, counts: object) -> None:
        if not self._closed:
            self.expertCounts.emit(counts)

    def _dispatch(self, event: ServiceEvent) -> None:
        """Re-emit a service event as its typed signal (main thread)."""
        if self._closed:
            return
        if isinstance(event, Generation):
            self.generation.emit(event.request, event.event)
        elif isinstance(event, LoadProgress):
            self.loadProgress.emit(event.request, event.fraction, event.message)
        elif isinstance(event, ModelLoaded):
            self.modelLoaded.emit(event)
        elif isinstance(event, LoadFailed):
            self.loadFailed.emit(event)
        elif isinstance(event, ModelUnloaded):
            self.modelUnloaded.emit(event.request)
        elif isinstance(event, SettingsApplied):
            self.settingsApplied.emit(event)
        elif isinstance(event, AtlasProgress):
            self.atlasProgress.emit(event.request, event.fraction, event.message)
        elif isinstance(event, AtlasReady):
            self.atlasReady.emit(event)
        elif isinstance(event, AtlasFailed):
            self.atlasFailed.emit(event)
        elif isinstance(event, ConnectionChanged):
            self.connection.emit(event)
