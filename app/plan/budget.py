"""A whole memory budget split into what the weights may take, with the assumptions said aloud.

Memory = weights + KV cache for the chosen context + working buffers + the interpreter's and
libraries' own footprint (measured in this process before any model is loaded).
"""

from __future__ import annotations

from dataclasses import dataclass

from app.config.sizes import format_size
from engine.errors import ColibriError
from engine.offload.budget import kv_bytes, working_bytes
from engine.offload.pressure import cgroup_headroom, read_meminfo
from engine.spec import ModelSpec


def process_rss() -> int:
    """This process's resident memory in bytes (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True)
class MemoryNow:
    """The machine's memory as it stands: what other programs hold counts against any budget."""

    total: int          # physical memory (or the cgroup's limit when lower)
    available: int      # what can still be handed out: MemAvailable, or the cgroup's headroom when less
    own: int            # this process's resident bytes

    @property
    def others(self) -> int:
        """Bytes other programs (and the kernel) hold: neither available nor ours."""
        return max(self.total - self.available - self.own, 0)

    def note(self, budget: int) -> str | None:
        """A warning when `budget` is more than the memory available now, else None."""
        if budget <= self.available + self.own:
            return None
        return (f"other programs hold {format_size(self.others)}: {format_size(self.available)} is available now, "
                f"less than the {format_size(budget)} budget; close programs or lower --max-memory (while decoding, "
                "the expert cache shrinks when memory runs short, and decoding slows)")


def memory_now(meminfo: dict[str, int] | None = None, headroom: int | None = None, own: int | None = None
               ) -> MemoryNow | None:
    """Memory as it stands (this machine's /proc and cgroup unless given); None where /proc/meminfo is missing."""
    if meminfo is None:
        meminfo, headroom = read_meminfo(), cgroup_headroom()
    if "MemTotal" not in meminfo:
        return None
    total, available = meminfo["MemTotal"], meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
    if headroom is not None and headroom < available:
        available = headroom
    return MemoryNow(total, available, process_rss() if own is None else own)


@dataclass(frozen=True)
class BudgetSplit:
    """How a memory budget divides."""

    total: int
    kv: int
    working: int
    baseline: int
    ctx: int
    apart: bool = False     # the baseline comes on top of `total` (as `colibri run --max-memory` counts it)

    @property
    def weights(self) -> int:
        """What is left for the weights."""
        return self.total - self.kv - self.working - (0 if self.apart else self.baseline)

    @property
    def kv_and_working(self) -> str:
        """The KV cache and working buffers, in words."""
        return f"KV cache for {self.ctx} tokens {format_size(self.kv)}, working buffers {format_size(self.working)}"

    def describe(self) -> str:
        """The assumptions, for the user."""
        head, weights, interp = f"of {format_size(self.total)}", format_size(self.weights), "interpreter and libraries"
        if self.apart:
            return (f"{head}: {self.kv_and_working} -> {weights} for the weights; the {interp} "
                    f"({format_size(self.baseline)}, measured) come on top")
        return f"{head}: {self.kv_and_working}, {interp} {format_size(self.baseline)} (measured) -> {weights} for the weights"


def check_ctx(spec: ModelSpec, ctx: int) -> None:
    """ColibriError unless the model supports a context of `ctx` tokens."""
    if ctx < 1 or ctx > spec.max_position:
        raise ColibriError(f"--ctx {ctx}: the model supports 1 to {spec.max_position} tokens")


def split_budget(spec: ModelSpec, total: int, ctx: int, baseline: int) -> BudgetSplit:
    """Divide `total` bytes; fails clearly when nothing is left for the weights."""
    check_ctx(spec, ctx)
    split = BudgetSplit(total, kv_bytes(spec, ctx), working_bytes(spec, ctx), baseline, ctx)
    if split.weights <= 0:
        raise ColibriError(f"a memory budget of {format_size(total)} leaves nothing for the weights ({split.describe()}); "
                           "raise --max-memory or lower --ctx")
    return split
