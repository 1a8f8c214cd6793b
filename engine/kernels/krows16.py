"""GGUF Q4_K, Q5_K, Q6_K and IQ4_XS matrices with 16 rows interleaved, times 8-bit activations: integer kernels.

The bytes are the file's, reordered per block of 16 rows and per super-block (256 weights) so that one
64-byte vector holds 4 consecutive weight bytes of each of the 16 rows (one row a 32-bit lane, as in
engine/kernels/rows16.py). A matrix keeps its [out, bytes per row] shape and size: the 16 x (bytes per
super-block) bytes of row block rb, super-block s sit where those rows' super-blocks s sat, as

    Q4_K  2304 bytes: d[16], dmin[16] (fp16), 12 byte planes of 16 (plane b: byte b of each row's 6-bit
          sub-scales and sub-mins), then qs: 4 chunks x 8 vectors (vector p of chunk c, lane l: bytes
          4p .. 4p + 3 of row l's 32-byte chunk c; low nibbles sub-block 2c, high nibbles 2c + 1)
    Q5_K  2816 bytes: as Q4_K, with qh's 8 vectors between the planes and qs (vector p, lane l: bytes
          4p .. 4p + 3 of row l's qh, whose bit j is the fifth bit of sub-block j's weight there)
    Q6_K  3360 bytes: d[16] (fp16), 16 planes of 16 int8 sub-scales, ql: 2 halves x 16 vectors (vector p
          of half h: bytes 4p .. 4p + 3 of row l's 64 ql bytes of that half), qh: 2 halves x 8 vectors alike
    IQ4_XS 2176 bytes: d[16] (fp16), scales_h[16] (uint16), scales_l (one vector: lane l, row l's 4 bytes),
          then qs: 8 sub-blocks x 4 vectors (vector p of sub-block j, lane l: bytes 4p .. 4p + 3 of row l's 16;
          low nibbles weights 4p .., high nibbles 16 + 4p ..)

Each token's activations are quantized per 32-block (`rows16.quantize_tokens`: q int8, d_x, and the block's
sum of q). Per sub-block of a row the weights are w = A * u + B exactly (Q4_K, Q5_K: A = d * sc, B = -(dmin * m),
u < 16 or 32; Q6_K: A = d * sc, u - 32 with u < 64, sub-blocks of 16; IQ4_XS: A = d * (ls - 32), u = KVALUES[code],
looked up per byte as u + 128), and the kernels accumulate from +0.0,
sub-blocks in the order listed below, one fixed sequence for any count of tokens, rows or threads:

    Q4_K, Q5_K  acc = fma(float(sum_k u q), A * d_x, acc);  acc = fma(dmin * m, -(d_x * float(sum_k q)), acc)
          sub-blocks 0, 1, ..., 7 of each super-block
    Q6_K  per 32-block: t = float(sum_k u q - 32 * sum_k q) * A over its first 16 weights,
          t = fma(float(the same over its last 16), A', t), acc = fma(t, d_x, acc)
          32-blocks 4h + c of each super-block for h in (0, 1), c in (0, 2, 1, 3)
    IQ4_XS  acc = fma(float(sum_k u q), A * d_x, acc)  sub-blocks 0, 1, ..., 7 of each super-block

The integer sums are exact, and A, dmin * m are exact float32 products (the values gguf's dequantization
multiplies by), so the dequantized weights stay the file's bit for bit; only the activations are rounded,
as llama.cpp's own K-quant products round them.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import literally, njit, prange

from engine.kernels.layout import BLOCK
from engine.kernels.rows16 import put_tokens, sums16, token_slot
from engine.kernels.simd import U64, prefetch, stack_block, vfma, vloadf, vmul, vsplat, vstore, vzero
from engine.kernels.simd_int import (
    vbytes,
    vdot_bcast,
    vfield,
    vhalf_f,
    visplat,
    vitof,
    vizero,
    vlut_bytes,
    vmerge,
    vnibbles,
    vsigned_f,
    vsub_splat,
    vwiden,
    vwiden16,
)

ROWS = 16
SUPER = 256
KROWS16 = 128             # or-ed into a K-quant kind (12 Q4_K, 13 Q5_K, 14 Q6_K, 23 IQ4_XS) for this layout
Q4_K, Q5_K, Q6_K, IQ4_XS = 12, 13, 14, 23
KINDS = (Q4_K, Q5_K, Q6_K, IQ4_XS)
SUPER_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210, IQ4_XS: 136}
# IQ4_XS's non-linear code values plus 128: unsigned bytes for the byte products (which then overcount 128 * sum q)
KV128 = tuple(v + 128 for v in (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113))
PREFETCH_AHEAD = 4096
F32 = np.float32


# -- the layout (numpy, load time) -------------------------------------------------------------------

def allowed(kind: int, out: int) -> bool:
    """Whether a matrix of this K-quant kind and `out` rows can take the layout (Q4_K, Q5_K, Q6_K, IQ4_XS; whole
    16-row blocks)."""
    return kind in KINDS and out % ROWS == 0


# per super-block of one row: (first byte, end, bytes kept together); a field's bytes go [run][row][bytes of the run]
_FIELDS = {Q4_K: ((0, 4, 2), (4, 16, 1), (16, 144, 4)),
           Q5_K: ((0, 4, 2), (4, 16, 1), (16, 48, 4), (48, 176, 4)),
           Q6_K: ((208, 210, 2), (192, 208, 1), (0, 128, 4), (128, 192, 4)),
           IQ4_XS: ((0, 2, 2), (2, 4, 2), (4, 8, 4), (8, 136, 4))}


@njit(parallel=True, cache=True, boundscheck=False)
def _permute(src, dst, out, width, sb, fields, back):
    """File-order blocks src -> rows16 dst (or, with `back`, rows16 src -> file order dst); flat [out * width]."""
    nsb = width // sb
    for rb in prange(out // ROWS):
        for s in range(nsb):
            region = (rb * nsb + s) * ROWS * sb
            at = 0
            for f in range(fields.shape[0]):
                start, end, run = fields[f, 0], fields[f, 1], fields[f, 2]
                for lane in range(ROWS):
                    row = (rb * ROWS + lane) * width + s * sb + start
                    for p in range((end - start) // run):
                        o = region + at + (p * ROWS + lane) * run
                        i = row + p * run
                        if back:
                            o, i = i, o
                        dst[o] = src[i]          # runs of 1, 2 or 4 bytes, written out rather than looped over
                        if run > 1:
                            dst[o + 1] = src[i + 1]
                        if run > 2:
                            dst[o + 2] = src[i + 2]
                            dst[o + 3] = src[i + 3]
                at += ROWS * (end - start)


def _permuted(kind: int, raw: np.ndarray, back: bool) -> np.ndarray:
    out, width = raw.shape
    src = np.ascontiguousarray(raw)
    dst = np.empty_like(src)
    _permute(src.reshape(-1), dst.reshape(-1), out, width, SUPER_BYTES[kind], np.array(_FIELDS[kind], np.int64), back)
    return dst


def to_krows16(kind: int, raw: np.ndarray) -> np.ndarray:
    """A K-quant matrix's blocks [out, bytes per row] (file order) -> the same bytes in this layout (a copy)."""
    return _permuted(kind, raw, False)


