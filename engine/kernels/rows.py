"""Per-row numba kernels of the small steps between the matrix products: RMSNorm, RoPE, routing, SiLU, GELU.

(The SiLU product itself, `silu_rows`, lives with the fused experts in engine/kernels/experts.py.)

Each step is one compiled function of one row, called by the batched blocks (a loop over rows)
and by the fused decode step (engine/models/decode_step.py) alike. None uses fastmath and the only
reduction (the norm's sum of squares) runs in the kernels' fixed 16-lane order, so a row's bits
are the same in a prefill of 500 tokens, in a batch of sequences and in the fused step: the
engine's tenet that batch size never changes the answer. (LayerNorm, for the few families that use it,
sums in index order: the blocks run it, never the fused step.)
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from engine.kernels.experts import silu_rows
from engine.kernels.simd import U64, fma32, vfma, vload, vsum, vzero

F32 = np.float32
PARALLEL_ELEMENTS = 1 << 18  # a batch of rows this large runs over the threads (a parallel region costs ~25 us)


# -- RMSNorm ------------------------------------------------------------------------------------

@njit(boundscheck=False)
def norm_row(x, xo, w, eps, n, out, oo):
    """out[oo:oo+n] = x[xo:xo+n] * (1 / sqrt(mean of squares + eps)) * w (flat float32 arrays, eps float32)."""
    acc = vzero()
    k16 = n // 16
    for j in range(k16):
        v = vload(x, xo + U64(16 * j))
        acc = vfma(v, v, acc)
    ss = vsum(acc)
    for j in range(k16 * 16, n):
        ss = fma32(x[xo + U64(j)], x[xo + U64(j)], ss)
    inv = F32(1.0) / np.sqrt(ss / F32(n) + eps)
    for j in range(n):
        out[oo + U64(j)] = (x[xo + U64(j)] * inv) * w[j]


@njit(boundscheck=False)
def norm_scale(x, xo, eps, n):
    """1 / sqrt(mean of squares of x[xo:xo+n] + eps), summed in norm_row's order (the same bits as its factor)."""
    acc = vzero()
    k16 = n // 16
    for j in range(k16):
        v = vload(x, xo + U64(16 * j))
        acc = vfma(v, v, acc)
    ss = vsum(acc)
    for j in range(k16 * 16, n):
        ss = fma32(x[xo + U64(j)], x[xo + U64(j)], ss)
    return F32(1.0) / np.sqrt(ss / F32(n) + eps)


