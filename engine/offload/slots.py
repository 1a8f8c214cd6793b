"""The expert store's slot memory: one aligned arena of fixed-size slots, which expert sits in which slot, the free
and scratch slots, and the experts built over their slots.

Scratch slots hold experts read through (not kept: used by their step, then taken back) when the policy admits by
value. In `--io mmap` mode there is no arena: mapped experts are held here too, in no slot (-1).
"""

from __future__ import annotations

import mmap
from collections.abc import Container

import numpy as np

from engine.blocks.ffn import ExpertWeights
from engine.offload.io import PAGE
from engine.offload.store_types import Key, Recipe
from engine.pages import MAP_NORESERVE, advise_huge_pages

NO_SLOT = -1           # where a mapped expert (`--io mmap`) sits


class SlotArena:
    """Slots of `slot_bytes` each, `n_slots` of them in use; with `reserve`, an arena with room for `max_slots`."""

    def __init__(self, slot_bytes: int, n_slots: int, max_slots: int, reserve: bool):
        self.slot_bytes = slot_bytes
        self.n_slots = n_slots
        self.max_slots = max_slots
        self.where: dict[Key, int] = {}                # resident or loading key -> slot
        self.built: dict[Key, ExpertWeights] = {}      # resident experts
        self.transient: set[Key] = set()               # in scratch slots: read through, not kept
        self.free: list[int] = []
        self.scratch: list[int] = []                   # slots for experts read through (admission)
        self.views: dict[tuple[int, tuple], tuple] = {}   # (slot, layout) -> an expert's tensors over the slot
        self.arena: np.ndarray | None = None           # [max_slots * slot_bytes] uint8
        self._map: mmap.mmap | None = None
        if reserve:
            # room for every expert, reserved but not committed: the budget may grow later without moving
            # experts, and only the budget's slots take memory (committed at load; a shrink hands pages back)
            self._map = mmap.mmap(-1, max_slots * slot_bytes,
                                  flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
            advise_huge_pages(self._map)               # the kernels read slots as they read resident weights
            self.arena = np.frombuffer(self._map, np.uint8)
            self.n_slots = min(n_slots, max_slots)
            self.free = list(range(self.n_slots - 1, -1, -1))
            self.commit(0, self.n_slots)

    def assign(self, key: Key, slot: int) -> np.ndarray:
        """`key` is to be read into `slot`: the slot's bytes [slot_bytes] uint8."""
        self.where[key] = slot
        return self.arena[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]

    def laid_out(self, key: Key, r: Recipe) -> tuple | None:
        """The tensors over `key`'s slot when that slot already holds them for `r`'s layout (else None)."""
        slot = self.where.get(key)
        return self.views.get((slot, r.layout)) if slot is not None else None

    def build(self, key: Key, r: Recipe, names: tuple[str, str, str]) -> ExpertWeights:
        """The expert read into its slot, now resident: the slot's tensors, laid out on its first expert."""
        slot = self.where[key]
        views = self.views.get((slot, r.layout))
        if views is None:     # building the tensors checks every buffer: once a slot
            data = self.arena[slot * self.slot_bytes : slot * self.slot_bytes + r.length]
            e = r.build(data, names)
            self.views[(slot, r.layout)] = (e.gate, e.up, e.down)
        else:                 # and layout: the same views over the slot's bytes, now holding this expert
            e = ExpertWeights(*views, names)
        self.built[key] = e
        return e

    def free_slot(self, key: Key) -> None:
        """`key` leaves its slot, which becomes free."""
        self.free.append(self.where.pop(key))

    def scratch_slot(self, key: Key) -> None:
        """`key`, read through, leaves its scratch slot, which returns."""
        self.transient.discard(key)
        self.scratch.append(self.where.pop(key))

    def keys_in(self, slots: Container[int]) -> list[Key]:
        """The keys sitting in any of `slots`."""
        return [k for k, slot in self.where.items() if slot in slots]

    def limit(self, slots: int) -> None:
        """Hold no more than `slots` experts (mapped mode: no arena to resize)."""
        self.n_slots = slots

    def shrink(self, slots: int) -> None:
        """Drop the slots from `slots` on (empty by now) and hand their pages back."""
        self.free = [f for f in self.free if f < slots]
        self._map.madvise(mmap.MADV_DONTNEED, slots * self.slot_bytes, (self.n_slots - slots) * self.slot_bytes)
        self.n_slots = slots

    def grow(self, slots: int) -> None:
        """Add slots up to `slots`, committed and free."""
        self.commit(self.n_slots, slots)
        self.free.extend(range(slots - 1, self.n_slots - 1, -1))
        self.n_slots = slots

    def release_scratch(self) -> None:
        """The scratch slots (empty by now) below `n_slots` become free ones."""
        self.free.extend(f for f in self.scratch if f < self.n_slots)
        self.scratch = []

    def reserve_scratch(self, want: set[int]) -> None:
        """Make the slots in `want` (empty by now) the scratch slots."""
        self.free = [f for f in self.free if f not in want]
        self.scratch = sorted(want, reverse=True)

    def commit(self, lo: int, hi: int) -> None:
        """Fault in the pages of slots lo..hi - 1, not in use, now rather than at their first read mid-token: one
        write a 4 KB page (the kernel zeroes a page at its first write, 2 MB at once where it gives huge ones)."""
        start, end = lo * self.slot_bytes, hi * self.slot_bytes
        if end > start:
            self.arena[start:end:PAGE] = 0
            self.arena[end - 1] = 0

    def close(self) -> None:
        """Forget every expert and drop the arena."""
        self.built.clear()
        self.views.clear()
        self.where.clear()
        self.arena = None
