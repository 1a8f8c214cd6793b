"""Causal attention over the paged KV cache in numba, one (token, head) at a time: the same
operations whatever the batch (`engine.blocks.attention.attend` is the plain numpy reference).

Each output row is computed from its own query and the keys up to its position by the same
compiled loop (scores, running max, exponentials, weighted sum of values), so it is bitwise the
same whether the token came in a prefill of 500 or decoded alone: the engine's tenet that batch
size and cache state never change the answer.

The paged kernels read keys and values where the KV cache keeps them, in fixed-size blocks found
through the sequence's block table (no gather copy per step). Each stored row carries a scale
(1.0 for float32 storage, the row's absmax / 127 for int8), multiplied once per score and once per
weight: for float32 storage the result is the same as without it, bit for bit.

With `keep` set, each row's normalised attention weights are left in `scores` (zeros outside the
keys it saw): the retention policy sums them into heavy-hitter scores.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


# Reassociation lets the compiler vectorize the dot products; the summation order it picks is fixed
# in the compiled loop, the same for every row, so rows stay independent of the batch. Infinities
# keep their meaning (the running max starts at -inf).
_FAST = {"reassoc", "contract", "nsz", "arcp"}


@njit(parallel=True, cache=True, fastmath=_FAST)
def _attend_paged(q, kb, ks, vb, vs, table, bsize, positions, window, scale, keep, scores, out):  # pragma: no cover
    t_count, n_heads, d = q.shape
    n_kv = kb.shape[1]
    dv = vb.shape[3]
    group = n_heads // n_kv
    width = scores.shape[1]
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
            b = table[s // bsize]
            o = s % bsize
            acc = np.float32(0.0)
            for j in range(d):
                acc += q[t, h, j] * np.float32(kb[b, kv, o, j])
            sc = acc * ks[b, kv, o] * scale
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
            b = table[s // bsize]
            o = s % bsize
            w = scores[i, s] * inv
            if keep:
                scores[i, s] = w
            w = w * vs[b, kv, o]
            for j in range(dv):
                out[t, h, j] += w * np.float32(vb[b, kv, o, j])
        if keep:
            for s in range(0, lo):
                scores[i, s] = np.float32(0.0)
            for s in range(p + 1, width):
                scores[i, s] = np.float32(0.0)


def attend_paged(q: np.ndarray, kb: np.ndarray, ks: np.ndarray, vb: np.ndarray, vs: np.ndarray, table: np.ndarray,
                 positions: np.ndarray, scale: float, window: int | None = None, keep: bool = False):
    """Causal attention over a paged cache: q [T, H, D]; kb [NB, Hkv, B, D] and vb [NB, Hkv, B, Dv]
    (float32 or int8) with row scales ks, vs [NB, Hkv, B]; `table` [n] lists the blocks of the
    sequence in order (position s lives in block table[s // B], row s % B).

    Returns out [T, H, Dv], and with `keep` also the attention weights [T * H, S] (S = last position + 1).
    """
    t_count, n_heads, _ = q.shape
    width = int(positions.max()) + 1
    scores = np.empty((t_count * n_heads, width), np.float32)
    out = np.empty((t_count, n_heads, vb.shape[3]), np.float32)
    _attend_paged(np.ascontiguousarray(q, np.float32), kb, ks, vb, vs, table, kb.shape[2],
                  np.ascontiguousarray(positions, np.int64), int(window or 0), np.float32(scale), keep, scores, out)
    return (out, scores) if keep else out


@njit(parallel=True, cache=True, fastmath=_FAST)
def _attend_latent(q_nope, q_rot, w_uk, w_uv, lb, ls, rb, rs, table, bsize, positions, scale, keep,
                   q_lat, ctx, scores, out):  # pragma: no cover - compiled
    t_count, n_heads, dn = q_nope.shape
    dr = q_rot.shape[2]
    rank = lb.shape[2]
    dv = w_uv.shape[1]
    width = scores.shape[1]
    for i in prange(t_count * n_heads):
        t = i // n_heads
        h = i % n_heads
        p = positions[t]
        for r in range(rank):                       # the key up-projection, absorbed into the query
            acc = np.float32(0.0)
            for j in range(dn):
                acc += q_nope[t, h, j] * w_uk[h, j, r]
            q_lat[i, r] = acc
        best = -np.inf
        for s in range(p + 1):
            b = table[s // bsize]
            o = s % bsize
            a = np.float32(0.0)
            for r in range(rank):
                a += q_lat[i, r] * np.float32(lb[b, o, r])
            c = np.float32(0.0)
            for j in range(dr):
                c += q_rot[t, h, j] * np.float32(rb[b, o, j])
            sc = (a * ls[b, o] + c * rs[b, o]) * scale
            scores[i, s] = sc
            if sc > best:
                best = sc
        total = np.float32(0.0)
        for s in range(p + 1):
            e = np.float32(math.exp(scores[i, s] - best))
            scores[i, s] = e
            total += e
        inv = np.float32(1.0) / total
        for r in range(rank):
            ctx[i, r] = np.float32(0.0)
        for s in range(p + 1):
            b = table[s // bsize]
            o = s % bsize
            w = scores[i, s] * inv
            if keep:
                scores[i, s] = w
            w = w * ls[b, o]
            for r in range(rank):
                ctx[i, r] += w * np.float32(lb[b, o, r])
        for j in range(dv):                         # the value up-projection, after attention
            acc = np.float32(0.0)
            for r in range(rank):
                acc += ctx[i, r] * w_uv[h, j, r]
            out[t, h, j] = acc
        if keep:
            for s in range(p + 1, width):
                scores[i, s] = np.float32(0.0)


def attend_latent(q_nope: np.ndarray, q_rot: np.ndarray, w_uk: np.ndarray, w_uv: np.ndarray, lb: np.ndarray,
                  ls: np.ndarray, rb: np.ndarray, rs: np.ndarray, table: np.ndarray, positions: np.ndarray,
                  scale: float, keep: bool = False):
    """Multi-head latent attention over a paged cache of latents: q_nope [T, H, dn], q_rot [T, H, dr],
    w_uk [H, dn, R], w_uv [H, dv, R]; latents lb [NB, B, R] and rotary keys rb [NB, B, dr] with row
    scales ls, rs [NB, B]. Returns out [T, H, dv] (and the weights [T * H, S] with `keep`)."""
    t_count, n_heads, _ = q_nope.shape
    width = int(positions.max()) + 1
    rank = lb.shape[2]
    scores = np.empty((t_count * n_heads, width), np.float32)
    q_lat = np.empty((t_count * n_heads, rank), np.float32)
    ctx = np.empty((t_count * n_heads, rank), np.float32)
    out = np.empty((t_count, n_heads, w_uv.shape[1]), np.float32)
    _attend_latent(np.ascontiguousarray(q_nope, np.float32), np.ascontiguousarray(q_rot, np.float32), w_uk, w_uv,
                   lb, ls, rb, rs, table, lb.shape[1], np.ascontiguousarray(positions, np.int64), np.float32(scale),
                   keep, q_lat, ctx, scores, out)
    return (out, scores) if keep else out
