"""Subscriptions to the engine service's telemetry that outlive a model (app/service/local.py hands them out)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.telemetry import Snapshot, Telemetry

if TYPE_CHECKING:
    from app.service.local import EngineService


class Subscription:
    """Telemetry snapshots of whatever model is loaded, delivered on the engine thread; `close` stops them."""

    def __init__(self, service: EngineService, callback: Callable[[Snapshot], None], min_interval: float,
                 deliver: Callable[[Snapshot], None] | None = None):
        self.callback = callback
        self.min_interval = min_interval
        self._deliver = deliver or callback   # what the telemetry calls (the callback, or a wrapper of it)
        self._service = service
        self._inner = None                  # engine.telemetry.Subscription of the current model
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._closed

    def close(self) -> None:
        """Stop deliveries (waits for a callback running on the engine thread); idempotent."""
        with self._service._lock:
            if self._closed:
                return
            self._closed = True
            self._service._subs.remove(self)
            inner, self._inner = self._inner, None
        if inner is not None:
            inner.close()

    def _attach(self, telemetry: Telemetry | None) -> None:
        """Follow `telemetry` (None: no model); the caller holds the service's lock."""
        if self._inner is not None:
            self._inner.close()
            self._inner = None
        if telemetry is not None and not self._closed:
            self._inner = telemetry.subscribe(self._deliver, self.min_interval)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