def from_krows16(kind: int, raw: np.ndarray) -> np.ndarray:
    """The inverse of `to_krows16` (a copy)."""
    return _permuted(kind, raw, True)


# -- kernels -----------------------------------------------------------------------------------------

@njit(boundscheck=False, inline="always")
def _dot4(init, v0, v1, v2, v3, q, qo):
    """init plus, per lane, the exact sum over 16 weights: vector p's 4 bytes times q[qo + 4p ...]."""
    isum = vdot_bcast(init, v0, q, qo)
    isum = vdot_bcast(isum, v1, q, qo + U64(4))
    isum = vdot_bcast(isum, v2, q, qo + U64(8))
    return vdot_bcast(isum, v3, q, qo + U64(12))


@njit(boundscheck=False, inline="always")
def _dot8(v0, v1, v2, v3, v4, v5, v6, v7, q, qo):
    """Per lane the exact sum over 32 weights: vector p's 4 bytes times q[qo + 4p ...]."""
    return _dot4(_dot4(vizero(), v0, v1, v2, v3, q, qo), v4, v5, v6, v7, q, qo + U64(16))


@njit(inline="always")
def _pick(t, a0, a1, a2, a3):
    """Token slot t's accumulator of four (kernels loop over their tokens rather than unroll: see _q4k)."""
    return a0 if t == 0 else a1 if t == 1 else a2 if t == 2 else a3


