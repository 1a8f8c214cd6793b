"""Recurrent-state checkpoints: what lets a hybrid model (gated DeltaNet layers beside attention) reuse a prefix.

A recurrent layer's state after a prefix cannot be rebuilt from the attention layers' KV blocks, so a new
sequence could not take over a cached prefix. The pool therefore keeps, under the prefix digest of the
block that ends at a boundary, a snapshot of every recurrent layer's state there (`Checkpoints`). A
sequence that finds a prompt's blocks in the prefix index goes on from the longest boundary that has a
snapshot: it takes the blocks up to it and the states, and runs only the rest (engine.kv.KVCache.adopt).

Snapshots are made where the state is at hand anyway: a long step keeps the state at the last block boundary
it crosses, and where its prompt stopped matching the cached prefix blocks (a system prompt shared by the
next prompts; the recurrence copies them out in the same kernel call); a short step (decoding, drafts) at
every boundary it crosses, its states being kept per token anyway; past the end of an adopted prompt only
a sequence's latest one stays (what the conversation's next turn resumes from). They are bounded:
each is charged whole blocks of the pool (the blocks are set aside, so the KV budget that sized the pool
counts them), they take at most `SHARE` of the pool, the least recently used goes first when a new one or a
sequence needs room, and one goes with its boundary block's index entry (a snapshot whose prefix blocks
are gone is of no use). A snapshot's arrays are never written after it is made (steps copy the state they
start from), so sequences and the pool share them without copies.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from engine.kv import KVPool

State = tuple[np.ndarray, ...]   # one recurrent layer's state arrays (DeltaNet: conv inputs [K-1, C], matrices [Hv, Dk, Dv])
SHARE = 0.5                      # at most this part of the pool's blocks is set aside for snapshots


def own(state: State) -> State:
    """The state with every array that is a view into a larger buffer copied out (a kept state must not hold on
    to the other states of the step that made it)."""
    return tuple(a.copy() if a.base is not None and a.base.nbytes > a.nbytes else a for a in state)


def state_bytes(states: Sequence[State]) -> int:
    """Bytes of the arrays of a list of layer states."""
    return sum(a.nbytes for state in states for a in state)


class Checkpoints:
    """Snapshots of every recurrent layer's state at block boundaries of the pool's cached prefixes.

    `put(digest, states)` keeps the states after the prefix whose last full block has prefix hash `digest`,
    setting aside `cost` free blocks of the pool (evicting older snapshots for room, never a block in use);
    `get` returns them (most recently used afterwards); `drop` lets one go and gives its blocks back.
    """

    def __init__(self, pool: "KVPool", share: float = SHARE):
        self.pool = pool
        self.limit = int(pool.n_blocks * share)          # blocks snapshots may hold in all
        self.entries: OrderedDict[bytes, tuple[list[State], list[int]]] = OrderedDict()   # oldest first
        self.reserved = 0                                # blocks set aside now
        self.nbytes = 0                                  # bytes of the snapshots' arrays
        self.made = self.used = 0                        # snapshots kept, and restored from, so far
        shapes = [shape for layer in pool.spec.layers for shape in getattr(layer.attn, "state_shapes", None) or ()]
        self.snapshot_bytes = 4 * sum(int(np.prod(shape)) for shape in shapes)   # one snapshot of every layer

    @property
    def useful(self) -> bool:
        """Whether a snapshot can be kept at all (else a step need not copy its boundary states out)."""
        size = self.pool.block_bytes
        return bool(size) and -(-self.snapshot_bytes // size) <= self.limit

    def cost(self, states: Sequence[State]) -> int | None:
        """Blocks a snapshot is charged; None when the pool's blocks hold no bytes to charge it against (a model
        with recurrent layers only: its budget has no room for snapshots)."""
        size = self.pool.block_bytes
        return -(-state_bytes(states) // size) if size else None

    def put(self, digest: bytes, states: list[State]) -> bool:
        """Keep `states` under `digest` if there is room for them; whether they are kept."""
        if digest in self.entries:
            self.entries.move_to_end(digest)
            return True
        cost = self.cost(states)
        if cost is None or cost > self.limit:
            return False
        pool = self.pool
        while self.entries and (self.reserved + cost > self.limit or len(pool.free) < cost):
            self.drop(next(iter(self.entries)))
        if self.reserved + cost > self.limit or len(pool.free) < cost:
            return False                                 # the blocks are in use or hold cached prefixes
        blocks = [pool.free.pop() for _ in range(cost)]
        states = [own(state) for state in states]
        self.entries[digest] = (states, blocks)
        self.reserved += cost
        self.nbytes += state_bytes(states)
        self.made += 1
        return True

    def has(self, digest: bytes) -> bool:
        """Whether a snapshot is kept under `digest` (its recency unchanged)."""
        return digest in self.entries

    def get(self, digest: bytes) -> list[State] | None:
        """The snapshot under `digest` (now the most recently used), or None."""
        entry = self.entries.get(digest)
        if entry is None:
            return None
        self.entries.move_to_end(digest)
        self.used += 1
        return entry[0]

    def drop(self, digest: bytes) -> None:
        """Let the snapshot under `digest` go (if any); its blocks go back to the pool's free list."""
        entry = self.entries.pop(digest, None)
        if entry is None:
            return
        states, blocks = entry
        self.pool.free.extend(blocks)                    # set aside, never written: nothing to discard
        self.reserved -= len(blocks)
        self.nbytes -= state_bytes(states)

    def evict_oldest(self) -> bool:
        """Drop the least recently used snapshot; whether there was one."""
        if not self.entries:
            return False
        self.drop(next(iter(self.entries)))
        return True

    def clear(self) -> None:
        """Drop every snapshot."""
        while self.evict_oldest():
            pass
