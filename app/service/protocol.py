"""`Service`: what front ends (the desktop app, the HTTP server) use of an engine service. Both the local
`app.service.local.EngineService` and `app.service.remote.RemoteService` (a server on another machine) satisfy it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from app.service.messages import ChatMessage, LoadOptions, ModelInfo, SettingsChange
from engine.generation.grammar import Grammar
from engine.generation.sampling import SamplingParams
from engine.telemetry import Snapshot, Subscription


@runtime_checkable
class Service(Protocol):
    """Requests in (each returns its id), service events out through the `on_event` callback it was made with."""

    def load(self, path: str | Path, options: LoadOptions = LoadOptions()) -> int:
        """Open a model (a remote service connects to the served one)."""

    def unload(self) -> int:
        """Close the loaded model."""

    def generate(self, prompt: Sequence[int] | None = None, *, messages: Sequence[ChatMessage | Mapping] | None = None,
                 sampling: SamplingParams = SamplingParams(), max_tokens: int = 256, stop: Sequence[str] = (),
                 logprobs: int | None = None, grammar: Grammar | None = None) -> int:
        """Generate from token ids or chat messages; events come back as `Generation` with this id (with
        `logprobs`, scored tokens; with `grammar`, an answer matching it)."""

    def compute_atlas(self) -> int:
        """Compute the loaded model's atlas (answered by AtlasReady or AtlasFailed)."""

    def cancel(self, request: int | None = None) -> None:
        """Stop request `request`; None stops every request made so far."""

    def update_settings(self, change: SettingsChange) -> int:
        """Apply live settings between tokens; answered by `SettingsApplied`."""

    def subscribe(self, callback: Callable[[Snapshot], None], min_interval: float = 0.0) -> Subscription:
        """Telemetry snapshots of the loaded model, at most every min_interval s."""

    def subscribe_tiers(self, callback: Callable[[Any], None], min_interval: float = 0.0) -> Subscription:
        """Each expert's tier as a read-only int8 grid [layers, experts] (None without routed experts)."""

    def snapshot(self) -> Snapshot | None:
        """The latest telemetry snapshot, or None."""

    @property
    def info(self) -> ModelInfo | None:
        """The loaded model as of its last load or settings change."""

    @property
    def running(self) -> bool:
        """Whether the service's thread is alive."""

    def close(self) -> None:
        """Stop what runs and end the service's threads; idempotent."""
