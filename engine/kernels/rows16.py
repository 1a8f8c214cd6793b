"""Kernels for 4- and 8-bit symmetric weights in the rows16 layout (engine/kernels/layout.py) times 8-bit activations.

Each token's activations are quantized per 32-block to int8 (`quant_block`: d_x = amax / 127, as
llama.cpp does for its Q4_0 and Q8_0 products). A block of 32 weights of 16 rows then takes 8 byte
dot products (`vpdpbusd`), one lane per row, and every output element y[t, r] is

    isum[kb] = sum_k u[r, k] * q[t, k] - o * sum_k q[t, k]           exact, over block kb's 32 weights
    acc      = fma(float(isum[kb]), d_w[r, g(kb)] * d_x[t, kb], acc)  for kb = 0, 1, ... from +0.0

with o the codes' offset (8 for 4-bit codes, 128 for 8-bit): one fixed sequence whatever the number
of tokens, the rows asked for, or the threads, so decode (one token, 16 rows at a time) and prefill
(4 tokens sharing each block's weight vectors) give the same bits. The weights are read as packed
codes and never widened to floats, which is what makes this path several times cheaper in
arithmetic than the float kernels (engine/kernels/matmul.py).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import literally, njit

from engine.kernels.layout import BLOCK, ROWS16_ROWS
from engine.kernels.simd import U64, f16_to_f32, prefetch, stack_block, vfma, vloadf, vmul, vsplat, vstore, vzero
from engine.kernels.simd_int import quant_block, vbytes, vdot_bcast, vitof, vizero, vnibbles, vsub_splat

F32 = np.float32
PREFETCH_AHEAD = 4096  # bytes ahead along the weights' stream that decode asks the CPU to fetch


@njit(boundscheck=False, inline="always")
def _quantize_row(x, row, slot, K, q, dq, sq):
    """x row `row` quantized per 32-block into slot `slot`: q[slot * K ...], dq and sq[slot * K / 32 ...]."""
    nb = K // BLOCK
    xo = U64(row) * U64(K)
    for kb in range(nb):
        d, total = quant_block(x, xo + U64(kb * BLOCK), q, U64(slot * K + kb * BLOCK))
        dq[slot * nb + kb] = d
        sq[slot * nb + kb] = total


@njit(boundscheck=False)
def quantize_tokens(x, xrows, t0, tn, K, q, dq, sq):
    """Tokens t0 .. t0 + tn - 1 (x rows xrows[t]) quantized per 32-block: q [tn, K] int8, dq [tn, K / 32] the
    scales, sq [tn, K / 32] each block's sum of q (times the codes' offset it is what the products overcount)."""
    for j in range(tn):
        _quantize_row(x, xrows[t0 + j], j, K, q, dq, sq)


@njit(boundscheck=False, inline="always")
def token_slot(pre, x, xrows, t0, tn, K, q, dq, sq):
    """Where tokens t0 .. t0 + tn - 1 sit in q, dq, sq: slot t0 when they were quantized beforehand (`pre`), else
    slot 0 of room for 4 tokens, after quantizing them here."""
    if pre:
        return t0
    quantize_tokens(x, xrows, t0, tn, K, q, dq, sq)
    return 0


@njit(boundscheck=False)
def quantize_token(x, xrows, i, K, q, dq, sq, s16):
    """Token i (x row xrows[i]) quantized into slot i of arrays for every token: q[i * K ...], the 32-blocks' scales
    and sums at dq[i * K / 32 ...], sq[i * K / 32 ...] (as `quantize_tokens`), and when s16 has room, `sums16` at
    s16[i * K / 16 ...]."""
    _quantize_row(x, xrows[i], i, K, q, dq, sq)
    if s16.size:
        sums16(q, i, 1, K, s16)


@njit(boundscheck=False)
def sums16(q, t0, tn, K, s16):
    """s16[t * K / 16 + j] = -32 times the sum of the 16 codes q[t * K + 16 j ...] of the tokens in slots t0 .. t0 +
    tn - 1: what Q6_K's codes (offset 32) overcount, kept in memory so that the kernel broadcasts it from there."""
    for t in range(t0, t0 + tn):
        for j in range(K // 16):
            total = 0
            for k in range(16):
                total += np.int32(q[t * K + 16 * j + k])
            s16[t * (K // 16) + j] = -32 * total


@njit(boundscheck=False, inline="always")
def _block_dot(w0, w1, w2, w3, w4, w5, w6, w7, q, qo, over, dw, dx, acc):
    """acc + the block's 16 row sums for one token (see the module docstring): vector w_i holds the 4 weights
    of each row that meet q[qo + (0, 16, 4, 20, 8, 24, 12, 28)[i] ...]; 8 dot products, one fma."""
    isum = vdot_bcast(vizero(), w0, q, qo)
    isum = vdot_bcast(isum, w1, q, qo + U64(16))
    isum = vdot_bcast(isum, w2, q, qo + U64(4))
    isum = vdot_bcast(isum, w3, q, qo + U64(20))
    isum = vdot_bcast(isum, w4, q, qo + U64(8))
    isum = vdot_bcast(isum, w5, q, qo + U64(24))
    isum = vdot_bcast(isum, w6, q, qo + U64(12))
    isum = vdot_bcast(isum, w7, q, qo + U64(28))
    return vfma(vitof(vsub_splat(isum, over)), vmul(dw, vsplat(dx)), acc)


@njit(boundscheck=False)
def put_block(acc, rb, r0, nr, out, o, buf):
    """Lanes of row block rb that fall in rows r0 .. r0 + nr - 1 -> out[o + row - r0]."""
    first = rb * ROWS16_ROWS
    if first >= r0 and first + ROWS16_ROWS <= r0 + nr:
        vstore(out, o + U64(first - r0), acc)
        return
    vstore(buf, U64(0), acc)
    for lane in range(max(0, r0 - first), min(ROWS16_ROWS, r0 + nr - first)):
        out[o + U64(first + lane - r0)] = buf[lane]


@njit(boundscheck=False, inline="always")
def put_tokens(a0, a1, a2, a3, tn, t0, rb, r0, nr, out, orows, ldo, col0, buf):
    """`put_block` of the first tn of tokens t0 .. t0 + 3's accumulators (out rows orows[t], from column col0)."""
    put_block(a0, rb, r0, nr, out, U64(orows[t0]) * U64(ldo) + U64(col0), buf)
    if tn > 1:
        put_block(a1, rb, r0, nr, out, U64(orows[t0 + 1]) * U64(ldo) + U64(col0), buf)
    if tn > 2:
        put_block(a2, rb, r0, nr, out, U64(orows[t0 + 2]) * U64(ldo) + U64(col0), buf)
    if tn > 3:
        put_block(a3, rb, r0, nr, out, U64(orows[t0 + 3]) * U64(ldo) + U64(col0), buf)


@njit(boundscheck=False)
def rows16_rows(code, group, a, sc, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0):
    """Rows r0 .. r0 + nr - 1 of a rows16 matrix (`code`: its bits | ROWS16_FLAG) times tokens i0 .. i1 - 1
    -> out[orows[i] * ldo + col0 + row - r0] (as kernels.otf_rows). Row blocks cut by r0 or r0 + nr are computed
    whole and stored in part."""
    nb = K // BLOCK
    q, dq, sq = np.empty(4 * K, np.int8), np.empty(4 * nb, np.float32), np.empty(4 * nb, np.int32)
    rows16_rows_pre(code, group, a, sc, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0, q, dq, sq, False)


@njit(boundscheck=False)
def rows16_rows_pre(code, group, a, sc, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0, q, dq, sq, pre):
    """`rows16_rows` on tokens quantized beforehand (`quantize_token`: token i's codes at q[i * K], its blocks' scales
    and sums at dq[i * K / 32], sq[i * K / 32]) when `pre`: the same bits, without quantizing again for every row
    range. Without `pre`, q, dq, sq are room for 4 tokens quantized from x as they come."""
    if code & 15 == 8:  # a constant width: _rows16 is compiled once per width
        _rows16(8, group, a, sc, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0, q, dq, sq, pre)
    else:
        _rows16(4, group, a, sc, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0, q, dq, sq, pre)


@njit(boundscheck=False, inline="always")
def _weights(bits, a, wo):
    """The block's 8 vectors in `_block_dot` order: nibbles unpacked (4-bit) or bytes as stored (8-bit)."""
    if bits == 4:
        w0, w1 = vnibbles(a, wo)
        w2, w3 = vnibbles(a, wo + U64(64))
        w4, w5 = vnibbles(a, wo + U64(128))
        w6, w7 = vnibbles(a, wo + U64(192))
        return w0, w1, w2, w3, w4, w5, w6, w7
    return (vbytes(a, wo), vbytes(a, wo + U64(256)), vbytes(a, wo + U64(64)), vbytes(a, wo + U64(320)),
            vbytes(a, wo + U64(128)), vbytes(a, wo + U64(384)), vbytes(a, wo + U64(192)), vbytes(a, wo + U64(448)))


@njit(boundscheck=False)
def _rows16(bits, group, a, sc, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0, q, dq, sq, pre):
    """The kernel: with `pre`, q, dq, sq hold every token's quantization (token i at i * K); else they are room for 4
    tokens, quantized here from x."""
    literally(bits)
    block_bytes = 64 * bits              # 32 weights of 16 rows: 256 (4-bit) or 512 (8-bit) bytes
    offset = np.int32(1 << (bits - 1))    # codes are u = w / d + offset
    nb = K // BLOCK
    ng = K // group
    bpg = group // BLOCK
    buf = numba.carray(stack_block(), 128, np.float32)
    rb0 = r0 // ROWS16_ROWS
    rb1 = (r0 + nr + ROWS16_ROWS - 1) // ROWS16_ROWS
    for t0 in range(i0, i1, 4):
        tn = min(4, i1 - t0)
        base = token_slot(pre, x, xrows, t0, tn, K, q, dq, sq)
        qb = U64(base) * U64(K)
        for rb in range(rb0, rb1):
            a0 = vzero()
            a1 = vzero()
            a2 = vzero()
            a3 = vzero()
            for g in range(ng):
                dw = vloadf(sc, (U64(rb) * U64(ng) + U64(g)) * U64(ROWS16_ROWS))
                for kb in range(g * bpg, (g + 1) * bpg):
                    wo = (U64(rb) * U64(nb) + U64(kb)) * U64(block_bytes)
                    for line in range(0, block_bytes, 64):
                        prefetch(a, wo + U64(PREFETCH_AHEAD + line))
                    w0, w1, w2, w3, w4, w5, w6, w7 = _weights(bits, a, wo)
                    qo = qb + U64(kb * BLOCK)
                    o = base * nb + kb
                    a0 = _block_dot(w0, w1, w2, w3, w4, w5, w6, w7, q, qo, offset * sq[o], dw, dq[o], a0)
                    if tn > 1:
                        a1 = _block_dot(w0, w1, w2, w3, w4, w5, w6, w7, q, qo + U64(K), offset * sq[nb + o], dw,
                                        dq[nb + o], a1)
                    if tn > 2:
                        a2 = _block_dot(w0, w1, w2, w3, w4, w5, w6, w7, q, qo + U64(2 * K), offset * sq[2 * nb + o],
                                        dw, dq[2 * nb + o], a2)
                    if tn > 3:
                        a3 = _block_dot(w0, w1, w2, w3, w4, w5, w6, w7, q, qo + U64(3 * K), offset * sq[3 * nb + o],
                                        dw, dq[3 * nb + o], a3)
            put_tokens(a0, a1, a2, a3, tn, t0, rb, r0, nr, out, orows, ldo, col0, buf)


@njit(boundscheck=False)
def rows16_dequant(code, group, a, sc, K, r0, nr, dst):
    """Rows r0 .. r0 + nr - 1 of a rows16 matrix -> dst[i * K + k] float32: (u - offset) * d, the values of the
    plane layout's dequantization."""
    bits = code & 15
    block_bytes = 64 * bits
    offset = 1 << (bits - 1)
    nb = K // BLOCK
    ng = K // group
    for i in range(nr):
        r = r0 + i
        rb = r // ROWS16_ROWS
        lane = r % ROWS16_ROWS
        for kb in range(nb):
            d = f16_to_f32(sc[(U64(rb) * U64(ng) + U64(kb * BLOCK // group)) * U64(ROWS16_ROWS) + U64(lane)])
            wo = (U64(rb) * U64(nb) + U64(kb)) * U64(block_bytes) + U64(4 * lane)
            o = U64(i) * U64(K) + U64(kb * BLOCK)
            for p in range(block_bytes // 64):
                for c in range(4):
                    byte = np.int32(a[wo + U64(64 * p + c)])
                    if bits == 8:
                        dst[o + U64(4 * p + c)] = F32(byte - offset) * d
                    else:
                        dst[o + U64(4 * p + c)] = F32((byte & 15) - offset) * d
                        dst[o + U64(16 + 4 * p + c)] = F32((byte >> 4) - offset) * d
