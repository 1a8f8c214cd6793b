"""A plain numpy reference of the quantized kernels' arithmetic, exact to the bit (tests/kernels/test_reference.py
checks it).

The kernels compute y[t, r] with fused multiply-adds in 16 lanes (lane j takes k = j, j + 16, ...)
and a fixed reduction tree (engine/kernels/matmul.py). numpy has no fused multiply-add, so
`fma32` emulates it: the product of two float32 is exact in float64, the float64 sum is
corrected by its exact rounding error (two-sum), and the one case where rounding float64 to
float32 would round twice (a float64 sum exactly halfway between two float32) is broken by the
sign of that error. With it, `lane_dot` reproduces the kernels bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from engine.kernels.layout import f16_values, from_rows16, quantize_activations, unpack_codes
from engine.kernels.simd import fma32 as hw_fma32

LANES = 16


def fma32(a, b, c) -> np.ndarray:
    """a * b + c rounded once to float32 (round to nearest even), elementwise with broadcasting."""
    a, b, c = (np.asarray(v, np.float32) for v in (a, b, c))
    p = a.astype(np.float64) * b.astype(np.float64)            # exact: 24 + 24 bits < 53
    cd = c.astype(np.float64)
    s = p + cd
    bv = s - p
    err = (p - (s - bv)) + (cd - bv)                           # s + err == p + c exactly
    r = s.astype(np.float32)
    rd = r.astype(np.float64)
    toward = np.where(s > rd, np.float32(np.inf), np.float32(-np.inf))
    other = np.nextafter(r, toward)
    tie = (s != rd) & (s == (rd + other.astype(np.float64)) / 2) & (err != 0)
    hi = np.maximum(r, other)
    lo = np.minimum(r, other)
    return np.where(tie, np.where(err > 0, hi, lo), r).astype(np.float32)


def lane_sum(v: np.ndarray) -> np.ndarray:
    """Sum over the last axis (16 lanes) by the kernels' tree: halves added lane-wise."""
    while v.shape[-1] > 1:
        h = v.shape[-1] // 2
        v = v[..., :h] + v[..., h:]
    return v[..., 0]