@njit(inline="always")
def _place(t, acc, a0, a1, a2, a3):
    """The four accumulators with slot t's replaced by acc."""
    if t == 0:
        return acc, a1, a2, a3
    if t == 1:
        return a0, acc, a2, a3
    if t == 2:
        return a0, a1, acc, a3
    return a0, a1, a2, acc


@njit(boundscheck=False, inline="always")
def _q4k_sub(v0, v1, v2, v3, v4, v5, v6, v7, q, qo, a, b, dx, sq, acc):
    """One 32-weight sub-block of 16 rows for one token (a = d * sc, b = dmin * m per lane)."""
    isum = _dot8(v0, v1, v2, v3, v4, v5, v6, v7, q, qo)
    acc = vfma(vitof(isum), vmul(a, vsplat(dx)), acc)
    return vfma(b, vsplat(-(dx * F32(sq))), acc)


@njit(boundscheck=False, inline="always")
def _q6k_block(v0, v1, v2, v3, v4, v5, v6, v7, q, qo, a0, a1, dx, s0, s1, acc):
    """One 32-weight block of 16 rows for one token: two sub-blocks of 16 (vectors v0-v3 and v4-v7, a0 and a1 =
    d * sc per lane, s0 and s1 = -32 times their 16 q's sums, as `rows16.sums16` keeps them)."""
    i0 = _dot4(visplat(s0), v0, v1, v2, v3, q, qo)
    i1 = _dot4(visplat(s1), v4, v5, v6, v7, q, qo + U64(16))
    return vfma(vfma(vitof(i1), a1, vmul(vitof(i0), a0)), vsplat(dx), acc)


@njit(boundscheck=False)
def _q4k_scales(raw, so, sbuf):
    """sbuf[16 j ...] = d * sc[j], sbuf[16 (8 + j) ...] = dmin * m[j] for the 16 rows of super-block bytes `so`."""
    d = vhalf_f(raw, so)
    dmin = vhalf_f(raw, so + U64(32))
    po = so + U64(64)
    for j in range(4):
        lo = vwiden(raw, po + U64(16 * j))
        mid = vwiden(raw, po + U64(16 * (j + 4)))
        hi = vwiden(raw, po + U64(16 * (j + 8)))
        vstore(sbuf, U64(16 * j), vmul(d, vitof(vfield(lo, 0, 63))))
        vstore(sbuf, U64(16 * (8 + j)), vmul(dmin, vitof(vfield(mid, 0, 63))))
        vstore(sbuf, U64(16 * (4 + j)), vmul(d, vitof(vmerge(vfield(hi, 0, 15), vfield(lo, 6, 3), 4))))
        vstore(sbuf, U64(16 * (12 + j)), vmul(dmin, vitof(vmerge(vfield(hi, 4, 15), vfield(mid, 6, 3), 4))))


