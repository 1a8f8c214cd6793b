"""A perf_counter_ns stand-in for tests of timed telemetry: time moves only when the test says."""

from __future__ import annotations

MS = 1_000_000  # ns


class FakeClock:
    """A perf_counter_ns stand-in that moves only when told."""

    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns

    def advance(self, ms: float) -> None:
        self.ns += int(ms * MS)