def lane_dot(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x [T, K] @ w [R, K].T -> [T, R] float32, by exactly the kernels' sequence of operations."""
    w = np.asarray(w, np.float32)
    x = np.asarray(x, np.float32)
    k = w.shape[1]
    k16 = k // LANES
    lanes = np.zeros((x.shape[0], w.shape[0], LANES), np.float32)                   # [T, R, 16]
    for i in range(k16):
        s = slice(i * LANES, (i + 1) * LANES)
        lanes = fma32(w[None, :, s], x[:, None, s], lanes)
    y = lane_sum(lanes)                                                               # [T, R]
    for j in range(k16 * LANES, k):
        y = fma32(w[None, :, j], x[:, None, j], y)
    return y


def rows16_dot(q, x: np.ndarray) -> np.ndarray:
    """x [T, K] times a rows16 QuantizedTensor -> [T, R] by its kernels' arithmetic (engine/kernels/rows16.py): per
    32-block an exact integer sum of codes (less their offset) times 8-bit activations, then one fused
    multiply-add by d_w * d_x (a float32 product), blocks in order from +0.0."""
    a, scales = from_rows16(q.a, q.scales)
    u = unpack_codes(a, q.b, q.bits, q.shape[1]).astype(np.int64)                     # [R, K]
    offset = 1 << (q.bits - 1)
    d = f16_values(scales)                                                             # [R, groups]
    xq, dx, sums = quantize_activations(np.asarray(x, np.float32))
    acc = np.zeros((x.shape[0], q.shape[0]), np.float32)
    for kb in range(q.shape[1] // 32):
        k = slice(32 * kb, 32 * kb + 32)
        isum = xq[:, k].astype(np.int64) @ u[:, k].T - offset * sums[:, kb][:, None]   # [T, R], exact
        scale = d[None, :, 32 * kb // q.group] * dx[:, kb][:, None]                    # float32 products
        acc = fma32(isum.astype(np.float32), scale, acc)
    return acc


def quant_dot(q, x: np.ndarray) -> np.ndarray:
    """x [T, K] times a QuantizedTensor by exactly its kernels' operations, whatever its layout."""
    return rows16_dot(q, x) if q.layout == "rows16" else lane_dot(q.dequantize(), x)


@njit(cache=True)
def _hw_fma(a, b, c, out):
    for i in range(a.shape[0]):
        out[i] = hw_fma32(a[i], b[i], c[i])


def hardware_fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """The CPU's fused multiply-add (the kernels' primitive), for checking the emulation."""
    out = np.empty(a.shape, np.float32)
    _hw_fma(a.astype(np.float32), b.astype(np.float32), c.astype(np.float32), out)
    return out


def weights(rows: int, cols: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.05).astype(np.float32)


def acts(t: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((t, cols)).astype(np.float32)


def _kquant_params(qtype_name: str, raw: np.ndarray, cols: int):
    """(codes u [R, cols] int64, a [R, subs] float32, b [R, subs] float32 or None) of Q4_K, Q5_K or Q6_K blocks in
    file order: the weights are a * u - b (Q4_K, Q5_K: sub-blocks of 32) or a * (u - 32) (Q6_K, sub-blocks of 16)."""
    rows = raw.shape[0]
    blocks = np.asarray(raw).reshape(rows, cols // 256, -1)
    if qtype_name in ("Q4_K", "Q5_K"):
        d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)                 # [R, S, 1]
        dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
        p = blocks[..., 4:16].astype(np.uint8)
        sc = np.concatenate([p[..., 0:4] & 63, (p[..., 8:12] & 15) | ((p[..., 0:4] >> 6) << 4)], axis=-1)
        m = np.concatenate([p[..., 4:8] & 63, (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)], axis=-1)
        qs = blocks[..., -128:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        u = (qs & 15).reshape(rows, cols)
        if qtype_name == "Q5_K":                   # bit j of qh[l]: the fifth bit of sub-block j's weight l
            qh = blocks[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
            u = u | ((qh & 1) << 4).reshape(rows, cols)
        a = (d * sc.astype(np.float32)).reshape(rows, -1)
        b = (dmin * m.astype(np.float32)).reshape(rows, -1)
        return u.astype(np.int64), a, b
    ql = blocks[..., 0:128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    ql = (ql & 15).reshape(rows, -1, 2, 4, 32)
    qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    u = ql | ((qh & 3) << 4)
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)                   # [R, S, 16]
    d = blocks[..., 208:210].copy().view(np.float16).astype(np.float32)
    return u.reshape(rows, cols).astype(np.int64), (d * sc).reshape(rows, -1), None


def _iq4xs_params(raw: np.ndarray, cols: int):
    """(code values KVALUES[q] [R, cols] int64, a = d * (ls - 32) [R, cols / 32] float32) of IQ4_XS blocks."""
    rows = raw.shape[0]
    blocks = np.asarray(raw).reshape(rows, cols // 256, 136)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)                     # [R, S, 1]
    high = blocks[..., 2:4].copy().view(np.uint16).astype(np.int64)                      # [R, S, 1]
    low = blocks[..., 4:8].astype(np.int64)                                              # [R, S, 4]
    j = np.arange(8)
    ls = ((low[..., j // 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4)   # [R, S, 8]
    a = (d * (ls - 32).astype(np.float32)).reshape(rows, -1)
    qs = blocks[..., 8:].reshape(rows, -1, 8, 1, 16) >> np.array([0, 4], np.uint8)[:, None]
    kv = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int64)
    return kv[(qs & 15).reshape(rows, cols)], a


def krows16_dot(qtype_name: str, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x [T, K] times Q4_K, Q5_K, Q6_K or IQ4_XS blocks raw [R, bytes] (file order) by the arithmetic of engine/kernels/krows16.py:
    per sub-block an exact integer sum of codes times 8-bit activations, then fused multiply-adds, sub-blocks in
    the kernels' order from +0.0."""
    x = np.asarray(x, np.float32)
    cols = x.shape[1]
    xq, dx, sums = quantize_activations(x)
    xq = xq.astype(np.int64)
    acc = np.zeros((x.shape[0], raw.shape[0]), np.float32)
    if qtype_name == "IQ4_XS":                              # sub-blocks of 32 in order: exact sums of values * q
        values, a = _iq4xs_params(raw, cols)
        for kb in range(cols // 32):
            k = slice(32 * kb, 32 * kb + 32)
            acc = fma32((xq[:, k] @ values[:, k].T).astype(np.float32), a[None, :, kb] * dx[:, kb, None], acc)
        return acc
    u, a, b = _kquant_params(qtype_name, raw, cols)
    for s in range(cols // 256):
        if b is not None:                                   # Q4_K, Q5_K: sub-blocks 0 .. 7 of 32 weights
            for j in range(8):
                kb = 8 * s + j
                k = slice(32 * kb, 32 * kb + 32)
                isum = (xq[:, k] @ u[:, k].T).astype(np.float32)
                acc = fma32(isum, a[None, :, kb] * dx[:, kb, None], acc)
                acc = fma32(b[None, :, kb], -(dx[:, kb] * sums[:, kb].astype(np.float32))[:, None], acc)
            continue
        for h in range(2):                                  # Q6_K: 32-blocks 4h + c, c = 0, 2, 1, 3
            for c in (0, 2, 1, 3):
                kb = 8 * s + 4 * h + c
                isum = [xq[:, k] @ u[:, k].T - 32 * xq[:, k].sum(axis=1)[:, None]
                        for k in (slice(32 * kb, 32 * kb + 16), slice(32 * kb + 16, 32 * kb + 32))]
                t = isum[0].astype(np.float32) * a[None, :, 2 * kb]                       # [T, R] float32
                t = fma32(isum[1].astype(np.float32), a[None, :, 2 * kb + 1], t)
                acc = fma32(t, dx[:, kb, None], acc)
    return acc