@njit(boundscheck=False, inline="always")
def _q45_token(l0, l1, l2, l3, l4, l5, l6, l7, h0, h1, h2, h3, h4, h5, h6, h7, q, qo, alo, blo, ahi, bhi, dq, sq, o,
               acc):
    """Both sub-blocks of a chunk (codes l, then h, 32 weights apart) for one token."""
    acc = _q4k_sub(l0, l1, l2, l3, l4, l5, l6, l7, q, qo, alo, blo, dq[o], sq[o], acc)
    return _q4k_sub(h0, h1, h2, h3, h4, h5, h6, h7, q, qo + U64(32), ahi, bhi, dq[o + 1], sq[o + 1], acc)


@njit(boundscheck=False, inline="always")
def _q45_codes(five, raw, wo, hb, c, p):
    """Codes (u < 16, or < 32 for Q5_K) of vector p of chunk c: sub-blocks 2c (low nibbles) and 2c + 1 (high)."""
    lo, hi = vnibbles(raw, wo + U64(64 * p))
    if five:                   # the fifth bit of sub-block j's weight is bit j of the qh byte at the same place
        h = vbytes(raw, hb + U64(64 * p))
        lo = vmerge(lo, vfield(h, 2 * c, 0x01010101), 4)
        hi = vmerge(hi, vfield(h, 2 * c + 1, 0x01010101), 4)
    return lo, hi


@njit(boundscheck=False)
def _q4k(five, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0, q, dq, sq, pre):
    """Q4_K, or with `five` Q5_K (a plane of fifth bits before the nibbles)."""
    literally(five)
    nsb = K // SUPER
    nb = K // BLOCK
    block = ROWS * (176 if five else 144)
    qs = 768 if five else 256                 # where the nibbles start in a row block's super-block
    buf = numba.carray(stack_block(), 128, np.float32)
    sbuf = np.empty(256, np.float32)
    rb0 = r0 // ROWS
    rb1 = (r0 + nr + ROWS - 1) // ROWS
    for t0 in range(i0, i1, 4):
        tn = min(4, i1 - t0)
        base = token_slot(pre, x, xrows, t0, tn, K, q, dq, sq)
        for rb in range(rb0, rb1):
            a0 = vzero()
            a1 = vzero()
            a2 = vzero()
            a3 = vzero()
            for s in range(nsb):
                so = (U64(rb) * U64(nsb) + U64(s)) * U64(block)
                _q4k_scales(raw, so, sbuf)
                hb = so + U64(256)
                for c in range(4):
                    wo = so + U64(qs + 512 * c)
                    for line in range(0, 512, 64):
                        prefetch(raw, wo + U64(PREFETCH_AHEAD + line))
                    l0, h0 = _q45_codes(five, raw, wo, hb, c, 0)
                    l1, h1 = _q45_codes(five, raw, wo, hb, c, 1)
                    l2, h2 = _q45_codes(five, raw, wo, hb, c, 2)
                    l3, h3 = _q45_codes(five, raw, wo, hb, c, 3)
                    l4, h4 = _q45_codes(five, raw, wo, hb, c, 4)
                    l5, h5 = _q45_codes(five, raw, wo, hb, c, 5)
                    l6, h6 = _q45_codes(five, raw, wo, hb, c, 6)
                    l7, h7 = _q45_codes(five, raw, wo, hb, c, 7)
                    j = 2 * c
                    alo = vloadf(sbuf, U64(16 * j))
                    blo = vloadf(sbuf, U64(16 * (8 + j)))
                    ahi = vloadf(sbuf, U64(16 * (j + 1)))
                    bhi = vloadf(sbuf, U64(16 * (9 + j)))
                    for t in range(tn):          # a loop, not unrolled: the compiler keeps the codes in registers
                        qo = U64((base + t) * K + SUPER * s + 64 * c)
                        o = (base + t) * nb + 8 * s + j
                        acc = _pick(t, a0, a1, a2, a3)
                        acc = _q45_token(l0, l1, l2, l3, l4, l5, l6, l7, h0, h1, h2, h3, h4, h5, h6, h7, q, qo, alo,
                                         blo, ahi, bhi, dq, sq, o, acc)
                        a0, a1, a2, a3 = _place(t, acc, a0, a1, a2, a3)
            put_tokens(a0, a1, a2, a3, tn, t0, rb, r0, nr, out, orows, ldo, col0, buf)


