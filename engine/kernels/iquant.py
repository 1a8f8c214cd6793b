"""numba kernels for GGUF's non-linear 4-bit types IQ4_NL and IQ4_XS, read in the file's own block layout.

    IQ4_NL   18 bytes per 32 weights: d (fp16), qs[16] (byte j: weight j in the low nibble, 16 + j in the high)
    IQ4_XS  136 bytes per 256 weights: d (fp16), scales_h (uint16; bits 2i, 2i + 1: the top bits of sub-block i's
            scale), scales_l[4] (nibble i, low nibble first: its low 4 bits), then 16 bytes per 32-weight
            sub-block laid out as IQ4_NL's qs

A code q stands for KVALUES[q], a fixed non-linear table. IQ4_NL's weight is d * KVALUES[q]; IQ4_XS's is
(d * (ls - 32)) * KVALUES[q] with ls the 6-bit sub-block scale, where d * (ls - 32) is exact in float32 (an fp16
times 6 bits) and the product with KVALUES[q] rounds once: both as `gguf.quants.dequantize` computes them, so the
weights are bitwise equal. Each 32-weight (sub-)block's 16 possible weights are computed once into a vector and
looked up per lane (one permute per 16 weights, as the Q4_1 and Q4_K paths do); a dot product accumulates lane j
over k = j, j + 16, ... with one fma each and reduces by `vsum`, the sequence of engine/kernels/matmul.py's float
tile, so decode (on the fly) and prefill (a dequantized tile) give the same bits.

engine/kernels/kquant.py dispatches to these by kind (the ggml type numbers below), so a KQuantTensor holds either.
"""

from __future__ import annotations

import llvmlite.ir as ir
import numpy as np
from numba import literally, njit
from numba.extending import intrinsic

from engine.kernels.simd import (
    U64,
    f16_to_f32,
    f32x16,
    prefetch,
    vcodes8,
    vfma,
    vload,
    vlookup16n,
    vmul,
    vsplat,
    vsrl4,
    vstore,
    vsum,
    vzero,
)

F32 = np.float32
IQ4_NL, IQ4_XS = 20, 23           # ggml type numbers, the kernels' `kind`
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
BLOCK_BYTES = {IQ4_NL: 18, IQ4_XS: 136}       # bytes per block
BLOCK_WEIGHTS = {IQ4_NL: 32, IQ4_XS: 256}     # weights per block


@intrinsic
def vkvalues(typingctx):
    """Lanes KVALUES[0] .. KVALUES[15] as float32."""
    def codegen(context, builder, sig, args):
        return ir.Constant(ir.VectorType(ir.FloatType(), 16), [ir.Constant(ir.FloatType(), float(v)) for v in KVALUES])
    return f32x16(), codegen


@njit(inline="always")
def _f16(raw, o):
    """The little-endian fp16 at byte o of raw as float32 (any alignment)."""
    return f16_to_f32(np.uint16(raw[o]) | (np.uint16(raw[o + U64(1)]) << np.uint16(8)))


@njit(inline="always")
def _geometry(kind):
    """(bytes, weights, 32-weight sub-blocks) of one block of `kind`."""
    if kind == IQ4_NL:
        return 18, 32, 1
    return 136, 256, 8


