"""DeepSeek sparse attention (GLM-5) in numba: the indexer's key scores and latent attention over the
keys it selects, both reading the paged KV cache through the sequence's block table.

Each row is computed on its own in a fixed order (the same bits whether a token came in a prefill or
decoded alone). Selection is discrete, so the scores must not depend on the batch: a last-bit difference
could swap two keys at the top-k boundary.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from engine.kernels.simd import tof32
from engine.kernels.topk import reference_topk

# Reassociation lets the compiler vectorize the dot products; the order it picks is fixed in the compiled
# loop, the same for every row (as engine.kernels.attention's latent kernel).
_FAST = {"reassoc", "contract", "nsz", "arcp"}


@njit(parallel=True, cache=True, fastmath=_FAST, boundscheck=False)
def _index_scores(q, w, kb, ks, table, bsize, positions, scale, out):  # pragma: no cover - compiled
    t_count, n_heads, d = q.shape
    width = out.shape[1]
    for i in prange(t_count * width):           # every (query, key) pair apart: a single decoded row runs parallel
        t = i // width
        s = i % width
        if s > positions[t]:
            out[t, s] = -np.inf
            continue
        b = table[s // bsize]
        o = s % bsize
        total = np.float32(0.0)
        for h in range(n_heads):
            acc = np.float32(0.0)
            for j in range(d):
                acc += q[t, h, j] * tof32(kb[b, o, j])
            v = acc * ks[b, o] * scale
            if v > 0:                               # relu
                total += w[t, h] * v
        out[t, s] = total


def index_scores(q: np.ndarray, w: np.ndarray, kb: np.ndarray, ks: np.ndarray, table: np.ndarray,
                 positions: np.ndarray, scale: float) -> np.ndarray:
    """The indexer's score of every key up to each query's position: sum_h w[t, h] * relu(q[t, h] . k_s * scale).

    q [T, Hi, D], w [T, Hi]; keys kb [NB, B, D] with row scales ks [NB, B]. Returns [T, S] (-inf past a
    query's position)."""
    width = int(positions.max()) + 1
    out = np.empty((q.shape[0], width), np.float32)
    _index_scores(np.ascontiguousarray(q, np.float32), np.ascontiguousarray(w, np.float32), kb, ks, table,
                  kb.shape[1], np.ascontiguousarray(positions, np.int64), np.float32(scale), out)
    return out


def top_keys(scores: np.ndarray, positions: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
    """The keys each query attends to: its `topk` best-scored keys, or every key up to its position when it
    sees no more than `topk`. Returns (positions [T, K] ascending, counts [T]).

    Exactly tied scores across the top-k boundary are kept as the reference's torch.topk keeps them, over
    the same row (`scores` [T, S], -inf past each query's position, as its causal mask leaves them).
    """
    t_count, width = scores.shape
    k = min(topk, width)
    sel = np.zeros((t_count, k), np.int64)
    counts = np.empty(t_count, np.int64)
    for t in range(t_count):
        n = int(positions[t]) + 1
        if n <= topk:
            sel[t, :n] = np.arange(n)
            counts[t] = n
            continue
        row = scores[t]
        order = np.argsort(-row[:n], kind="stable")
        if row[order[k - 1]] == row[order[k]]:             # a tie across the boundary: the reference's pick
            sel[t] = reference_topk(row, k)
        else:
            sel[t] = np.sort(order[:k])
        counts[t] = k
    return sel, counts


@njit(parallel=True, cache=True, fastmath=_FAST, boundscheck=False)
def _attend_selected(q_nope, q_rot, w_uk, w_uv, lb, ls, rb, rs, table, bsize, sel, counts, scale, keep,
                     q_lat, ctx, weights, scores, out):  # pragma: no cover - compiled
    t_count, n_heads, dn = q_nope.shape
    dr = q_rot.shape[2]
    rank = lb.shape[2]
    dv = w_uv.shape[1]
    for i in prange(t_count * n_heads):
        t = i // n_heads
        h = i % n_heads
        n = counts[t]
        for r in range(rank):                       # the key up-projection, absorbed into the query
            acc = np.float32(0.0)
            for j in range(dn):
                acc += q_nope[t, h, j] * w_uk[h, j, r]
            q_lat[i, r] = acc
        best = -np.inf
        for m in range(n):
            s = sel[t, m]
            b = table[s // bsize]
            o = s % bsize
            a = np.float32(0.0)
            for r in range(rank):
                a += q_lat[i, r] * tof32(lb[b, o, r])
            c = np.float32(0.0)
            for j in range(dr):
                c += q_rot[t, h, j] * tof32(rb[b, o, j])
            sc = (a * ls[b, o] + c * rs[b, o]) * scale
            weights[i, m] = sc
            if sc > best:
                best = sc
        total = np.float32(0.0)
        for m in range(n):
            e = np.float32(math.exp(weights[i, m] - best))
            weights[i, m] = e
            total += e
        inv = np.float32(1.0) / total
        for r in range(rank):
            ctx[i, r] = np.float32(0.0)
        if keep:
            for s in range(scores.shape[1]):
                scores[i, s] = np.float32(0.0)
        for m in range(n):
            s = sel[t, m]
            b = table[s // bsize]
            o = s % bsize
            wt = weights[i, m] * inv
            if keep:
                scores[i, s] = wt
            wt = wt * ls[b, o]
            for r in range(rank):
                ctx[i, r] += wt * tof32(lb[b, o, r])
        for j in range(dv):                         # the value up-projection, after attention
            acc = np.float32(0.0)
            for r in range(rank):
                acc += ctx[i, r] * w_uv[h, j, r]
            out[t, h, j] = acc


def attend_selected(q_nope: np.ndarray, q_rot: np.ndarray, w_uk: np.ndarray, w_uv: np.ndarray, lb: np.ndarray,
                    ls: np.ndarray, rb: np.ndarray, rs: np.ndarray, table: np.ndarray, sel: np.ndarray,
                    counts: np.ndarray, width: int, scale: float, keep: bool = False):
    """Latent attention (as `engine.kernels.attention.attend_latent`) over only the keys `sel` [T, K] names,
    the first `counts` [T] of each row. Returns out [T, H, dv] (and the weights [T * H, width] with `keep`,
    zero at keys not selected)."""
    t_count, n_heads, _ = q_nope.shape
    rank = lb.shape[2]
    rows = t_count * n_heads
    weights = np.empty((rows, sel.shape[1]), np.float32)
    scores = np.empty((rows, width if keep else 0), np.float32)
    q_lat = np.empty((rows, rank), np.float32)
    ctx = np.empty((rows, rank), np.float32)
    out = np.empty((t_count, n_heads, w_uv.shape[1]), np.float32)
    _attend_selected(np.ascontiguousarray(q_nope, np.float32), np.ascontiguousarray(q_rot, np.float32), w_uk, w_uv,
                     lb, ls, rb, rs, table, lb.shape[1], np.ascontiguousarray(sel, np.int64),
                     np.ascontiguousarray(counts, np.int64), np.float32(scale), keep, q_lat, ctx, weights, scores, out)
    return (out, scores) if keep else out