@njit(boundscheck=False, inline="always")
def _q6k_codes(raw, lo, qh, i, pair):
    """Code vectors (u < 64) of the weight sets whose low nibbles sit in the ql vector at `lo` with the crumbs at
    `qh`: sets 0 and 2 (pair 0: the low and high nibbles, crumbs 0 and 2) or sets 1 and 3 (pair 1: crumbs 1 and 3)."""
    a = vbytes(raw, lo + U64(64 * i))
    hb = vbytes(raw, qh + U64(64 * i))
    return (vmerge(vfield(a, 0, 0x0F0F0F0F), vfield(hb, 2 * pair, 0x03030303), 4),
            vmerge(vfield(a, 4, 0x0F0F0F0F), vfield(hb, 4 + 2 * pair, 0x03030303), 4))


@njit(boundscheck=False, inline="always")
def _q6k_token(c0, c1, c2, c3, c4, c5, c6, c7, d0, d1, d2, d3, d4, d5, d6, d7, q, w, K, nb, n16, t, dq, s16, a00,
               a01, a10, a11, acc):
    """Both weight sets of a pair (32 weights apart in codes c, 64 in the token's weights, the first at weight w of
    token slot 0) for the token in slot t."""
    qo = U64(t * K + w)
    xb = t * nb + w // BLOCK
    xs = t * n16 + w // 16
    acc = _q6k_block(c0, c1, c2, c3, c4, c5, c6, c7, q, qo, a00, a01, dq[xb], s16[xs], s16[xs + 1], acc)
    return _q6k_block(d0, d1, d2, d3, d4, d5, d6, d7, q, qo + U64(64), a10, a11, dq[xb + 2], s16[xs + 4],
                      s16[xs + 5], acc)