@njit(inline="always")
def _table(kind, raw, so, d, sub):
    """The 16 weights codes 0 .. 15 stand for in sub-block `sub` of the block at byte so (d: its fp16 scale)."""
    if kind == IQ4_NL:
        return vmul(vkvalues(), vsplat(d))
    high = (np.int32(raw[so + U64(2 + sub // 4)]) >> np.int32(2 * (sub % 4))) & np.int32(3)   # scales_h, LE
    low = (np.int32(raw[so + U64(4 + sub // 2)]) >> np.int32(4 * (sub % 2))) & np.int32(15)
    dl = d * F32((low | (high << np.int32(4))) - np.int32(32))                                  # exact
    return vmul(vkvalues(), vsplat(dl))


@njit(inline="always")
def _codes(kind, so, sub):
    """Byte offset of the 16 code bytes of sub-block `sub` of the block at byte so."""
    return so + U64(2 if kind == IQ4_NL else 8 + 16 * sub)


@njit(inline="always")
def _sub(kind, raw, so, d, sub, x0, x1, acc):
    """acc plus one row's 32-weight sub-block `sub` of the block at byte so times x0 (its weights 0 .. 15), x1."""
    tab = _table(kind, raw, so, d, sub)
    c = vcodes8(raw, _codes(kind, so, sub), raw, U64(0), 0)
    acc = vfma(vlookup16n(tab, c), x0, acc)
    return vfma(vlookup16n(tab, vsrl4(c)), x1, acc)


@njit(boundscheck=False)
def iq_dequant(kind, raw, K, r0, nr, dst):
    """Rows r0 .. r0 + nr - 1 of an IQ4_NL or IQ4_XS matrix (raw: its bytes, flat) -> dst[i * K + k], float32."""
    literally(kind)
    bs, bw, subs = _geometry(kind)
    nblk = K // bw
    for i in range(nr):
        for blk in range(nblk):
            so = (U64(r0 + i) * U64(nblk) + U64(blk)) * U64(bs)
            d = _f16(raw, so)
            for sub in range(subs):
                tab = _table(kind, raw, so, d, sub)
                c = vcodes8(raw, _codes(kind, so, sub), raw, U64(0), 0)
                o = U64(i) * U64(K) + U64(blk * bw + 32 * sub)
                vstore(dst, o, vlookup16n(tab, c))
                vstore(dst, o + U64(16), vlookup16n(tab, vsrl4(c)))


@njit(boundscheck=False)
def iq_otf(kind, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0):
    """Rows r0 .. r0 + nr - 1 times tokens i0 .. i1 - 1 -> out[orows[i] * ldo + col0 + row - r0], on the fly,
    four rows at a time (four accumulators hide the fma latency)."""
    literally(kind)
    bs, bw, subs = _geometry(kind)
    nblk = K // bw
    step = U64(nblk) * U64(bs)          # bytes per row
    r = r0
    while r < r0 + nr:
        rows = min(4, r0 + nr - r)
        for i in range(i0, i1):
            xo = U64(xrows[i]) * U64(K)
            o = U64(orows[i]) * U64(ldo) + U64(col0 + r - r0)
            if rows == 4:
                acc0 = vzero()
                acc1 = vzero()
                acc2 = vzero()
                acc3 = vzero()
                for blk in range(nblk):
                    so = U64(r) * step + U64(blk * bs)
                    for j in range(4):
                        prefetch(raw, so + U64(j + 4) * step)
                        prefetch(raw, so + U64(j + 4) * step + U64(64))
                    d0 = _f16(raw, so)
                    d1 = _f16(raw, so + step)
                    d2 = _f16(raw, so + U64(2) * step)
                    d3 = _f16(raw, so + U64(3) * step)
                    for sub in range(subs):
                        xk = xo + U64(blk * bw + 32 * sub)
                        x0 = vload(x, xk)
                        x1 = vload(x, xk + U64(16))
                        acc0 = _sub(kind, raw, so, d0, sub, x0, x1, acc0)
                        acc1 = _sub(kind, raw, so + step, d1, sub, x0, x1, acc1)
                        acc2 = _sub(kind, raw, so + U64(2) * step, d2, sub, x0, x1, acc2)
                        acc3 = _sub(kind, raw, so + U64(3) * step, d3, sub, x0, x1, acc3)
                out[o] = vsum(acc0)
                out[o + U64(1)] = vsum(acc1)
                out[o + U64(2)] = vsum(acc2)
                out[o + U64(3)] = vsum(acc3)
            else:
                for j in range(rows):
                    acc = vzero()
                    for blk in range(nblk):
                        so = U64(r + j) * step + U64(blk * bs)
                        d = _f16(raw, so)
                        for sub in range(subs):
                            xk = xo + U64(blk * bw + 32 * sub)
                            acc = _sub(kind, raw, so, d, sub, vload(x, xk), vload(x, xk + U64(16)), acc)
                    out[o + U64(j)] = vsum(acc)
        r += 4
