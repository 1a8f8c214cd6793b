"""Retention past `max_len`: which block to evict (`choose_victim`), and moving stored rotary keys to new
positions (`_rotate_back`) once the blocks after an evicted one move down. `KVCache` applies them."""

from __future__ import annotations

import numpy as np

from engine.kv.pool import blocks_for
from engine.spec import RopeSpec

SINK_TOKENS = 4           # retention: the first tokens always kept (attention sinks)


def _rotate_back(x: np.ndarray, rope: RopeSpec, delta: int) -> None:
    """Rotate stored rotary features x [..., rows, >= rope.dim] in place by `delta` positions.

    Stored keys are rotated already and laid out as halves (the rotary layout the kernels use), so
    rotating again by delta moves them from position p to p + delta: R(delta) R(p) = R(p + delta).
    """
    d = rope.dim
    angles = np.float32(delta) * rope.inv_freq()                 # [d/2]
    c, s = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    a, b = x[..., : d // 2].copy(), x[..., d // 2 : d].copy()
    x[..., : d // 2] = a * c - b * s
    x[..., d // 2 : d] = b * c + a * s


def choose_victim(scores: np.ndarray, n_blocks: int, block_size: int, sink_tokens: int, recent_tokens: int,
                  before: int | None = None) -> int | None:
    """The block to evict under retention: among the full blocks after the sinks and before the
    recent window (and before block `before` when given), the one whose tokens drew the least attention on
    average; None if none qualifies.

    `scores` [n_blocks * block_size] holds each held position's mean attention received so far.
    """
    first = blocks_for(sink_tokens, block_size)
    last = n_blocks - 1 - blocks_for(recent_tokens, block_size)     # the last block is never full-and-old
    if before is not None:
        last = min(last, before - 1)
    if last < first:
        return None
    per_block = scores[: n_blocks * block_size].reshape(n_blocks, block_size)[first : last + 1].mean(axis=1)
    return first + int(np.argmin(per_block))