@njit(boundscheck=False)
def _q6k(raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0, q, dq, sq, s16, pre):
    nsb = K // SUPER
    nb = K // BLOCK
    n16 = K // 16
    block = ROWS * 210
    buf = numba.carray(stack_block(), 128, np.float32)
    rb0 = r0 // ROWS
    rb1 = (r0 + nr + ROWS - 1) // ROWS
    step = 8 if pre else 4                # tokens per pass over the weights (8 when quantized beforehand)
    for t0 in range(i0, i1, step):
        tn = min(step, i1 - t0)
        base = token_slot(pre, x, xrows, t0, tn, K, q, dq, sq)
        if not pre:
            sums16(q, 0, tn, K, s16)
        for rb in range(rb0, rb1):
            a0 = vzero()
            a1 = vzero()
            a2 = vzero()
            a3 = vzero()
            a4 = vzero()
            a5 = vzero()
            a6 = vzero()
            a7 = vzero()
            for s in range(nsb):
                so = (U64(rb) * U64(nsb) + U64(s)) * U64(block)
                d = vhalf_f(raw, so)
                for line in range(0, block, 64):
                    prefetch(raw, so + U64(PREFETCH_AHEAD + line))
                for h in range(2):
                    qh = so + U64(2336 + 512 * h)
                    for pair in range(2):
                        lo = so + U64(288 + 1024 * h + 512 * pair)
                        c0, e0 = _q6k_codes(raw, lo, qh, 0, pair)
                        c1, e1 = _q6k_codes(raw, lo, qh, 1, pair)
                        c2, e2 = _q6k_codes(raw, lo, qh, 2, pair)
                        c3, e3 = _q6k_codes(raw, lo, qh, 3, pair)
                        c4, e4 = _q6k_codes(raw, lo, qh, 4, pair)
                        c5, e5 = _q6k_codes(raw, lo, qh, 5, pair)
                        c6, e6 = _q6k_codes(raw, lo, qh, 6, pair)
                        c7, e7 = _q6k_codes(raw, lo, qh, 7, pair)
                        j = 8 * h + 2 * pair                       # sub-block of the first set's first 16 weights
                        sc = so + U64(32 + 16 * j)
                        a00 = vmul(d, vsigned_f(raw, sc))
                        a01 = vmul(d, vsigned_f(raw, sc + U64(16)))
                        a10 = vmul(d, vsigned_f(raw, sc + U64(64)))
                        a11 = vmul(d, vsigned_f(raw, sc + U64(80)))
                        w = base * K + SUPER * s + 128 * h + 32 * pair   # the first set's first weight
                        a0 = _q6k_token(c0, c1, c2, c3, c4, c5, c6, c7, e0, e1, e2, e3, e4, e5, e6, e7, q, w, K, nb,
                                        n16, 0, dq, s16, a00, a01, a10, a11, a0)
                        if tn > 1:
                            a1 = _q6k_token(c0, c1, c2, c3, c4, c5, c6, c7, e0, e1, e2, e3, e4, e5, e6, e7, q, w, K,
                                            nb, n16, 1, dq, s16, a00, a01, a10, a11, a1)
                        if tn > 2:
                            a2 = _q6k_token(c0, c1, c2, c3, c4, c5, c6, c7, e0, e1, e2, e3, e4, e5, e6, e7, q, w, K,
                                            nb, n16, 2, dq, s16, a00, a01, a10, a11, a2)
                        if tn > 3:
                            a3 = _q6k_token(c0, c1, c2, c3, c4, c5, c6, c7, e0, e1, e2, e3, e4, e5, e6, e7, q, w, K,
                                            nb, n16, 3, dq, s16, a00, a01, a10, a11, a3)
                        if tn > 4:
                            a4 = _q6k_token(c0, c1, c2, c3, c4, c5, c6, c7, e0, e1, e2, e3, e4, e5, e6, e7, q, w, K,
                                            nb, n16, 4, dq, s16, a00, a01, a10, a11, a4)
                        if tn > 5:
                            a5 = _q6k_token(c0, c1, c2, c3, c4, c5, c6, c7, e0, e1, e2, e3, e4, e5, e6, e7, q, w, K,
                                            nb, n16, 5, dq, s16, a00, a01, a10, a11, a5)
                        if tn > 6:
                            a6 = _q6k_token(c0, c1, c2, c3, c4, c5, c6, c7, e0, e1, e2, e3, e4, e5, e6, e7, q, w, K,
                                            nb, n16, 6, dq, s16, a00, a01, a10, a11, a6)
                        if tn > 7:
                            a7 = _q6k_token(c0, c1, c2, c3, c4, c5, c6, c7, e0, e1, e2, e3, e4, e5, e6, e7, q, w, K,
                                            nb, n16, 7, dq, s16, a00, a01, a10, a11, a7)
            put_tokens(a0, a1, a2, a3, min(tn, 4), t0, rb, r0, nr, out, orows, ldo, col0, buf)
            if tn > 4:
                put_tokens(a4, a5, a6, a7, tn - 4, t0 + 4, rb, r0, nr, out, orows, ldo, col0, buf)


@njit(boundscheck=False, inline="always")
def _iq4_sub(v0, v1, v2, v3, v4, v5, v6, v7, q, qo, a, dx, sq, acc):
    """One 32-weight sub-block of 16 rows for one token: looked-up bytes KV128[code], a = d * (ls - 32) per lane."""
    isum = vsub_splat(_dot8(v0, v1, v2, v3, v4, v5, v6, v7, q, qo), 128 * sq)
    return vfma(vitof(isum), vmul(a, vsplat(dx)), acc)


