"""The expert arena reserves room for every expert of a model larger than RAM, committing only the budget's slots."""

from __future__ import annotations

import os

from engine.offload.slots import SlotArena
from tests.support.rss import rss_of

SLOT = 64 << 20


def _ram_and_swap() -> int:
    kib = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":")
            kib[key] = int(value.split()[0])
    return (kib["MemTotal"] + kib["SwapTotal"]) * 1024


def test_an_arena_four_times_ram_and_swap_maps_and_commits_only_its_slots():
    # a 60 GB container's experts at a 12 GB budget on a 24 GB machine: the reservation alone is past what the
    # kernel's overcommit check allows a private mapping that counts against memory (ENOMEM before the fix)
    max_slots = 4 * _ram_and_swap() // SLOT
    before = rss_of(os.getpid())
    arena = SlotArena(SLOT, 3, max_slots, reserve=True)
    try:
        assert arena.arena is not None and arena.arena.nbytes == max_slots * SLOT
        committed = rss_of(os.getpid()) - before
        assert 3 * SLOT * 0.9 <= committed <= 3 * SLOT + (64 << 20)     # the three slots, faulted in at load
        arena.grow(5)
        assert arena.n_slots == 5 and sorted(arena.free) == [0, 1, 2, 3, 4]
        assert rss_of(os.getpid()) - before <= 5 * SLOT + (64 << 20)
        arena.shrink(2)     # handed back to the OS
        assert rss_of(os.getpid()) - before <= 2 * SLOT + (64 << 20)
    finally:
        arena.close()
