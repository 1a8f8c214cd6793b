"""The page-fault baseline of the expert store (`--io mmap`): experts are views of the mapped container files,
read by page faults inside the kernels, and dropped from memory (and the page cache) when the budget is full.

A part of `ExpertStore` (engine/offload/store.py), which holds the state these methods use: `maps` (path ->
mapped file), `built`, `where`, `recipes`, `names`, `pinned`, `policy`, `hits`, `n_slots`, `now` and the counters.
"""

from __future__ import annotations

import mmap
import os

from engine.blocks.ffn import ExpertWeights
from engine.offload.io import PAGE, round_up
from engine.offload.store_types import Key


class MappedExperts:
    """The store's `--io mmap` mode (mixed into ExpertStore)."""

    def _mmap_step(self, layer: int, ids: list[int]) -> dict[int, ExpertWeights]:
        """Page-fault mode: views of the mapped extents; evicted extents are dropped from memory."""
        tel = self.telemetry
        out = {}
        for i in ids:
            key = (layer, i)
            if key in self.built:
                tier = "pinned" if key in self.pinned else "cached"
                self.hits[tier] += 1
                tel.hit(tier)
                if key not in self.pinned:
                    self.policy.access(key, self.now)
            else:
                self.hits["disk"] += 1
                tel.hit("disk")
                r = self.recipes[key]
                m = self.maps[r.file]
                self.built[key] = r.build(m[r.offset : r.offset + r.length], self.names[key])
                self.where[key] = -1
                self.bytes_read += r.length      # at most: page faults read what the kernels touch
                self.reads += 1
                tel.bytes_read(r.length)
                if key not in self.pinned:
                    self.policy.insert(key, self.now)
                    self.policy.access(key, self.now)
            out[i] = self.built[key]
        return out

    def _trim_mapped(self) -> None:
        """Drop mapped experts (least valued first) until the cache holds no more than its slots."""
        while len(self.built) > self.n_slots:
            try:
                victim = self.policy.victim(self.pinned)
            except LookupError:
                return
            self._drop_mapped(victim)

    def _drop_mapped(self, key: Key) -> None:
        self.policy.remove(key)
        self.built.pop(key, None)
        self.where.pop(key, None)
        r = self.recipes[key]
        m = self.maps[r.file]
        start = r.offset - r.offset % PAGE
        end = round_up(r.offset + r.length, PAGE)
        try:
            m._mmap.madvise(mmap.MADV_DONTNEED, start, min(end, len(m)) - start)
        except (AttributeError, OSError, ValueError):
            pass
        # and out of the page cache: the budget holds for the file's pages too (else the baseline would be
        # served from memory the budget does not allow, and no cheaper than reading)
        try:
            fd = os.open(r.file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, start, min(end, len(m)) - start, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except (AttributeError, OSError):
            pass