@njit(boundscheck=False)
def _iq4xs(raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0, q, dq, sq, pre):
    nsb = K // SUPER
    nb = K // BLOCK
    block = ROWS * 136
    buf = numba.carray(stack_block(), 128, np.float32)
    rb0 = r0 // ROWS
    rb1 = (r0 + nr + ROWS - 1) // ROWS
    for t0 in range(i0, i1, 4):
        tn = min(4, i1 - t0)
        base = token_slot(pre, x, xrows, t0, tn, K, q, dq, sq)
        for rb in range(rb0, rb1):
            a0 = vzero()
            a1 = vzero()
            a2 = vzero()
            a3 = vzero()
            for s in range(nsb):
                so = (U64(rb) * U64(nsb) + U64(s)) * U64(block)
                d = vhalf_f(raw, so)
                high = vwiden16(raw, so + U64(32))         # scales_h: bits 2j, 2j + 1 for sub-block j
                low = vbytes(raw, so + U64(64))            # scales_l: nibble j (from bit 4j) for sub-block j
                for line in range(0, block, 64):
                    prefetch(raw, so + U64(PREFETCH_AHEAD + line))
                for j in range(8):
                    ls = vmerge(vfield(low, 4 * j, 15), vfield(high, 2 * j, 3), 4)
                    a = vmul(d, vitof(vsub_splat(ls, 32)))
                    wo = so + U64(128 + 256 * j)
                    l0, h0 = vnibbles(raw, wo)
                    l1, h1 = vnibbles(raw, wo + U64(64))
                    l2, h2 = vnibbles(raw, wo + U64(128))
                    l3, h3 = vnibbles(raw, wo + U64(192))
                    v0 = vlut_bytes(l0, KV128)
                    v1 = vlut_bytes(l1, KV128)
                    v2 = vlut_bytes(l2, KV128)
                    v3 = vlut_bytes(l3, KV128)
                    v4 = vlut_bytes(h0, KV128)
                    v5 = vlut_bytes(h1, KV128)
                    v6 = vlut_bytes(h2, KV128)
                    v7 = vlut_bytes(h3, KV128)
                    for t in range(tn):          # a loop, as Q4_K's: the compiler keeps the codes in registers
                        qo = U64((base + t) * K + SUPER * s + 32 * j)
                        o = (base + t) * nb + 8 * s + j
                        acc = _pick(t, a0, a1, a2, a3)
                        acc = _iq4_sub(v0, v1, v2, v3, v4, v5, v6, v7, q, qo, a, dq[o], sq[o], acc)
                        a0, a1, a2, a3 = _place(t, acc, a0, a1, a2, a3)
            put_tokens(a0, a1, a2, a3, tn, t0, rb, r0, nr, out, orows, ldo, col0, buf)


@njit(boundscheck=False)
def krows16_rows(kind, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0):
    """Rows r0 .. r0 + nr - 1 of a Q4_K, Q5_K, Q6_K or IQ4_XS matrix in this layout (`kind`: its K-quant kind | KROWS16) times
    tokens i0 .. i1 - 1 -> out[orows[i] * ldo + col0 + row - r0]. Row blocks cut by r0 or r0 + nr are computed
    whole and stored in part."""
    nb = K // BLOCK
    q, dq, sq = np.empty(4 * K, np.int8), np.empty(4 * nb, np.float32), np.empty(4 * nb, np.int32)
    s16 = np.empty(4 * K // 16 if kind & 127 == Q6_K else 0, np.int32)
    krows16_rows_pre(kind, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0, q, dq, sq, s16, False)


@njit(boundscheck=False)
def krows16_rows_pre(kind, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0, q, dq, sq, s16, pre):
    """`krows16_rows` on tokens quantized beforehand when `pre` (`rows16.quantize_token`, with the sums of 16 for
    Q6_K); without `pre`, q, dq, sq, s16 are room for the tokens quantized from x as they come."""
    if kind & 127 == Q4_K:
        _q4k(False, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0, q, dq, sq, pre)
    elif kind & 127 == Q5_K:
        _q4k(True, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0, q, dq, sq, pre)
    elif kind & 127 == IQ4_XS:
        _iq4xs(raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0, q, dq, sq, pre)
    else:
        _q6k(raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0, q, dq, sq, s16, pre)
