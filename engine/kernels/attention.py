"""Causal attention over the paged KV cache in numba, one (token, head) at a time: the same
operations whatever the batch (`engine.blocks.attention.attend` is the plain numpy reference).

Each output row is computed from its own query and the keys up to its position by one function
(`attend_row`: scores, running max, exponentials, weighted sum of values) whose sums run in a
fixed order (16-lane fused multiply-adds, no fastmath), so it is bitwise the same whether the
token came in a prefill of 500, decoded alone or in the fused decode step: the engine's tenet
that batch size and cache state never change the answer.

The paged kernels read keys and values where the KV cache keeps them, in fixed-size blocks found
through the sequence's block table (no gather copy per step). Each stored row carries a scale
(1.0 for float32 and fp16 storage, the row's absmax / 127 for int8), multiplied once per score and once
per weight: for float32 storage the result is the same as without it, bit for bit.

With `keep` set, each row's normalised attention weights are left in `scores` (zeros outside the
keys it saw): the retention policy sums them into heavy-hitter scores.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from engine.kernels.simd import (
    U64,
    fma32,
    tof32,
    vexp,
    vfma,
    vload,
    vload_part,
    vloadf,
    vsplat,
    vstore,
    vstore_part,
    vsum,
    vzero,
)


@njit(boundscheck=False)
def _kdot(q, qo, k, ko, d):
    """sum_j q[qo + j] * k[ko + j] over 16 lanes (fma, fixed tree), the tail past a multiple of 16 one fma each."""
    acc = vzero()
    d16 = d // 16
    for j in range(d16):
        acc = vfma(vload(q, qo + U64(16 * j)), vloadf(k, ko + U64(16 * j)), acc)
    y = vsum(acc)
    for j in range(d16 * 16, d):
        y = fma32(q[qo + U64(j)], tof32(k[ko + U64(j)]), y)
    return y


@njit(boundscheck=False)
def _row_base(table, s, shift, heads_kv, kv, bsize):
    """The flat cache row of position s for kv head `kv` (bsize = 1 << shift)."""
    return (U64(table[s >> shift]) * U64(heads_kv) + U64(kv)) * U64(bsize) + U64(s & (bsize - 1))


@njit(boundscheck=False)
def attend_row(q, qo, d, kb, ks, vb, vs, heads_kv, bsize, dv, kv, table, p, lo, scale, scores, so, keep, width,
               out, oo, sink=-np.inf):
    """One query q[qo:qo+d] of kv head `kv` over positions lo .. p of a paged cache -> out[oo:oo+dv].

    A finite `sink` (gpt-oss's per-head logit) joins the softmax's denominator as a key with no value; at
    -inf it adds nothing, and the bits are those of the plain softmax.

    kb, vb are the cache's flat [NB, Hkv, B, D] key and value arrays (float32, fp16 bits or int8), ks, vs the flat
    [NB, Hkv, B] row scales; scores[so:so+width] is scratch, left holding the normalised weights
    (zeros outside lo .. p when `keep`). Every sum runs in a fixed order (no fastmath): the same bits
    in any batch and in the fused decode step. Positions are walked block by block (B is a power of two:
    a row's place is a shift and a mask, never a division).
    """
    shift = 0
    while (1 << shift) < bsize:
        shift += 1
    best = np.float32(-np.inf)
    s = lo
    while s <= p:                                                    # one block at a time
        n = min(bsize - (s & (bsize - 1)), p + 1 - s)
        row = _row_base(table, s, shift, heads_kv, kv, bsize)
        for i in range(n):
            sc = _kdot(q, qo, kb, (row + U64(i)) * U64(d), d) * ks[row + U64(i)] * scale
            scores[so + U64(s + i)] = sc
            if sc > best:
                best = sc
        s += n
    sink32 = np.float32(sink)
    if sink32 > best:                                                # the sink is the largest logit
        best = sink32
    shift_v = vsplat(-best)
    one = vsplat(np.float32(1.0))
    for s in range(lo, p + 1, 16):                                   # e**(score - best), 16 lanes at a time
        m = min(16, p + 1 - s)
        o = so + U64(s)
        vstore_part(scores, o, vexp(vfma(vload_part(scores, o, m), one, shift_v)), m)
    total = np.float32(0.0)
    for s in range(lo, p + 1):
        total += scores[so + U64(s)]
    if sink32 > np.float32(-np.inf):
        total += np.float32(math.exp(sink32 - best))
    inv = np.float32(1.0) / total
    for s in range(lo, p + 1):
        scores[so + U64(s)] = scores[so + U64(s)] * inv                 # the normalised weights
    # out = sum over s in order of (weight * row scale) * v[s]: one fma per lane and position, the output held
    # in registers 64 features at a time (each feature's sequence of operations is the same either way)
    d16 = dv // 16
    j = 0
    while j + 4 <= d16:
        a0 = vzero()
        a1 = vzero()
        a2 = vzero()
        a3 = vzero()
        s = lo
        while s <= p:
            n = min(bsize - (s & (bsize - 1)), p + 1 - s)
            row = _row_base(table, s, shift, heads_kv, kv, bsize)
            for i in range(n):
                r = row + U64(i)
                ww = vsplat(scores[so + U64(s + i)] * vs[r])
                vo = r * U64(dv) + U64(16 * j)
                a0 = vfma(ww, vloadf(vb, vo), a0)
                a1 = vfma(ww, vloadf(vb, vo + U64(16)), a1)
                a2 = vfma(ww, vloadf(vb, vo + U64(32)), a2)
                a3 = vfma(ww, vloadf(vb, vo + U64(48)), a3)
            s += n
        vstore(out, oo + U64(16 * j), a0)
        vstore(out, oo + U64(16 * j + 16), a1)
        vstore(out, oo + U64(16 * j + 32), a2)
        vstore(out, oo + U64(16 * j + 48), a3)
        j += 4
    while j < d16:
        a0 = vzero()
        for s in range(lo, p + 1):
            r = _row_base(table, s, shift, heads_kv, kv, bsize)
            a0 = vfma(vsplat(scores[so + U64(s)] * vs[r]), vloadf(vb, r * U64(dv) + U64(16 * j)), a0)
        vstore(out, oo + U64(16 * j), a0)
        j += 1
    for jj in range(d16 * 16, dv):
        acc = np.float32(0.0)
        for s in range(lo, p + 1):
            r = _row_base(table, s, shift, heads_kv, kv, bsize)
            acc = fma32(scores[so + U64(s)] * vs[r], tof32(vb[r * U64(dv) + U64(jj)]), acc)
        out[oo + U64(jj)] = acc
    if keep:
        for s in range(0, lo):
            scores[so + U64(s)] = np.float32(0.0)
        for s in range(p + 1, width):
            scores[so + U64(s)] = np.float32(0.0)


@njit(boundscheck=False)
def encode_i8_row(x, n, out, o):
    """x[:n] -> int8 out[o:o+n], returning the row's scale: absmax / 127, each value x / scale rounded to nearest
    even and clipped to +-127. The same bits as the cache's numpy writer (`engine.kv.layers._encode`): float32 division,
    one rounding each."""
    amax = np.float32(0.0)
    for j in range(n):
        a = abs(x[j])
        if a > amax:
            amax = a
    scale = np.float32(amax / np.float32(127.0))
    safe = scale if scale > np.float32(0.0) else np.float32(1.0)
    for j in range(n):
        v = np.rint(np.float32(x[j] / safe))
        out[o + U64(j)] = np.int8(min(max(v, np.float32(-127.0)), np.float32(127.0)))
    return scale


@njit(parallel=True, cache=True, boundscheck=False)
def _attend_paged(q, kb, ks, vb, vs, table, bsize, heads_kv, d, dv, positions, window, scale, keep, scores, out,
                  n_heads, sinks):  # pragma: no cover - compiled
    t_count = positions.shape[0]
    group = n_heads // heads_kv
    width = scores.shape[0] // (t_count * n_heads)
    for i in prange(t_count * n_heads):
        t = i // n_heads
        h = i % n_heads
        p = positions[t]
        lo = 0
        if window > 0 and p - window + 1 > 0:
            lo = p - window + 1
        attend_row(q, U64(i * d), d, kb, ks, vb, vs, heads_kv, bsize, dv, h // group, table, p, lo, scale,
                   scores, U64(i * width), keep, width, out, U64(i * dv), sinks[h])


def attend_paged(q: np.ndarray, kb: np.ndarray, ks: np.ndarray, vb: np.ndarray, vs: np.ndarray, table: np.ndarray,
                 positions: np.ndarray, scale: float, window: int | None = None, keep: bool = False,
                 sinks: np.ndarray | None = None):
    """Causal attention over a paged cache: q [T, H, D]; kb [NB, Hkv, B, D] and vb [NB, Hkv, B, Dv]
    (float32, fp16 bits or int8) with row scales ks, vs [NB, Hkv, B]; `table` [n] lists the blocks of the
    sequence in order (position s lives in block table[s // B], row s % B).

    `sinks` [H] (gpt-oss) are per-head logits added to each softmax's denominator (None: none).
    Returns out [T, H, Dv], and with `keep` also the attention weights [T * H, S] (S = last position + 1).
    """
    t_count, n_heads, d = q.shape
    sink_row = np.full(n_heads, -np.inf, np.float32) if sinks is None else np.ascontiguousarray(sinks, np.float32)
    width = int(positions.max()) + 1
    scores = np.empty((t_count * n_heads, width), np.float32)
    out = np.empty((t_count, n_heads, vb.shape[3]), np.float32)
    _attend_paged(np.ascontiguousarray(q, np.float32).reshape(-1), kb.reshape(-1), ks.reshape(-1), vb.reshape(-1),
                  vs.reshape(-1), table, kb.shape[2], kb.shape[1], d, vb.shape[3],
                  np.ascontiguousarray(positions, np.int64), int(window or 0), np.float32(scale), keep,
                  scores.reshape(-1), out.reshape(-1), n_heads, sink_row)
    return (out, scores) if keep else out


# Reassociation lets the compiler vectorize the latent kernel's dot products; the summation order it
# picks is fixed in the compiled loop, the same for every row, so rows stay independent of the batch.
_FAST = {"reassoc", "contract", "nsz", "arcp"}


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
                a += q_lat[i, r] * tof32(lb[b, o, r])
            c = np.float32(0.0)
            for j in range(dr):
                c += q_rot[t, h, j] * tof32(rb[b, o, j])
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
                ctx[i, r] += w * tof32(lb[b, o, r])
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
