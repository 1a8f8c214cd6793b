"""The page-fault baseline of the expert store (`--io mmap`): experts are views of the mapped container files,
read by page faults inside the kernels, and dropped from memory (and the page cache) when the budget is full.
"""

from __future__ import annotations

from pathlib import Path

from engine.blocks.ffn import ExpertWeights
from engine.formats.container import Container
from engine.formats.page_release import np_map, release_range
from engine.offload.accounting import Accounting
from engine.offload.slots import NO_SLOT, SlotArena
from engine.offload.store_types import IOCounts, Key, Recipe
from engine.telemetry import Telemetry


class MappedExperts:
    """Experts as views of the mapped files, held in `slots` (in no slot) up to its `n_slots`."""

    def __init__(self, container: Container, recipes: dict[Key, Recipe], names: dict[Key, tuple[str, str, str]],
                 slots: SlotArena, accounting: Accounting, counts: IOCounts, telemetry: Telemetry):
        self.maps = {str(Path(container.path) / f): m for f, m in container.maps.items()}   # path -> mapped file
        self.recipes, self.names, self.slots = recipes, names, slots
        self.accounting, self.counts, self.telemetry = accounting, counts, telemetry

    def step(self, layer: int, ids: list[int]) -> dict[int, ExpertWeights]:
        """Views of a layer step's experts; those not held yet are counted as read from disk."""
        built, acc = self.slots.built, self.accounting
        out = {}
        for i in ids:
            key = (layer, i)
            if key in built:
                acc.hit(key)
            else:
                acc.disk(key)
                r = self.recipes[key]
                m = self.maps[r.file]
                built[key] = r.build(m[r.offset : r.offset + r.length], self.names[key])
                self.slots.where[key] = NO_SLOT
                self.counts.add(r.length)                # at most: page faults read what the kernels touch
                acc.log.reads[key] += 1
                self.telemetry.bytes_read(r.length)
                acc.taken_in(key)
            out[i] = built[key]
        return out

    def trim(self) -> None:
        """Drop mapped experts (least valued first) until no more are held than the slots allow."""
        acc = self.accounting
        while len(self.slots.built) > self.slots.n_slots:
            victim = acc.victim(acc.pinned)
            if victim is None:
                return
            self._drop(victim)

    def _drop(self, key: Key) -> None:
        self.accounting.remove(key)
        self.slots.built.pop(key, None)
        self.slots.where.pop(key, None)
        r = self.recipes[key]
        # out of this process and out of the page cache: the budget holds for the file's pages too (else the
        # baseline would be served from memory the budget does not allow, and no cheaper than reading)
        release_range(np_map(self.maps[r.file]), r.file, r.offset, r.length)
