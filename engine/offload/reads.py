"""Reading experts into the store's slots: a read on the I/O pool, its checksum checked on its first read off the
path of the step that waits for it, and the expert built over its slot once the read is in.

A part of `ExpertStore` (engine/offload/store.py), which holds the state these methods use: `io`, `arena`,
`recipes`, `names`, `where`, `built`, `loading`, `checks`, `verified`, `views`, `transient`, `scratch`, `free`,
`pinned`, `policy`, `prefetched`, `missed`, `settings`, `on_read`, `on_arrival` and the listeners (`_notify`).
"""

from __future__ import annotations

import concurrent.futures as cf
import zlib
from collections.abc import Iterable

import numpy as np

from engine.blocks.ffn import ExpertWeights
from engine.errors import ColibriError, ModelFormatError
from engine.offload.store_types import Key, Recipe


class SlotReads:
    """The store's reads into slots (mixed into ExpertStore)."""

    def _read(self, key: Key, r: Recipe, dest: np.ndarray, here: bool = False) -> cf.Future:
        """A future that completes when the extent is in `dest`. On its first read the reader thread then checks
        its checksum, off the path of the step that waits for it: `checks[key]` says whether it held, and the
        expert counts as used only once it did (`_confirm`). With `here` the read runs on this thread instead
        (`IOPool.read_here`), and so do the steps below.

        As the read completes, and before its future is done (so before the store may take the expert in, and then
        out), the reader thread hands the expert built over its slot to `on_arrival` when the slot's views are
        already built (`_finish` builds them once a slot and layout). Otherwise it calls `on_read`, which wakes the
        thread that takes reads in. (A fused call waits for the expert: measured at 25% of mixtral-1.7b's experts,
        the driver woken for every completed read took 53-59 us, median, from the bytes in to the expert handed
        over, and each wake-up took time from the compute threads.)"""
        done: cf.Future = cf.Future()
        checked: cf.Future | None = None
        if self.settings.verify and key not in self.verified:
            checked = self.checks[key] = cf.Future()

        def finished(read: cf.Future) -> None:
            handed = False
            try:
                read.result()
                handed = self._hand_over(key, r)
                done.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting engine thread
                done.set_exception(exc)
                if checked is not None:
                    checked.set_result(True)             # nothing to check: the read's own error is raised
            if self.on_read is not None and not handed:
                self.on_read()                           # in memory: a waiting step goes on meanwhile
            if checked is not None and not checked.done():
                checked.set_result(zlib.crc32(memoryview(dest[: r.length])) == r.crc32)

        read = self.io.read_here if here else self.io.submit   # (here: on this thread, done on return)
        read(r.file, r.offset, r.length, dest).add_done_callback(finished)
        return done

    def _hand_over(self, key: Key, r: Recipe) -> bool:
        """On the reader thread, a read of `key` in: hand the expert over its slot to `on_arrival` if the slot's
        views are built; whether it was."""
        arrival = self.on_arrival
        slot = self.where.get(key)
        views = self.views.get((slot, r.layout)) if arrival is not None and slot is not None else None
        if views is None:
            return False
        arrival(key, ExpertWeights(*views, self.names[key]))
        return True

    def _confirm(self, keys: Iterable[Key]) -> None:
        """Raise if an expert of a step just computed (or about to be) was read with a checksum that does not hold;
        it leaves memory first. Waits for checks still running (each about 0.2 ms a MB)."""
        for key in keys:
            checked = self.checks.pop(key, None)
            if checked is None:
                continue
            if checked.result():
                self.verified.add(key)
                continue
            if key in self.where:
                self.pinned.discard(key)
                if key in self.transient:
                    self._drop_transient(key)
                else:
                    self._evict(key)
            self.missed.clear()                          # the token is not given: its count starts over
            r = self.recipes[key]
            raise ModelFormatError(f"{r.file}: checksum mismatch in expert {key[1]} of layer {key[0]}; the "
                                   "container is corrupt: convert the model again with `colibri convert`")

    def _finish(self, key: Key, fut: cf.Future) -> None:
        """A read completed: build the expert over its slot (or free the slot and raise)."""
        if self.loading.pop(key, None) is None and key in self.built:
            return                                       # already taken in (by _settle)
        try:
            fut.result()
        except BaseException:
            self.checks.pop(key, None)
            slot = self.where.pop(key)
            if key in self.transient:
                self.transient.discard(key)
                self.scratch.append(slot)
            else:
                self.free.append(slot)
            self.prefetched.discard(key)
            self._notify(key, None)
            raise
        slot = self.where[key]
        r = self.recipes[key]
        views = self.views.get((slot, r.layout))
        if views is None:     # building the tensors checks every buffer: about 0.2 ms an expert, so once a slot
            data = self.arena[slot * self.slot_bytes : slot * self.slot_bytes + r.length]
            e = r.build(data, self.names[key])
            self.views[(slot, r.layout)] = (e.gate, e.up, e.down)
            self.built[key] = e
        else:                 # and layout: the same views over the slot's bytes, now holding this expert
            self.built[key] = ExpertWeights(*views, self.names[key])
        self._notify(key, self.built[key])             # (read through a scratch slot: until it is taken back)
        if key in self.transient:
            self.policy.access(key, self.now)           # counted, not kept
            return
        if key not in self.pinned:
            self.policy.insert(key, self.now)
            self.policy.access(key, self.now)

    def _settle(self) -> None:
        """Finish reads that completed in the background (prefetches), so their slots are accounted."""
        for key, fut in list(self.loading.items()):
            if fut.done():
                try:
                    self._finish(key, fut)
                except ColibriError:
                    pass                                 # a failed prefetch: the real request reads again and raises
