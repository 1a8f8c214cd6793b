"""Memory pressure: when other programs take memory while a model decodes, the expert cache gives way.

A budget chosen at start says what Colibri may hold, not what the machine can still give: another
program that fills memory later would otherwise drive the kernel to kill the biggest process, this
one. Between tokens a `MemoryGuard` reads how much the system can still hand out (MemAvailable in
/proc/meminfo, and the cgroup's memory.max - memory.current when a limit is set) and, below a
reserve, shrinks the expert cache by the shortfall (evicted experts are read again when needed:
slower, never another answer); when memory comes back it grows the cache again up to what the user
asked. Each change is logged and published as telemetry gauges ("mem_available", "expert_cache",
"pressure_shrinks") so front ends can show it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from engine.offload.budget import format_bytes
from engine.telemetry import NULL, Telemetry

log = logging.getLogger(__name__)

MIN_RESERVE = 256 << 20          # bytes always left to the rest of the system
RESERVE_SHARE = 1 / 32           # ... or this share of physical memory, whichever is more
CHECK_EVERY = 0.25               # seconds between two readings (a reading costs tens of microseconds)


def read_meminfo(path: str | Path = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as bytes by field name ({} where there is no such file)."""
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def cgroup_headroom(proc_cgroup: str | Path = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's cgroup (v2) may still take, memory.max - memory.current; None when unlimited or unknown."""
    try:
        rel = next(line.split("::", 1)[1].strip() for line in Path(proc_cgroup).read_text().splitlines()
                   if line.startswith("0::"))
        folder = Path(root) / rel.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(int(limit) - int((folder / "memory.current").read_text().strip()), 0)
    except (OSError, StopIteration, ValueError):
        return None


def available_bytes() -> int | None:
    """What the system can still hand out: MemAvailable, or the cgroup's headroom when that is less (None when
    neither is known, as on systems without /proc)."""
    avail = read_meminfo().get("MemAvailable")
    room = cgroup_headroom()
    known = [v for v in (avail, room) if v is not None]
    return min(known) if known else None


def default_reserve() -> int:
    """Bytes to leave free for the rest of the system: MIN_RESERVE or RESERVE_SHARE of physical memory."""
    return max(MIN_RESERVE, int(read_meminfo().get("MemTotal", 0) * RESERVE_SHARE))


class ResizableCache(Protocol):
    """What the guard needs of an expert store: its byte budget for experts, the least it can work with, and a way
    to change it between tokens."""

    @property
    def capacity(self) -> int:
        """Bytes the cache may hold now."""

    @property
    def min_capacity(self) -> int:
        """The fewest bytes a token can be computed with."""

    def set_capacity(self, capacity: int) -> None:
        """Change the budget (shrinking evicts and returns the memory)."""


@dataclass(frozen=True)
class PressureChange:
    """One change the guard made: the memory available then, and the cache's budget before and after."""

    available: int
    before: int
    after: int


class MemoryGuard:
    """Shrinks (and regrows) an expert cache so that at least `reserve` bytes stay available to the system.

    `available` returns the bytes the system can still hand out (None: unknown, do nothing); `clock` returns
    seconds; both are replaceable for tests.
    """

    def __init__(self, cache: ResizableCache, reserve: int | None = None, telemetry: Telemetry = NULL,
                 available: Callable[[], int | None] = available_bytes, clock: Callable[[], float] = time.monotonic,
                 every: float = CHECK_EVERY):
        self.cache, self.telemetry, self.available, self.clock, self.every = cache, telemetry, available, clock, every
        self.reserve = default_reserve() if reserve is None else reserve
        self.ceiling = cache.capacity           # what the user asked for: the cache never grows past it
        self._set: int | None = None            # the budget this guard last set
        self._last = float("-inf")
        self.shrinks = 0
        self.changes: list[PressureChange] = []

    def check(self, force: bool = False) -> PressureChange | None:
        """Read the memory available (at most once per `every` seconds unless forced) and resize the cache when it
        is below the reserve, or well above it after a shrink; the change made, if any."""
        now = self.clock()
        if not force and now - self._last < self.every:
            return None
        self._last = now
        current = self.cache.capacity
        if self._set is not None and current != self._set:
            self.ceiling, self._set = current, None       # the user changed the budget meanwhile: it is the ceiling
        avail = self.available()
        if avail is None:
            return None
        self.telemetry.set_gauge("mem_available", avail)
        if avail < self.reserve:
            target = max(current - (self.reserve - avail), self.cache.min_capacity)
        elif current < self.ceiling and avail > 2 * self.reserve:
            target = min(current + (avail - 2 * self.reserve), self.ceiling)   # come back, leaving a margin
        else:
            return None
        if target == current:
            return None
        self.cache.set_capacity(target)
        after = self.cache.capacity
        self._set = after
        change = PressureChange(avail, current, after)
        self.changes.append(change)
        if after < current:
            self.shrinks += 1
            log.warning("memory pressure: %s available (reserve %s): expert cache shrunk from %s to %s",
                        format_bytes(avail), format_bytes(self.reserve), format_bytes(current), format_bytes(after))
        else:
            log.info("memory back: %s available: expert cache grown from %s to %s", format_bytes(avail),
                     format_bytes(current), format_bytes(after))
        self.telemetry.set_gauge("expert_cache", after)
        self.telemetry.set_gauge("pressure_shrinks", self.shrinks)
        return change
