"""Causal grouped-query attention in numba: one (token, head) at a time, the same operations
whatever the batch.

Each output row is computed from its own query and the keys up to its position by the same loop
(scores, running max, exponentials, weighted sum of values, in key order), so it is bitwise the
same whether the token came in a prefill of 500 or decoded alone: the engine's tenet that batch
size and cache state never change the answer. It also replaces a dozen numpy calls per layer by
one in decode.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True, fastmath=False)
def _attend(q, k, v, positions, window, scale, scores, out):  # pragma: no cover - compiled
    t_count, n_heads, d = q.shape
    n_kv, _, dv = v.shape
    group = n_heads // n_kv
    for i in prange(t_count * n_heads):
        t = i // n_heads
        h = i % n_heads
        kv = h // group
        p = positions[t]
        lo = 0
        if window > 0 and p - window + 1 > 0:
            lo = p - window + 1
        best = -np.inf
        for s in range(lo, p + 1):
            acc = np.float32(0.0)
            for j in range(d):
                acc += q[t, h, j] * k[kv, s, j]
            sc = acc * scale
            scores[i, s] = sc
            if sc > best:
                best = sc
        total = np.float32(0.0)
        for s in range(lo, p + 1):
            e = np.float32(math.exp(scores[i, s] - best))
            scores[i, s] = e
            total += e
        inv = np.float32(1.0) / total
        for j in range(dv):
            out[t, h, j] = np.float32(0.0)
        for s in range(lo, p + 1):
            w = scores[i, s] * inv
            for j in range(dv):
                out[t, h, j] += w * v[kv, s, j]


def attend_causal(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, scale: float,
                  window: int | None = None) -> np.ndarray:
    """softmax(q k^T * scale, causal (and windowed)) v: q [T, H, D], k [Hkv, S, D], v [Hkv, S, Dv] -> [T, H, Dv].

    Query t sits at `positions[t]` and sees keys 0..positions[t] (the last `window` of them when set).
    """
    t_count, n_heads, _ = q.shape
    scores = np.empty((t_count * n_heads, k.shape[1]), np.float32)
    out = np.empty((t_count, n_heads, v.shape[2]), np.float32)
    _attend(np.ascontiguousarray(q, np.float32), k, v, np.ascontiguousarray(positions, np.int64),
            int(window or 0), np.float32(scale), scores, out)
    return out
