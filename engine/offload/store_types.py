"""What the expert store (engine/offload/store.py) is told and what it reports, and how it makes an expert.

`StoreSettings` holds the choices (`--io`, `--io-threads`, `--cache-policy`, the byte capacity),
`StoreStats` and `PrefetchStats` the counters it reports, `StoreHooks` (engine/blocks/ffn.py) the callbacks a fused call's driver
attaches, and a `Recipe` turns one expert's extent of container bytes into its three matrices.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.blocks.ffn import ExpertWeights
from engine.errors import ColibriError, ModelFormatError
from engine.formats.container import Container, tensor_from_span
from engine.spec import MoESpec

Key = tuple[int, int]   # (layer, expert)
IO_MODES = ("pread", "mmap")
POLICIES = ("lru", "lfru", "learned")


@dataclass(frozen=True)
class StoreSettings:
    """How the store holds experts."""

    capacity: int                   # bytes of memory for routed experts (pinned + cached)
    io: str = "pread"               # pread | mmap
    io_threads: int = 2
    policy: str = "learned"         # lru | lfru | learned
    pin_fraction: float = 0.1       # share of the slots pinned from the usage history (on recorded chat
                                    # traces a tenth serves small caches better than a quarter)
    direct: bool | None = None      # O_DIRECT: None = when the file system allows it
    verify: bool = True             # CRC-32 of each extent on its first read
    repin_every: int = 32           # tokens between re-pinning decisions
    pressure: bool = True           # shrink the cache when other programs take memory (engine/offload/pressure.py)

    def check(self) -> None:
        """ColibriError naming a bad value."""
        if self.io not in IO_MODES:
            raise ColibriError(f"--io {self.io!r}: choose one of {', '.join(IO_MODES)}")
        if self.policy not in POLICIES:
            raise ColibriError(f"--cache-policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if self.io_threads < 1 or self.io_threads > 64:
            raise ColibriError(f"--io-threads {self.io_threads}: use 1 to 64")
        if not 0.0 <= self.pin_fraction <= 1.0:
            raise ColibriError(f"pin fraction {self.pin_fraction}: use 0 to 1")


@dataclass(frozen=True)
class PrefetchStats:
    """How well the lookahead predicted: over the layer steps it predicted, experts counted once per step."""

    predicted: int
    needed: int
    correct: int

    @property
    def precision(self) -> float:
        """Share of predicted experts that were needed."""
        return self.correct / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        """Share of needed experts that were predicted."""
        return self.correct / self.needed if self.needed else 0.0


@dataclass(frozen=True)
class StoreStats:
    """Counters since the store opened."""

    hits: dict[str, int]            # pinned / cached / disk (a miss read from disk)
    bytes_read: int
    reads: int
    prefetch_issued: int
    prefetch_used: int
    prefetch_wasted: int
    prefetch: PrefetchStats
    occupancy: dict[str, int]       # bytes per tier in memory
    slots: int
    slot_bytes: int

    @property
    def hit_rate(self) -> float:
        """Share of expert requests served from memory."""
        total = sum(self.hits.values())
        return (self.hits["pinned"] + self.hits["cached"]) / total if total else 0.0


@dataclass
class IOCounts:
    """Expert reads started since the store opened (`--io mmap`: extents first touched), and their bytes."""

    reads: int = 0
    bytes: int = 0

    def add(self, nbytes: int) -> None:
        """One read of `nbytes`."""
        self.reads += 1
        self.bytes += nbytes


class Recipe:
    """How to build one expert's ExpertWeights from its extent's bytes."""

    __slots__ = ("file", "offset", "length", "crc32", "parts", "layout")

    def __init__(self, container: Container, layer: int, expert: int, names: tuple[str, str, str]):
        x = container.extents[(layer, expert)]
        self.file, self.offset, self.length, self.crc32 = str(Path(container.path) / x.file), x.offset, x.length, x.crc32
        self.parts = []
        for n in names:
            e = container.entries.get(n)
            if e is None or e.file != x.file or not x.offset <= e.offset <= x.offset + x.length - e.length:
                raise ModelFormatError(f"{container.path}: expert {expert} of layer {layer} has no {n} in its extent; "
                                       "convert the model again with `colibri convert`")
            self.parts.append((e, e.offset - x.offset))
        # experts of one layout over the same bytes are the same tensors (see engine.offload.slots.SlotArena.build)
        self.layout = tuple((rel, e.kind, tuple(e.shape), repr(e.quant), repr(e.buffers)) for e, rel in self.parts)

    def build(self, data: np.ndarray, names: tuple[str, str, str]) -> ExpertWeights:
        """The expert over `data` (its extent's bytes)."""
        gate, up, down = (tensor_from_span(e, data[rel : rel + e.length]) for e, rel in self.parts)
        return ExpertWeights(gate, up, down, names)


def expert_names(layer: int, moe: MoESpec, expert: int) -> tuple[str, str, str]:
    """The container names of an expert's gate, up and down matrices."""
    from engine.models.transformer import expert_prefix

    p = expert_prefix(layer, moe, expert)
    return tuple(f"{p}.{n}.weight" for n in moe.proj_names)

