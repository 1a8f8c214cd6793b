"""numba matmul kernels for quantized and float32 weights, bitwise invariant to batch and threads.

Every output element y[t, r] = sum_k w[r, k] * x[t, k] is computed by one fixed sequence of
float32 operations, whatever the number of tokens, the tiling or the thread count:

    w[r, k] = fma(u, d, m)                   the dequantized weight (exact for symmetric formats)
    lane[j] = fma(w[r, k], x[t, k], lane[j])  for k = j, j + 16, j + 32, ... (16 lanes, from +0.0)
    y       = vsum(lane)                     a fixed reduction tree (engine/kernels/simd.py)
    y       = fma(w[r, k], x[t, k], y)       for each k past the last multiple of 16 (fp32 only)

Decode (up to OTF_MAX_TOKENS tokens) dequantizes on the fly, 4 rows at a time (4 independent
accumulators hide the FMA latency); prefill dequantizes 4 rows into a float32 scratch tile once
and runs a 4 x 4 (rows x tokens) register tile over the tokens. Both give the same bits (tested).

The loops over packed codes are compiled once per bit width (`literally(bits)`), and the decode
loops also once per kind (symmetric or not, `literally(asym)`), so no format test is left inside
them: LLVM does not reliably hoist such a test out of loops this large, and one left in
decode's group loop is a large share of its time. Decode of 4-bit widens each
block's 16 code bytes once for both halves: the table lookup reads only an index's low 4 bits.
Kernels take flat (1-D) arrays and explicit sizes; token i of a call reads x row xrows[i] and
writes out row orows[i], so that the fused experts run any subset of a batch without gathering.

numba keys a cached kernel on its own file only; engine/jit_cache.py stamps every engine kernel with all the
engine sources instead, so editing a linked file (simd.py, this one) recompiles whatever links it.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import literally, njit, prange

from engine.kernels.layout import BLOCK, ROWS16_FLAG
from engine.kernels.rows16 import quantize_token, rows16_dequant, rows16_rows, rows16_rows_pre
from engine.kernels.simd import (
    HAS_AVX512,
    U64,
    address_as_voidptr,
    f16_to_f32,
    fma32,
    prefetch,
    stack_block,
    vcodes2,
    vcodes3,
    vcodes4,
    vcodes5,
    vcodes6,
    vcodes8,
    vfma,
    vhalves,
    viota,
    vload,
    vlookup,
    vlookup16,
    vlookup16n,
    vmul,
    vsplat,
    vsrl4,
    vstore,
    vsum,
    vtofloat,
    vzero,
)

F32 = np.float32
TILE = 4            # rows per register tile (and tokens per tile in the prefill path)
# at most this many tokens: dequantize on the fly instead of via a scratch tile (measured). With 8 lanes (AVX2) two
# tokens already run faster through the 2 x 3 tile: dequantized once, not once per token
OTF_MAX_TOKENS = 2 if HAS_AVX512 else 1


# -- dequantization of one block half -------------------------------------------------------
# A weight is fma(u, d, m). Up to 5 bits the 2**bits values of a group are computed once into a
# table and looked up per lane (one permute on AVX-512 instead of a conversion and an fma per
# lane: the same float32 values); 6 and 8 bits convert and fma per lane.

@njit
def _codes(bits, a, ao, b, bo, half):
    """16 integer codes of one block half, for any bit width."""
    if bits == 4:
        return vcodes4(a, ao, b, bo, half)
    if bits == 8:
        return vcodes8(a, ao, b, bo, half)
    if bits == 6:
        return vcodes6(a, ao, b, bo, half)
    if bits == 5:
        return vcodes5(a, ao, b, bo, half)
    if bits == 3:
        return vcodes3(a, ao, b, bo, half)
    return vcodes2(a, ao, b, bo, half)


@njit
def _block_bytes(bits):
    """(plane a, plane b) bytes per 32-weight block."""
    if bits == 8:
        return 32, 0
    if bits == 6:
        return 16, 8
    if bits == 5:
        return 16, 4
    if bits == 4:
        return 16, 0
    if bits == 3:
        return 8, 4
    return 8, 0


@njit
def _uses_table(bits):
    return HAS_AVX512 and bits <= 5


@njit
def _tables(bits, asym, d, m):
    """(values of codes 0-15, values of codes 16-31) of a group with scale d and offset m (lanes).

    Symmetric: (u - 2**(bits-1)) * d, one multiply; it is exact, so it equals fma(u, d, m) bit for bit.
    """
    iota = viota()
    if not asym:
        neg = F32(-(1 << (bits - 1)))
        low = vmul(vfma(iota, vsplat(F32(1.0)), vsplat(neg)), d)
        if bits == 5:
            return low, vmul(iota, d)
        return low, low
    low = vfma(iota, d, m)
    if bits == 5:
        return low, vfma(vfma(iota, vsplat(F32(1.0)), vsplat(F32(16.0))), d, m)
    return low, low


@njit
def _dq(bits, a, b, r, blk, nb, half, d, m, low, high):
    """Dequantized lanes of row r, block blk, half `half`: fma(u, d, m) (looked up in the group's table)."""
    ab, bb = _block_bytes(bits)
    rb = U64(r) * U64(nb) + U64(blk)
    codes = _codes(bits, a, rb * U64(ab), b, rb * U64(bb), half)
    if _uses_table(bits):
        return vlookup(low, high, codes) if bits == 5 else vlookup16(low, codes)
    return vfma(vtofloat(codes), d, m)


@njit
def _block(bits, a, b, r, blk, nb, d, m, low, high, xa, xb, acc):
    """acc plus the 32 weights of row r, block blk, times xa (weights 0-15) and xb (16-31), one fma per lane each."""
    if bits == 4 and _uses_table(bits):
        # one load and widening of the 16 code bytes serves both halves: the lookup reads an index's low
        # 4 bits, so a widened byte indexes its low nibble as it is and, shifted, its high nibble
        c = vcodes8(a, (U64(r) * U64(nb) + U64(blk)) * U64(16), a, U64(0), 0)
        acc = vfma(vlookup16n(low, c), xa, acc)
        return vfma(vlookup16n(low, vsrl4(c)), xb, acc)
    acc = vfma(_dq(bits, a, b, r, blk, nb, 0, d, m, low, high), xa, acc)
    return vfma(_dq(bits, a, b, r, blk, nb, 1, d, m, low, high), xb, acc)


@njit
def _scale(bits, asym, sc, mn, gi):
    """(d, m) of flat group index gi as float32 scalars."""
    d = f16_to_f32(sc[gi])
    return d, f16_to_f32(mn[gi]) if asym else d * F32(-(1 << (bits - 1)))


@njit(cache=True, boundscheck=False)
def dequant_rows(bits, asym, group, a, b, sc, mn, K, r0, nr, dst):
    """Rows r0 .. r0 + nr - 1 of a quantized matrix -> dst[i * K + k], float32 (the kernels' values)."""
    if bits & ROWS16_FLAG:
        rows16_dequant(bits, group, a, sc, K, r0, nr, dst)
    elif bits == 4:  # a constant width: _dequant_rows is compiled once per width
        _dequant_rows(4, asym, group, a, b, sc, mn, K, r0, nr, dst)
    elif bits == 8:
        _dequant_rows(8, asym, group, a, b, sc, mn, K, r0, nr, dst)
    elif bits == 6:
        _dequant_rows(6, asym, group, a, b, sc, mn, K, r0, nr, dst)
    elif bits == 5:
        _dequant_rows(5, asym, group, a, b, sc, mn, K, r0, nr, dst)
    elif bits == 3:
        _dequant_rows(3, asym, group, a, b, sc, mn, K, r0, nr, dst)
    else:
        _dequant_rows(2, asym, group, a, b, sc, mn, K, r0, nr, dst)


@njit(boundscheck=False)
def _dequant_rows(bits, asym, group, a, b, sc, mn, K, r0, nr, dst):
    literally(bits)
    nb = K // BLOCK
    ng = K // group
    bpg = group // BLOCK
    buf = numba.carray(stack_block(), 128, np.float32)    # [d, m][16 groups]
    neg = F32(-(1 << (bits - 1)))
    for i in range(nr):
        r = r0 + i
        base = U64(i) * U64(K)
        for gc in range(0, ng, 16):
            # the scales of 16 groups converted at once, as decode does (one scalar conversion per group cost a
            # batch's tiles most of their time)
            n16 = min(16, ng - gc)
            gi = U64(r) * U64(ng) + U64(gc)
            d16 = vhalves(sc, gi, n16)
            vstore(buf, U64(0), d16)
            vstore(buf, U64(16), vhalves(mn, gi, n16) if asym else vmul(d16, vsplat(neg)))
            for q in range(n16):
                g = gc + q
                d = vsplat(buf[U64(q)])
                m = vsplat(buf[U64(16 + q)])
                low, high = _tables(bits, asym, d, m)
                for blk in range(g * bpg, (g + 1) * bpg):
                    o = base + U64(blk * BLOCK)
                    if bits == 4 and _uses_table(bits):          # a block's code bytes widened once (see _block)
                        c = vcodes8(a, (U64(r) * U64(nb) + U64(blk)) * U64(16), a, U64(0), 0)
                        vstore(dst, o, vlookup16n(low, c))
                        vstore(dst, o + U64(16), vlookup16n(low, vsrl4(c)))
                    else:
                        vstore(dst, o, _dq(bits, a, b, r, blk, nb, 0, d, m, low, high))
                        vstore(dst, o + U64(16), _dq(bits, a, b, r, blk, nb, 1, d, m, low, high))


# -- decode: dequantize on the fly ----------------------------------------------------------

@njit(boundscheck=False)
def otf_rows(bits, asym, group, a, b, sc, mn, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0):
    """Quantized rows r0 .. r0 + nr - 1 times tokens i0 .. i1 - 1 -> out[orows[i] * ldo + col0 + row - r0].

    Four rows at a time (four independent accumulators hide the fma latency); rows16 matrices by their own kernel.
    """
    if bits & ROWS16_FLAG:
        rows16_rows(bits, group, a, sc, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)
    elif asym:  # a constant width and kind: _otf_rows is compiled once per (width, symmetric or not)
        _otf_width(True, bits, group, a, b, sc, mn, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)
    else:
        _otf_width(False, bits, group, a, b, sc, mn, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)


@njit(boundscheck=False)
def _otf_width(asym, bits, group, a, b, sc, mn, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0):
    literally(asym)
    if bits == 4:
        _otf_rows(4, asym, group, a, b, sc, mn, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)
    elif bits == 8:
        _otf_rows(8, asym, group, a, b, sc, mn, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)
    elif bits == 6:
        _otf_rows(6, asym, group, a, b, sc, mn, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)
    elif bits == 5:
        _otf_rows(5, asym, group, a, b, sc, mn, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)
    elif bits == 3:
        _otf_rows(3, asym, group, a, b, sc, mn, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)
    else:
        _otf_rows(2, asym, group, a, b, sc, mn, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)


@njit
def _splats(bits, asym, sc, mn, r, g, ng):
    """(d, m) lanes of row r, group g."""
    ds, ms = _scale(bits, asym, sc, mn, U64(r) * U64(ng) + U64(g))
    return vsplat(ds), vsplat(ms)


@njit(boundscheck=False)
def _otf_rows(bits, asym, group, a, b, sc, mn, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0):
    literally(bits)
    literally(asym)
    nb = K // BLOCK
    ng = K // group
    bpg = group // BLOCK
    buf = numba.carray(stack_block(), 128, np.float32)    # [row 0..3][d, m][16 groups]
    neg = F32(-(1 << (bits - 1)))
    ab, bb = _block_bytes(bits)
    r = r0
    while r < r0 + nr:
        rows = min(4, r0 + nr - r)
        for i in range(i0, i1):
            xo = U64(xrows[i]) * U64(K)
            o = U64(orows[i]) * U64(ldo) + U64(col0 + r - r0)
            if rows == 4:
                a0 = vzero()
                a1 = vzero()
                a2 = vzero()
                a3 = vzero()
                for gc in range(0, ng, 16):
                    # scales of 16 groups of the 4 rows converted at once into the stack buffer, so
                    # that each group below only broadcasts them from memory
                    n16 = min(16, ng - gc)
                    prefetch(sc, U64(r + 4) * U64(ng) + U64(gc * 4))
                    for j in range(4):
                        gi = U64(r + j) * U64(ng) + U64(gc)
                        d = vhalves(sc, gi, n16)
                        vstore(buf, U64(32 * j), d)
                        vstore(buf, U64(32 * j + 16), vhalves(mn, gi, n16) if asym else vmul(d, vsplat(neg)))
                    for q in range(n16):
                        g = gc + q
                        d0 = vsplat(buf[U64(q)])
                        m0 = vsplat(buf[U64(16 + q)])
                        d1 = vsplat(buf[U64(32 + q)])
                        m1 = vsplat(buf[U64(48 + q)])
                        d2 = vsplat(buf[U64(64 + q)])
                        m2 = vsplat(buf[U64(80 + q)])
                        d3 = vsplat(buf[U64(96 + q)])
                        m3 = vsplat(buf[U64(112 + q)])
                        lo0, hi0 = _tables(bits, asym, d0, m0)
                        lo1, hi1 = _tables(bits, asym, d1, m1)
                        lo2, hi2 = _tables(bits, asym, d2, m2)
                        lo3, hi3 = _tables(bits, asym, d3, m3)
                        for blk in range(g * bpg, (g + 1) * bpg):
                            # the next 4 rows' codes are contiguous: fetch a block's share of them ahead
                            # (the hardware prefetcher alone left decode stalling on RAM: 1.5-2x slower)
                            ahead = U64(r + 4) * U64(nb * ab) + U64(blk * 4 * ab)
                            prefetch(a, ahead)
                            if ab == 32:
                                prefetch(a, ahead + U64(64))
                            if bb > 0:
                                prefetch(b, U64(r + 4) * U64(nb * bb) + U64(blk * 4 * bb))
                            xa = vload(x, xo + U64(blk * BLOCK))
                            xb = vload(x, xo + U64(blk * BLOCK + 16))
                            a0 = _block(bits, a, b, r, blk, nb, d0, m0, lo0, hi0, xa, xb, a0)
                            a1 = _block(bits, a, b, r + 1, blk, nb, d1, m1, lo1, hi1, xa, xb, a1)
                            a2 = _block(bits, a, b, r + 2, blk, nb, d2, m2, lo2, hi2, xa, xb, a2)
                            a3 = _block(bits, a, b, r + 3, blk, nb, d3, m3, lo3, hi3, xa, xb, a3)
                out[o] = vsum(a0)
                out[o + U64(1)] = vsum(a1)
                out[o + U64(2)] = vsum(a2)
                out[o + U64(3)] = vsum(a3)
            else:
                for j in range(rows):
                    a0 = vzero()
                    for g in range(ng):
                        d0, m0 = _splats(bits, asym, sc, mn, r + j, g, ng)
                        lo0, hi0 = _tables(bits, asym, d0, m0)
                        for blk in range(g * bpg, (g + 1) * bpg):
                            xa = vload(x, xo + U64(blk * BLOCK))
                            xb = vload(x, xo + U64(blk * BLOCK + 16))
                            a0 = _block(bits, a, b, r + j, blk, nb, d0, m0, lo0, hi0, xa, xb, a0)
                    out[o + U64(j)] = vsum(a0)
        r += 4


# -- prefill: float32 rows times a tile of tokens -------------------------------------------

@njit
def _finish(acc, w, wo, x, xo, k16, K):
    """vsum of the lanes, then the products past the last multiple of 16, one fma each."""
    y = vsum(acc)
    for k in range(k16 * 16, K):
        y = fma32(w[wo + U64(k)], x[xo + U64(k)], y)
    return y


@njit(boundscheck=False)
def _tile_pairs(w, wo0, K, x, xrows, orows, i0, i1, out, ldo, col0):
    """tile_rows' 4 rows times several tokens where a vector register holds 8 lanes (AVX2): two rows times three
    tokens at a time. The 4 x 4 tile's 16 accumulators need 32 such registers of the 16 there are, and spilled
    ones cost more than loading each weight vector twice. Every output is the same sequence of operations."""
    k16 = K // 16
    for pair in range(2):
        wa = wo0 + U64(2 * pair) * U64(K)
        wb = wa + U64(K)
        i = i0
        while i < i1:
            # a last, partial group repeats its last token: the same numbers, written twice to the same place
            i_1 = min(i + 1, i1 - 1)
            i_2 = min(i + 2, i1 - 1)
            x0 = U64(xrows[i]) * U64(K)
            x1 = U64(xrows[i_1]) * U64(K)
            x2 = U64(xrows[i_2]) * U64(K)
            c00 = vzero(); c01 = vzero(); c02 = vzero()
            c10 = vzero(); c11 = vzero(); c12 = vzero()
            for j in range(k16):
                k = U64(j * 16)
                w0 = vload(w, wa + k)
                w1 = vload(w, wb + k)
                v = vload(x, x0 + k)
                c00 = vfma(w0, v, c00); c10 = vfma(w1, v, c10)
                v = vload(x, x1 + k)
                c01 = vfma(w0, v, c01); c11 = vfma(w1, v, c11)
                v = vload(x, x2 + k)
                c02 = vfma(w0, v, c02); c12 = vfma(w1, v, c12)
            col = U64(col0 + 2 * pair)
            o = U64(orows[i]) * U64(ldo) + col
            out[o] = _finish(c00, w, wa, x, x0, k16, K)
            out[o + U64(1)] = _finish(c10, w, wb, x, x0, k16, K)
            o = U64(orows[i_1]) * U64(ldo) + col
            out[o] = _finish(c01, w, wa, x, x1, k16, K)
            out[o + U64(1)] = _finish(c11, w, wb, x, x1, k16, K)
            o = U64(orows[i_2]) * U64(ldo) + col
            out[o] = _finish(c02, w, wa, x, x2, k16, K)
            out[o + U64(1)] = _finish(c12, w, wb, x, x2, k16, K)
            i += 3


@njit(boundscheck=False)
def tile_rows(w, wo0, K, nr, x, xrows, orows, i0, i1, out, ldo, col0):
    """Float32 rows w[wo0 + j * K ...] (j < nr <= 4) times tokens i0 .. i1 - 1 -> out[orows[i] * ldo + col0 + j]."""
    k16 = K // 16
    if nr == 4 and not HAS_AVX512 and i1 - i0 > 1:
        _tile_pairs(w, wo0, K, x, xrows, orows, i0, i1, out, ldo, col0)
        return
    if nr == 4:
        wo1 = wo0 + U64(K)
        wo2 = wo1 + U64(K)
        wo3 = wo2 + U64(K)
        i = i0
        while i < i1 and i1 - i0 > 1:
            # 16 accumulators c<row><token>: each weight vector is loaded once for 4 tokens. A last,
            # partial tile repeats its last token: the same numbers, written twice to the same place
            i_1 = min(i + 1, i1 - 1)
            i_2 = min(i + 2, i1 - 1)
            i_3 = min(i + 3, i1 - 1)
            x0 = U64(xrows[i]) * U64(K)
            x1 = U64(xrows[i_1]) * U64(K)
            x2 = U64(xrows[i_2]) * U64(K)
            x3 = U64(xrows[i_3]) * U64(K)
            c00 = vzero(); c01 = vzero(); c02 = vzero(); c03 = vzero()
            c10 = vzero(); c11 = vzero(); c12 = vzero(); c13 = vzero()
            c20 = vzero(); c21 = vzero(); c22 = vzero(); c23 = vzero()
            c30 = vzero(); c31 = vzero(); c32 = vzero(); c33 = vzero()
            for j in range(k16):
                k = U64(j * 16)
                w0 = vload(w, wo0 + k)
                w1 = vload(w, wo1 + k)
                w2 = vload(w, wo2 + k)
                w3 = vload(w, wo3 + k)
                v = vload(x, x0 + k)
                c00 = vfma(w0, v, c00); c10 = vfma(w1, v, c10); c20 = vfma(w2, v, c20); c30 = vfma(w3, v, c30)
                v = vload(x, x1 + k)
                c01 = vfma(w0, v, c01); c11 = vfma(w1, v, c11); c21 = vfma(w2, v, c21); c31 = vfma(w3, v, c31)
                v = vload(x, x2 + k)
                c02 = vfma(w0, v, c02); c12 = vfma(w1, v, c12); c22 = vfma(w2, v, c22); c32 = vfma(w3, v, c32)
                v = vload(x, x3 + k)
                c03 = vfma(w0, v, c03); c13 = vfma(w1, v, c13); c23 = vfma(w2, v, c23); c33 = vfma(w3, v, c33)
            o = U64(orows[i]) * U64(ldo) + U64(col0)
            out[o] = _finish(c00, w, wo0, x, x0, k16, K)
            out[o + U64(1)] = _finish(c10, w, wo1, x, x0, k16, K)
            out[o + U64(2)] = _finish(c20, w, wo2, x, x0, k16, K)
            out[o + U64(3)] = _finish(c30, w, wo3, x, x0, k16, K)
            o = U64(orows[i_1]) * U64(ldo) + U64(col0)
            out[o] = _finish(c01, w, wo0, x, x1, k16, K)
            out[o + U64(1)] = _finish(c11, w, wo1, x, x1, k16, K)
            out[o + U64(2)] = _finish(c21, w, wo2, x, x1, k16, K)
            out[o + U64(3)] = _finish(c31, w, wo3, x, x1, k16, K)
            o = U64(orows[i_2]) * U64(ldo) + U64(col0)
            out[o] = _finish(c02, w, wo0, x, x2, k16, K)
            out[o + U64(1)] = _finish(c12, w, wo1, x, x2, k16, K)
            out[o + U64(2)] = _finish(c22, w, wo2, x, x2, k16, K)
            out[o + U64(3)] = _finish(c32, w, wo3, x, x2, k16, K)
            o = U64(orows[i_3]) * U64(ldo) + U64(col0)
            out[o] = _finish(c03, w, wo0, x, x3, k16, K)
            out[o + U64(1)] = _finish(c13, w, wo1, x, x3, k16, K)
            out[o + U64(2)] = _finish(c23, w, wo2, x, x3, k16, K)
            out[o + U64(3)] = _finish(c33, w, wo3, x, x3, k16, K)
            i += 4
        while i < i1:  # a single token (decode of a float32 matrix)
            x0 = U64(xrows[i]) * U64(K)
            c00 = vzero(); c10 = vzero(); c20 = vzero(); c30 = vzero()
            ahead = wo0 + U64(4 * K)  # the next 4 rows (contiguous in a float32 matrix): 4 lines per step
            for j in range(k16):
                k = U64(j * 16)
                p = ahead + U64(j * 64)
                prefetch(w, p)
                prefetch(w, p + U64(16))
                prefetch(w, p + U64(32))
                prefetch(w, p + U64(48))
                v = vload(x, x0 + k)
                c00 = vfma(vload(w, wo0 + k), v, c00)
                c10 = vfma(vload(w, wo1 + k), v, c10)
                c20 = vfma(vload(w, wo2 + k), v, c20)
                c30 = vfma(vload(w, wo3 + k), v, c30)
            o = U64(orows[i]) * U64(ldo) + U64(col0)
            out[o] = _finish(c00, w, wo0, x, x0, k16, K)
            out[o + U64(1)] = _finish(c10, w, wo1, x, x0, k16, K)
            out[o + U64(2)] = _finish(c20, w, wo2, x, x0, k16, K)
            out[o + U64(3)] = _finish(c30, w, wo3, x, x0, k16, K)
            i += 1
        return
    for r in range(nr):
        wo = wo0 + U64(r) * U64(K)
        for i in range(i0, i1):
            x0 = U64(xrows[i]) * U64(K)
            c = vzero()
            for j in range(k16):
                c = vfma(vload(w, wo + U64(j * 16)), vload(x, x0 + U64(j * 16)), c)
            out[U64(orows[i]) * U64(ldo) + U64(col0 + r)] = _finish(c, w, wo, x, x0, k16, K)


# -- one quantized or float32 matrix times a batch ------------------------------------------

@njit(boundscheck=False)
def quant_rows(bits, asym, group, a, b, sc, mn, K, r0, r1, x, xrows, orows, i0, i1, out, ldo, col0, scratch):
    """Rows r0 .. r1 - 1 of a quantized matrix times tokens i0 .. i1 - 1, by the path that suits the count."""
    if i1 - i0 <= OTF_MAX_TOKENS or bits & ROWS16_FLAG:   # rows16: one kernel for any count of tokens
        otf_rows(bits, asym, group, a, b, sc, mn, K, r0, r1 - r0, x, xrows, orows, i0, i1, out, ldo, col0)
        return
    r = r0
    while r < r1:
        nr = min(TILE, r1 - r)
        dequant_rows(bits, asym, group, a, b, sc, mn, K, r, nr, scratch)
        tile_rows(scratch, U64(0), K, nr, x, xrows, orows, i0, i1, out, ldo, col0 + r - r0)
        r += TILE


@njit
def planes(desc):
    """(bits, asym, group, rows, cols, a, b, scales, mins) of a matrix descriptor (QuantizedTensor.descriptor)."""
    a = numba.carray(address_as_voidptr(desc[5]), (desc[6],), np.uint8)
    b = numba.carray(address_as_voidptr(desc[7]), (desc[8],), np.uint8)
    sc = numba.carray(address_as_voidptr(desc[9]), (desc[10],), np.uint16)
    mn = numba.carray(address_as_voidptr(desc[11]), (desc[12],), np.uint16)
    return desc[0], desc[1] != 0, desc[2], desc[3], desc[4], a, b, sc, mn


@njit(cache=True, boundscheck=False)
def gather_rows(desc, ids, dst):
    """Rows ids [T] of the matrix a descriptor describes (QuantizedTensor.descriptor) -> dst flat [T, in], float32."""
    bits, asym, group, _, cols, a, b, sc, mn = planes(desc)
    for i in range(ids.shape[0]):
        dequant_rows(bits, asym, group, a, b, sc, mn, cols, ids[i], 1, dst[i * cols:])


# -- work items: the one parallel kernel every quantized product runs in ----------------------
# An item is (matrix, r0, r1, i0, i1, base, ldo): rows r0 .. r1 - 1 of matrix `table[matrix]` times
# tokens i0 .. i1 - 1 (token i reads x row xrows[i]) into out[base + orows[i] * ldo + row]; the
# threads share out pieces, each a run of consecutive items.
# Single products, several matrices sharing an input, and both phases of the fused experts are
# lists of items; keeping one parallel kernel means the format-specialised loops are optimised
# once, not once per caller (numba re-optimises all the code a cached kernel links: with a kernel
# per use, the first run compiled for minutes).

ITEM_FIELDS = 7


@njit
def shared_width(flags, widths, flag):
    """The input width every matrix of a kernel table whose flags field has `flag` shares, or 0 (none, or not one
    width): the tokens such a table's integer products quantize once for all of them."""
    cols = 0
    for m in range(flags.shape[0]):
        if flags[m] & flag:
            if cols and widths[m] != cols:
                return 0
            cols = widths[m]
    return cols


@njit(parallel=True, boundscheck=False)
def prequantize(x, xrows, K, sums):
    """(n, q, dq, sq, s16): every token i < n = len(xrows) quantized once for all the integer products of a call
    (`rows16.quantize_token`; s16 only with `sums`), over the threads when there are enough tokens to pay for it.
    K = 0 gives n = 0 and empty arrays."""
    n = xrows.shape[0] if K else 0
    nb = K // BLOCK
    q, dq, sq = np.empty(n * K, np.int8), np.empty(n * nb, np.float32), np.empty(n * nb, np.int32)
    s16 = np.empty(n * K // 16 if sums else 0, np.int32)
    if n < 8:
        for i in range(n):
            quantize_token(x, xrows, i, K, q, dq, sq, s16)
    else:
        for i in prange(n):
            quantize_token(x, xrows, i, K, q, dq, sq, s16)
    return n, q, dq, sq, s16


@njit(parallel=True, cache=True, boundscheck=False)
def run_items(table, items, pieces, x, xrows, orows, out):
    """Run the work items (see above) over the threads: piece p is items pieces[p] .. pieces[p + 1] - 1, and
    the pieces are split statically, so pieces of equal work balance the threads. The tokens of rows16 matrices
    are quantized once, before the pieces, not once for every row range."""
    n, q, dq, sq, _ = prequantize(x, xrows, shared_width(table[:, 0], table[:, 4], ROWS16_FLAG), False)
    for p in prange(pieces.shape[0] - 1):
        for j in range(pieces[p], pieces[p + 1]):
            bits, asym, group, _, cols, a, b, sc, mn = planes(table[items[j, 0]])
            r0, r1, i0, i1, base, ldo = items[j, 1], items[j, 2], items[j, 3], items[j, 4], items[j, 5], items[j, 6]
            if bits & ROWS16_FLAG and n:
                rows16_rows_pre(bits, group, a, sc, cols, r0, r1 - r0, x, xrows, orows, i0, i1, out[base:], ldo, r0,
                                q, dq, sq, True)
                continue
            tiled = i1 - i0 > OTF_MAX_TOKENS and not bits & ROWS16_FLAG    # the dequantized tile's scratch
            scratch = np.empty(TILE * cols if tiled else 0, np.float32)
            quant_rows(bits, asym, group, a, b, sc, mn, cols, r0, r1, x, xrows, orows, i0, i1, out[base:], ldo, r0,
                       scratch)


@njit(cache=True)
def chunking(R, threads):
    """(chunks, row tiles per chunk) splitting R rows into about 8 chunks per thread."""
    tiles = (R + TILE - 1) // TILE
    chunks = min(tiles, 8 * threads)
    return chunks, (tiles + chunks - 1) // chunks


@njit(cache=True)
def matmul_items(rows, T, threads):
    """(items, pieces, token rows) of matrices with `rows` [M] rows each (table order) times T tokens; matrix m
    writes a [T, rows[m]] block at offset T * sum(rows[:m]) of the output.

    The matrices' rows, laid end to end, are cut into pieces of equal size (about 8 per thread); a piece
    that straddles matrices holds one item per matrix. Equal pieces keep the threads equally busy.
    """
    _, per = chunking(rows.sum(), threads)
    size = per * TILE                                       # rows per piece
    n_pieces = (rows.sum() + size - 1) // size
    items = np.zeros((n_pieces + rows.shape[0], ITEM_FIELDS), np.int64)
    pieces = np.zeros(n_pieces + 1, np.int64)
    n = 0
    for p in range(n_pieces):
        pieces[p] = n
        start = 0
        base = 0
        for m in range(rows.shape[0]):
            lo = max(p * size, start)
            hi = min((p + 1) * size, start + rows[m])
            if lo < hi:
                items[n, 0] = m
                items[n, 1] = lo - start
                items[n, 2] = hi - start
                items[n, 4] = T
                items[n, 5] = base
                items[n, 6] = rows[m]
                n += 1
            start += rows[m]
            base += T * rows[m]
    pieces[n_pieces] = n
    return items[:n], pieces, np.arange(T)


@njit(parallel=True, cache=True, boundscheck=False)
def f32_matmul(w, R, K, x, T, out, threads):
    """Float32 w (flat [R, K]) times x (flat [T, K]) -> out (flat [T, R]), work cut for `threads` threads."""
    tokens = np.arange(T)
    chunks, per = chunking(R, threads)
    for c in prange(chunks):
        r0 = c * per * TILE
        r1 = min(R, r0 + per * TILE)
        r = r0
        while r < r1:
            tile_rows(w, U64(r) * U64(K), K, min(TILE, r1 - r), x, tokens, tokens, 0, T, out, R, r)
            r += TILE
