"""Online choosers: which of two equivalent ways of running a step is faster on this machine, now.

They decide speed only: both ways give the same bits, so a choice may change at any step. Per-run state,
kept in a model's decode context (engine/models/context.py), never in its weights.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar


class FasterChoice:
    """Which of two ways of running a step comes next: the `preferred` one, or the `other` when recent steps run
    that way were faster. Now and then a step tries the way not chosen, so the choice follows the machine: PROBE
    steps after the choice last changed, then twice as long after each try that did not change it, up to
    MAX_PROBE. The answer is the same either way; only the time differs. `tries` counts the steps picked to
    measure the way not chosen (a caller timing a larger step around this one leaves those out)."""

    FIRST = 3       # steps measured each way before the first choice
    PROBE = 16      # steps from a change of choice to the first try of the other way
    MAX_PROBE = 1024
    KEEP = 8        # recent step times kept each way

    def __init__(self) -> None:
        self.steps = 0
        self.walls: dict[int, list[float]] = {}
        self.seen: set[int] = set()
        self.best = 0
        self.interval = self.PROBE
        self.next_try = 0
        self.tries = 0

    def pick(self, preferred: int, other: int) -> int:
        """The way of the next step (`preferred` until both ways are measured)."""
        self.steps += 1
        if preferred == other:
            return preferred
        if len(self.walls.get(preferred, ())) < self.FIRST:
            return preferred
        if len(self.walls.get(other, ())) < self.FIRST:       # both ways measured before choosing
            self.tries += 1
            return other
        median = {n: sorted(self.walls[n])[len(self.walls[n]) // 2] for n in (preferred, other)}
        best = min(median, key=median.get)
        if best != self.best:
            self.best, self.interval = best, self.PROBE
            self.next_try = self.steps + self.interval
        if self.steps >= self.next_try:
            self.interval = min(2 * self.interval, self.MAX_PROBE)
            self.next_try = self.steps + self.interval
            self.tries += 1
            return other if best == preferred else preferred
        return best

    def record(self, way: int, wall: float) -> None:
        """The wall time of a step run `way` (the first each way is left out: it may have loaded or compiled
        kernels)."""
        if way not in self.seen:
            self.seen.add(way)
            return
        walls = self.walls.setdefault(way, [])
        walls.append(wall)
        del walls[: -self.KEEP]


class ThreadChoice(FasterChoice):
    """How many threads the next fused step runs with: all that numba may use, or one when recent steps with one
    were faster. On a machine whose cores other programs keep busy, a step's threads end by waiting for the one the
    system descheduled (the parallel region's join), so one thread can beat two; a try of the count not chosen
    costs one slow step, which is why tries grow rarer while the choice holds."""

    def pick(self, most: int) -> int:  # type: ignore[override]
        """The thread count of the next step, at most `most`."""
        return super().pick(most, 1) if most > 1 else 1


C = TypeVar("C", bound=FasterChoice)


class BySize(Generic[C]):
    """One chooser per batch size: the time per sequence of a step run together falls as the batch grows, and that
    of a step run apart does not, so a choice compares only the times of steps of one size."""

    def __init__(self, make: Callable[[], C]) -> None:
        self._make = make
        self._choices: dict[int, C] = {}

    def __getitem__(self, size: int) -> C:
        """The chooser of steps of `size` sequences (made on first use)."""
        choice = self._choices.get(size)
        if choice is None:
            choice = self._choices[size] = self._make()
        return choice
