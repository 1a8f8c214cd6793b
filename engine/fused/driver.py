"""The thread that works the expert store while a fused decode call runs (engine/fused/plan.py): it reads what
the call waits for and what the read-ahead guessed, and publishes the reads their reader threads could not (see
engine/fused/post.py).
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from engine.blocks.ffn import StoreHooks
from engine.fused.sync import set_flag

if TYPE_CHECKING:
    from engine.fused.plan import FusedDecode


class Driver:
    """Reads ahead for a fused step while its calls run: the guesses the kernel posts go to the store's
    `prefetch` whenever the driver is awake (a guess does not wake it; a need or a completed read does), and reads
    that completed are collected (`collect`: the store publishes them through `_held`, so later layers of the same
    call find them in memory; most reads a reader thread publishes itself as it completes, see `ReadQueue.read`, and
    wakes the driver only for the others). It holds the store only between `begin` and `end` (the engine thread holds
    it otherwise) and sleeps on an eventfd that the kernel's posts of needs, completed reads and `begin` write to (no
    polling: on two cores a polling thread slowed every call); it ends with its plan. Its callbacks reach the store
    as one `StoreHooks`: `idle` between calls, `calling` (with the guard) during one."""

    def __init__(self, plan: "FusedDecode", store) -> None:
        self.store = store
        self.post, self.cur = plan.post, plan.cur
        self.layout = plan.layout                        # where each region of `post` begins
        self.release = plan._release
        self.n = plan.lay.shape[0]
        self.guessed = np.zeros(self.n, bool)
        self.needed = np.zeros(self.n, bool)
        self.active = False
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.lock.acquire()                              # the engine thread's, but during calls
        self.closed = False
        self.wake = _Wake()
        self.fd = self.wake.fd
        # on_read: a read the store could not hand over itself; on_arrival: the others (see ReadQueue.read)
        self.idle = StoreHooks(on_read=self.wake.poke, on_arrival=plan._held, on_close=self.close)
        self.calling = replace(self.idle, guard=self.release)   # no slot taken from an expert the call may read
        store.attach(self.idle)
        threading.Thread(target=_drive, args=(weakref.ref(self), self.lock, self.wake), name="colibri-read-ahead",
                         daemon=True).start()
        weakref.finalize(self, self.wake.poke)         # gone without close: the thread wakes and ends

    def poke(self) -> None:
        """Wake the driver."""
        self.wake.poke()

    def close(self) -> None:
        """The store closes: the thread ends (between calls, when it is idle)."""
        self.closed = True
        self.store.attach(None)
        self.wake.poke()

    def token(self) -> None:
        """A new token: no guess or need of it handled yet."""
        self.guessed[:] = False
        self.needed[:] = False

    def begin(self, start: int) -> None:
        """A call starts (at layer `start`): the driver may use the store until `end`."""
        n = self.n
        self.post[self.layout.word : self.layout.word + n] = 0          # no layer decided yet in this call
        self.post[self.layout.refused : self.layout.refused + n] = 0    # nor refused
        self.post[self.layout.second : self.layout.second + n] = 0      # nor a second word said
        self.post[self.layout.deciding] = start
        self.cur[:] = -1
        self.store.attach(self.calling)
        self.active = True
        self.lock.release()
        self.poke()                                      # reads completed since the last call are taken in

    def end(self) -> None:
        """The call returned: wait for the driver to let go of the store; raise what it met."""
        self.cur[:] = -1                                 # no thread reads an expert now
        self.active = False
        self.lock.acquire()
        self.store.attach(self.idle)
        self._guesses(read=False)                        # those it did not take while awake: scored, not read
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def refuse_all(self) -> None:
        """Tell the running call that nothing it waits for will come (it stops where it waits)."""
        for j in range(self.n):
            set_flag(self.post, self.layout.refused + j, 1)

    def work(self) -> None:
        post, n, store = self.post, self.n, self.store
        needed = self.layout.needed
        for j in np.flatnonzero((post[needed : needed + n] != 0) & ~self.needed).tolist():   # its needs first
            self.needed[j] = True
            # the read-ahead's guesses (posted before these needs) go to the readers before the driver reads the
            # last need itself: once it is in, the call may decide their layers before the driver is back
            if not store.need(j, self._posted(n + j, int(post[needed + j])), self._guesses):
                set_flag(post, self.layout.refused + j, 1)   # the call stops there; the engine thread brings them
        store.collect()
        self._guesses()
        store.collect()

    def _guesses(self, read: bool = True) -> None:
        """Hand the store the read-ahead's guesses posted since the last look: read those not in memory (a guess
        for a layer the call already decided is scored, not read)."""
        post, n = self.post, self.n
        guessed, word = self.layout.guessed, self.layout.word
        for j in np.flatnonzero((post[guessed : guessed + n] != 0) & ~self.guessed).tolist():
            self.guessed[j] = True
            self.store.prefetch(j, self._posted(j, int(post[guessed + j])), read=read and post[word + j] == 0)

    def _posted(self, row: int, count: int) -> list[int]:
        """The first `count` expert ids of row `row` of the post's id rows (guesses for layer j at row j, a call's
        needs for layer j at row L + j; see engine/fused/post.py)."""
        start = self.layout.id_row(row)
        return self.post[start : start + count].tolist()


class _Wake:
    """An eventfd the driver's thread sleeps on: poked by the kernel (its number), reads and calls; closed once,
    by the thread as it ends (a poke after that does nothing, never writing to a number since reused)."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_CLOEXEC)
        self.lock = threading.Lock()
        self.closed = False

    def poke(self) -> None:
        with self.lock:
            if not self.closed:
                os.eventfd_write(self.fd, 1)

    def close(self) -> None:
        with self.lock:
            if not self.closed:
                self.closed = True
                os.close(self.fd)


def _drive(ref: "weakref.ref[Driver]", lock: threading.Lock, wake: _Wake) -> None:
    """The driver's thread: on each wake-up, work if a call runs; end once the driver is closed or gone."""
    try:
        while True:
            os.eventfd_read(wake.fd)
            driver = ref()
            if driver is None or driver.closed:
                return
            if not driver.active:
                del driver
                continue
            del driver
            while not lock.acquire(timeout=0.5):         # the engine thread's between calls
                if ref() is None:
                    return
            try:
                driver = ref()
                if driver is None:
                    return
                try:
                    if driver.active and driver.error is None:
                        driver.work()
                except BaseException as exc:  # raised on the engine thread by `end`
                    driver.error = exc
                    driver.refuse_all()                  # the call stops at the next layer it waits at
                del driver
            finally:
                lock.release()
    finally:
        wake.close()
