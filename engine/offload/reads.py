"""The expert store's read queue: reads of experts into slots on the I/O pool, the checksum checked on an expert's
first read off the path of the step that waits for it, and the hand-over of a completed read to a running fused
call straight from its reader thread.

The store (engine/offload/store.py) takes completed reads in on its own thread (`completed`), and asks whether the
experts a step ran held their checksums (`failed`) before that step's answer is given.
"""

from __future__ import annotations

import concurrent.futures as cf
import zlib
from collections.abc import Iterable, Iterator

import numpy as np

from engine.blocks.ffn import NO_HOOKS, ExpertWeights, StoreHooks
from engine.offload.io import IOPool
from engine.offload.slots import SlotArena
from engine.offload.store_types import Key, Recipe


class ReadQueue:
    """Reads in flight (`loading`) and the checksums still to confirm (`checks`) of experts read into `slots`."""

    def __init__(self, io: IOPool | None, slots: SlotArena, names: dict[Key, tuple[str, str, str]], verify: bool):
        self.io: IOPool | None = io
        self.slots, self.names, self.verify = slots, names, verify
        self.loading: dict[Key, cf.Future] = {}        # reads in flight
        self.checks: dict[Key, cf.Future] = {}         # experts in memory whose checksum is still to be confirmed
        self.verified: set[Key] = set()
        self.hooks: StoreHooks = NO_HOOKS              # read by the reader threads as each read completes

    def read(self, key: Key, r: Recipe, dest: np.ndarray, here: bool = False) -> cf.Future:
        """Start reading `key`'s extent into `dest`: a future (in `loading`) that completes when it is in. On its
        first read the reader thread then checks its checksum, off the path of the step that waits for it:
        `checks[key]` says whether it held, and the expert counts as used only once it did (`failed`). With `here`
        the read runs on this thread instead (`IOPool.read_here`), and so do the steps below.

        As the read completes, and before its future is done (so before the store may take the expert in, and then
        out), the reader thread hands the expert built over its slot to the hooks' `on_arrival` when the slot's
        views are already built (the store builds them once a slot and layout). Otherwise it calls `on_read`, which
        wakes the thread that takes reads in: a fused call waiting for the expert goes on sooner, and the driver is
        not woken for every read."""
        done: cf.Future = cf.Future()
        checked: cf.Future | None = None
        if self.verify and key not in self.verified:
            checked = self.checks[key] = cf.Future()

        def finished(read: cf.Future) -> None:
            hooks = self.hooks
            handed = False
            try:
                read.result()
                handed = self._hand_over(hooks, key, r)
                done.set_result(None)
            except BaseException as exc:  # handed to the waiting engine thread
                done.set_exception(exc)
                if checked is not None:
                    checked.set_result(True)             # nothing to check: the read's own error is raised
            if hooks.on_read is not None and not handed:
                hooks.on_read()                          # in memory: a waiting step goes on meanwhile
            if checked is not None and not checked.done():
                checked.set_result(zlib.crc32(memoryview(dest[: r.length])) == r.crc32)

        start = self.io.read_here if here else self.io.submit   # (here: on this thread, done on return)
        start(r.file, r.offset, r.length, dest).add_done_callback(finished)
        self.loading[key] = done
        return done

    def _hand_over(self, hooks: StoreHooks, key: Key, r: Recipe) -> bool:
        """On the reader thread, a read of `key` in: hand the expert over its slot to `on_arrival` if the slot's
        views are built; whether it was."""
        arrival = hooks.on_arrival
        views = self.slots.laid_out(key, r) if arrival is not None else None
        if views is None:
            return False
        arrival(key, ExpertWeights(*views, self.names[key]))
        return True

    def completed(self) -> Iterator[tuple[Key, cf.Future]]:
        """The reads in flight that have completed (still in `loading`), looked at one by one."""
        for key, fut in list(self.loading.items()):
            if fut.done():
                yield key, fut

    def taken(self, key: Key) -> bool:
        """The store takes `key`'s completed read in: whether it was still in flight."""
        return self.loading.pop(key, None) is not None

    def forget(self, key: Key) -> None:
        """`key` leaves memory: read again, it is checked again."""
        self.checks.pop(key, None)

    def failed(self, keys: Iterable[Key]) -> Key | None:
        """The first of `keys` read with a checksum that does not hold (the others up to it are confirmed); waits
        for checks still running (each a small fraction of its read's time)."""
        for key in keys:
            checked = self.checks.pop(key, None)
            if checked is None:
                continue
            if checked.result():
                self.verified.add(key)
                continue
            return key
        return None

    def wait(self) -> None:
        """Wait for every read in flight."""
        for fut in list(self.loading.values()):
            cf.wait([fut])

    def set_pool(self, io: IOPool) -> None:
        """Read on `io` from now on; reads in flight finish on the old pool, which then closes."""
        old, self.io = self.io, io
        self.wait()
        old.close()

    def close(self) -> None:
        """Stop the readers, waiting for reads in flight (their errors no longer matter)."""
        if self.io is not None:
            for fut in list(self.loading.values()):
                try:
                    fut.result()
                except Exception:
                    pass
            self.io.close()
            self.io = None
        self.loading.clear()
        self.checks.clear()