@njit(cache=True, boundscheck=False)
def _norm_rows(x, w, eps, n, out):
    for r in range(x.shape[0] // n):
        norm_row(x, U64(r * n), w, eps, n, out, U64(r * n))


@njit(parallel=True, cache=True, boundscheck=False)
def _norm_rows_parallel(x, w, eps, n, out):
    for r in prange(x.shape[0] // n):
        norm_row(x, U64(r * n), w, eps, n, out, U64(r * n))


def rms_norm_rows(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis of x [..., D] with weight [D], in float32 -> a new array of x's shape."""
    x = np.ascontiguousarray(x, np.float32)
    w = np.ascontiguousarray(weight, np.float32).reshape(-1)
    out = np.empty_like(x)
    if x.size:
        kernel = _norm_rows_parallel if x.size >= PARALLEL_ELEMENTS else _norm_rows
        kernel(x.reshape(-1), w, F32(eps), w.size, out.reshape(-1))
    return out


@njit(cache=True, boundscheck=False)
def _layer_norm_rows(x, w, b, eps, n, out):
    for r in range(x.shape[0] // n):
        o = r * n
        total = 0.0                                   # float64 sums in index order: a row's bits in any batch
        for j in range(n):
            total += x[o + j]
        mean = F32(total / n)
        sq = 0.0
        for j in range(n):
            d = x[o + j] - mean
            sq += d * d
        inv = F32(1.0) / np.sqrt(F32(sq / n) + eps)
        for j in range(n):
            out[o + j] = (x[o + j] - mean) * inv * w[j] + b[j]


def layer_norm_rows(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis of x [..., D]: (x - mean) / sqrt(var + eps) * weight + bias, in float32
    (variance biased, as torch's) -> a new array of x's shape."""
    x = np.ascontiguousarray(x, np.float32)
    w = np.ascontiguousarray(weight, np.float32).reshape(-1)
    out = np.empty_like(x)
    if x.size:
        _layer_norm_rows(x.reshape(-1), w, np.ascontiguousarray(bias, np.float32).reshape(-1), F32(eps), w.size,
                         out.reshape(-1))
    return out


# -- GELU (exact) --------------------------------------------------------------------------------

@njit(cache=True, boundscheck=False)
def _gelu_erf(x, out):
    for i in range(x.shape[0]):
        v = float(x[i])                                # in float64, rounded once: any batch, the same bits
        out[i] = F32(0.5 * v * (1.0 + math.erf(v * 0.7071067811865476)))


def gelu_erf_rows(x: np.ndarray) -> np.ndarray:
    """x * Phi(x) with the exact error function (transformers' "gelu") in float32 -> a new array of x's shape."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    if x.size:
        _gelu_erf(x.reshape(-1), out.reshape(-1))
    return out


# -- RoPE ---------------------------------------------------------------------------------------

@njit(boundscheck=False)
def rope_row(x, xo, cos, sin, co, d, width, interleaved, out, oo):
    """Rotate the first d features of one head x[xo:xo+width] by the angles cos/sin[co:co+d/2] -> out[oo:...].

    Pairs (j, j + d/2), or (2j, 2j + 1) when interleaved; the result is laid out as halves either way
    (the reference's layout, the same for q and k). Features past d are copied.
    """
    half = d // 2
    for j in range(half):
        if interleaved:
            a = x[xo + U64(2 * j)]
            b = x[xo + U64(2 * j + 1)]
        else:
            a = x[xo + U64(j)]
            b = x[xo + U64(half + j)]
        c = cos[co + U64(j)]
        s = sin[co + U64(j)]
        out[oo + U64(j)] = a * c - b * s
        out[oo + U64(half + j)] = b * c + a * s
    for j in range(d, width):
        out[oo + U64(j)] = x[xo + U64(j)]


@njit(cache=True, boundscheck=False)
def _rope_rows(x, heads, width, cos, sin, d, interleaved, out):
    for i in range(x.shape[0] // (heads * width)):
        for h in range(heads):
            o = U64((i * heads + h) * width)
            rope_row(x, o, cos, sin, U64(i * (d // 2)), d, width, interleaved, out, o)


def rope_rows(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, d: int, interleaved: bool) -> np.ndarray:
    """x [T, H, D] rotated by cos, sin [T, d/2] (see rope_row) -> a new [T, H, D] array."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    if x.size:
        _rope_rows(x.reshape(-1), x.shape[1], x.shape[2], np.ascontiguousarray(cos, np.float32).reshape(-1),
                   np.ascontiguousarray(sin, np.float32).reshape(-1), d, interleaved, out.reshape(-1))
    return out


# -- routing ------------------------------------------------------------------------------------

SOFTMAX, SIGMOID = 0, 1


@njit(boundscheck=False)
def route_row(logits, lo, n_experts, top_k, scoring, bias, norm_topk, scaling, scores, ids, io, weights, wo):
    """Top-k experts of one token from its router logits[lo:lo+E] -> ids[io:io+K], weights[wo:wo+K].

    Scores are the softmax (or sigmoid) of the logits; the choice ranks scores + bias (bias empty: none),
    best first, ties to the lower id (a stable sort); weights are the chosen scores, renormalised to sum
    to 1 when norm_topk, times `scaling`. `scores` [2E] is scratch.
    """
    if scoring == SOFTMAX:
        best = -np.inf
        for e in range(n_experts):
            if logits[lo + U64(e)] > best:
                best = logits[lo + U64(e)]
        total = F32(0.0)
        for e in range(n_experts):
            v = F32(math.exp(logits[lo + U64(e)] - best))
            scores[e] = v
            total += v
        for e in range(n_experts):
            scores[e] = scores[e] / total
    else:
        for e in range(n_experts):
            scores[e] = F32(1.0) / (F32(1.0) + F32(math.exp(-logits[lo + U64(e)])))
    for e in range(n_experts):
        scores[n_experts + e] = F32(0.0)                  # 1: already chosen
    denom = F32(0.0)
    for k in range(top_k):
        pick = -1
        top = F32(0.0)
        for e in range(n_experts):
            if scores[n_experts + e] != F32(0.0):
                continue
            c = scores[e] + bias[e] if bias.shape[0] else scores[e]
            # strictly better only: among equal scores the lower id wins; NaN ranks last
            if pick < 0 or c > top or (top != top and c == c):
                pick = e
                top = c
        scores[n_experts + pick] = F32(1.0)
        ids[io + U64(k)] = pick
        weights[wo + U64(k)] = scores[pick]
        denom += scores[pick]
    if norm_topk:
        if scoring == SIGMOID:
            denom = denom + F32(1e-20)
        for k in range(top_k):
            weights[wo + U64(k)] = weights[wo + U64(k)] / denom
    for k in range(top_k):
        weights[wo + U64(k)] = weights[wo + U64(k)] * scaling


@njit(cache=True, boundscheck=False)
def _route_rows(logits, n_experts, top_k, scoring, bias, norm_topk, scaling, ids, weights):
    scores = np.empty(2 * n_experts, np.float32)
    for t in range(logits.shape[0] // n_experts):
        route_row(logits, U64(t * n_experts), n_experts, top_k, scoring, bias, norm_topk, scaling, scores,
                  ids, U64(t * top_k), weights, U64(t * top_k))


def route_rows(logits: np.ndarray, top_k: int, scoring: int, bias: np.ndarray | None, norm_topk: bool,
               scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [T, E] -> (ids [T, K] int64, weights [T, K] float32), one row at a time (see route_row)."""
    t, e = logits.shape
    ids = np.empty((t, top_k), np.int64)
    weights = np.empty((t, top_k), np.float32)
    b = np.zeros(0, np.float32) if bias is None else np.ascontiguousarray(bias, np.float32).reshape(-1)
    if t:
        _route_rows(np.ascontiguousarray(logits, np.float32).reshape(-1), e, top_k, scoring, b, norm_topk,
                    F32(scaling), ids.reshape(-1), weights.reshape(-1))
    return ids, weights


# -- SiLU-gated product ---------------------------------------------------------------------------

@njit(cache=True, boundscheck=False)
def _silu_rows(g, u, out):
    silu_rows(g, U64(0), u, U64(0), out, U64(0), g.shape[0])


def silu_product(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u elementwise for float32 arrays of one shape -> a new array (quant.experts.silu_rows)."""
    g = np.ascontiguousarray(g, np.float32)
    out = np.empty_like(g)
    _silu_rows(g.reshape(-1), np.ascontiguousarray(u, np.float32).reshape(-1), out.reshape(-1))
    return out
