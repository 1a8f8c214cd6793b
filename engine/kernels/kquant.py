"""numba kernels for GGUF K-quant matrices (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) read in the file's own block layout.

The entry points (`kq_rows`, `kq_otf_rows`, `kq_dequant_rows`, `kq_desc_rows`) also take IQ4_NL and IQ4_XS
matrices, whose kernels live in engine/kernels/iquant.py, and (but `kq_dequant_rows`) Q4_K, Q5_K, Q6_K and IQ4_XS
matrices in the 16-row layout (kind | KROWS16), whose integer kernels live in engine/kernels/krows16.py.

A row of K weights is K / 256 super-blocks of ggml bytes, kept exactly as the file holds them (no
copy of a memory map, memory = the file's size):

    Q4_K  144 bytes: d, dmin (fp16), 12 bytes of 6-bit sub-scales sc[8] and sub-mins m[8], qs[128]
    Q5_K  176 bytes: d, dmin, the same 12 bytes, qh[32] (bit j of byte l: high bit of sub-block j), qs[128]
    Q6_K  210 bytes: ql[128], qh[64], int8 sub-scales sc[16], d (fp16)
    Q2_K   84 bytes: sc[16] (low nibble) and m[16] (high), qs[64] (4 crumbs a byte), d, dmin (fp16)
    Q3_K  110 bytes: hmask[32] (bit j of byte l: high bit of weight 16j' + l), qs[64], 12 bytes of 6-bit sc[16], d

Q4_K / Q5_K weight l of 32-weight sub-block j is (d * sc[j]) * q - dmin * m[j]; Q6_K weight l of
16-weight sub-block i is (d * sc[i]) * (q - 32); Q2_K's is (d * sc[i]) * q - dmin * m[i];
Q3_K's is (d * (sc[i] - 32)) * (q - 4 * (1 - high bit)), exact, computed as gguf does like Q6_K.
Every product here is exact in float32 (at most 24
significant bits), so one fma(q, A, B) with A = d * sc and B = -(dmin * m) rounds once, where gguf's
numpy dequantization rounds A * q - dm once too; Q6_K is (q - 32) * A, exact, computed as gguf does
(signed zeros included): the weights are bitwise equal.

Each kernel walks a super-block in 16 groups of 16 weights in increasing order, with the sub-block
scales of up to 4 rows decoded once per super-block (one vector each) into a stack buffer. A dot product accumulates
lane j over k = j, j + 16, ... with one fma each and reduces by `vsum`, the same sequence as
engine/kernels/matmul.py's float tile, so decode (on the fly) and prefill (a dequantized tile run
by `matmul.tile_rows`) give the same bits. On AVX-512 Q4_K and Q5_K look weights up in a per-sub-block table
(one permute per 16 weights, as the Q4_1 path does); elsewhere they, like Q6_K, Q3_K and Q2_K, convert and fma.
"""

from __future__ import annotations

import llvmlite.ir as ir
import numba
import numpy as np
from numba import literally, njit, prange, types
from numba.extending import intrinsic

from engine.kernels import iquant
from engine.kernels.krows16 import KROWS16, krows16_rows, krows16_rows_pre
from engine.kernels.matmul import TILE, prequantize, shared_width, tile_rows
from engine.kernels.simd import (
    HAS_AVX512,
    U64,
    _elem_ptr,
    _load_vec,
    _splat_i32,
    address_as_voidptr,
    f16_to_f32,
    f32x16,
    prefetch,
    stack_block,
    vcodes8,
    vfma,
    viota,
    vload,
    vlookup,
    vlookup16n,
    vmul,
    vsplat,
    vsrl4,
    vstore,
    vsum,
    vtofloat,
    vzero,
)
from engine.kernels.simd_int import vfield, vmerge

F32 = np.float32
SUPER = 256                       # weights per super-block
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14     # ggml type numbers, the kernels' `kind`
BLOCK_BYTES = {Q2_K: 84, Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210}  # bytes per super-block (Python side; kernels: _block_bytes)
BLOCK_BYTES |= iquant.BLOCK_BYTES                    # IQ4_NL, IQ4_XS: run by engine/kernels/iquant.py
BLOCK_WEIGHTS = {kind: SUPER for kind in (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)} | iquant.BLOCK_WEIGHTS
IQ4_NL, IQ4_XS = iquant.IQ4_NL, iquant.IQ4_XS
DESC_FIELDS = 5                   # kind, rows, cols, address, bytes: one matrix in a kernel table
# at most this many tokens on the fly, as matmul's OTF_MAX_TOKENS; against its on-the-fly kernel a K-quant's tile path
# costs more than a Colibri width's, so that on AVX2 two tokens on the fly tie with the tile (measured)
KQ_OTF_MAX_TOKENS = 2
# field 0 of a K-quant (or IQ4) matrix's 13-int descriptor, the shape of QuantizedTensor.descriptor, so that one table
# of a fused step holds both (KQuantTensor.descriptor: flag, kind, weights per block, rows, cols, address, bytes, 0s);
# no Colibri width or flag (bits | ROWS16_FLAG) equals it
KQUANT_FLAG = 64
_I32 = ir.IntType(32)


def _vi(values):
    return ir.Constant(ir.VectorType(_I32, 16), [ir.Constant(_I32, v) for v in values])


_VF = ir.VectorType(ir.FloatType(), 16)


@intrinsic
def vkscales(typingctx, raw, off, d, nmin):
    """Q4_K/Q5_K sub-scales of the 12 bytes at raw[off]: lanes j < 8 are d * sc[j], lanes 8 + j are nmin * m[j].

    Bytes 0-3 hold the low 6 bits of sc[0..3], 4-7 of m[0..3]; bytes 8-11 the low 4 bits of sc[4..7] (low
    nibble) and m[4..7] (high nibble), whose top 2 bits are the top bits of bytes 0-3 (sc) and 4-7 (m).
    """
    if not (isinstance(raw, types.Array) and raw.dtype == types.uint8 and d == types.float32 and nmin == types.float32):
        return None

    def codegen(context, builder, sig, args):
        b = builder.zext(_load_vec(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1]),
                                   ir.VectorType(ir.IntType(8), 16), 1), ir.VectorType(_I32, 16))
        p = builder.shuffle_vector(b, b, _vi([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11]))
        q = builder.shuffle_vector(b, b, _vi([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]))
        low = builder.and_(builder.lshr(p, _vi([0] * 12 + [4] * 4)), _vi([63] * 4 + [15] * 4 + [63] * 4 + [15] * 4))
        top = builder.and_(builder.shl(builder.lshr(q, _vi([6] * 16)), _vi([4] * 16)), _vi(([0] * 4 + [48] * 4) * 2))
        codes = builder.sitofp(builder.or_(low, top), _VF)
        dv = builder.insert_element(ir.Constant(ir.VectorType(ir.FloatType(), 2), ir.Undefined), args[2], ir.Constant(_I32, 0))
        dv = builder.insert_element(dv, args[3], ir.Constant(_I32, 1))
        mul = builder.shuffle_vector(dv, dv, _vi([0] * 8 + [1] * 8))
        return builder.fmul(codes, mul)
    return f32x16(raw, off, d, nmin), codegen


@intrinsic
def vnibscales(typingctx, raw, off, shift, d):
    """Q2_K sub-scales or sub-mins: lanes d * ((raw[off + j] >> shift) & 15), j < 16."""
    if not (isinstance(raw, types.Array) and raw.dtype == types.uint8 and d == types.float32):
        return None

    def codegen(context, builder, sig, args):
        b = builder.zext(_load_vec(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1]),
                                   ir.VectorType(ir.IntType(8), 16), 1), ir.VectorType(_I32, 16))
        sh = _splat_i32(builder, builder.trunc(args[2], _I32) if args[2].type.width > 32 else args[2])
        codes = builder.and_(builder.lshr(b, sh), _vi([15] * 16))
        dv = builder.insert_element(ir.Constant(_VF, ir.Undefined), args[3], ir.Constant(_I32, 0))
        dv = builder.shuffle_vector(dv, dv, _vi([0] * 16))
        return builder.fmul(builder.sitofp(codes, _VF), dv)
    return f32x16(raw, off, shift, d), codegen


@intrinsic
def vq3scales(typingctx, raw, off, d):
    """Q3_K sub-scales of the 12 bytes at raw[off]: lanes d * (sc[j] - 32), sc[j] = low 4 bits from nibble j of bytes
    0-7 (low nibbles first) and high 2 bits from bits 2 (j // 4) of byte 8 + j % 4."""
    if not (isinstance(raw, types.Array) and raw.dtype == types.uint8 and d == types.float32):
        return None

    def codegen(context, builder, sig, args):
        b = builder.zext(_load_vec(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1]),
                                   ir.VectorType(ir.IntType(8), 16), 1), ir.VectorType(_I32, 16))
        low = builder.shuffle_vector(b, b, _vi(list(range(8)) * 2))
        low = builder.and_(builder.lshr(low, _vi([0] * 8 + [4] * 8)), _vi([15] * 16))
        high = builder.shuffle_vector(b, b, _vi([8 + j % 4 for j in range(16)]))
        high = builder.and_(builder.lshr(high, _vi([2 * (j // 4) for j in range(16)])), _vi([3] * 16))
        sc = builder.sub(builder.or_(low, builder.shl(high, _vi([4] * 16))), _vi([32] * 16))
        dv = builder.insert_element(ir.Constant(_VF, ir.Undefined), args[2], ir.Constant(_I32, 0))
        dv = builder.shuffle_vector(dv, dv, _vi([0] * 16))
        return builder.fmul(builder.sitofp(sc, _VF), dv)
    return f32x16(raw, off, d), codegen


@intrinsic
def vi8scales(typingctx, raw, off, d):
    """Q6_K sub-scales: lanes d * int8(raw[off + j]), j < 16."""
    if not (isinstance(raw, types.Array) and raw.dtype == types.uint8 and d == types.float32):
        return None

    def codegen(context, builder, sig, args):
        b = builder.sext(_load_vec(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1]),
                                   ir.VectorType(ir.IntType(8), 16), 1), ir.VectorType(_I32, 16))
        dv = builder.insert_element(ir.Constant(_VF, ir.Undefined), args[2], ir.Constant(_I32, 0))
        dv = builder.shuffle_vector(dv, dv, _vi([0] * 16))
        return builder.fmul(builder.sitofp(b, _VF), dv)
    return f32x16(raw, off, d), codegen


@njit(inline="always")
def _block_bytes(kind):
    """Bytes of one super-block of `kind`."""
    return 144 if kind == Q4_K else 176 if kind == Q5_K else 210 if kind == Q6_K else 84 if kind == Q2_K else 110


@njit(inline="always")
def _stride(kind):
    """Floats of one row's scales in the kernels' stack buffer (`_scales`): Q2_K keeps A and B of 16 sub-blocks."""
    return 32 if kind == Q2_K else 16


@intrinsic
def _u16(typingctx, raw, off):
    """The little-endian uint16 at byte off of a uint8 array (one load, any alignment)."""
    if not (isinstance(raw, types.Array) and raw.dtype == types.uint8):
        return None

    def codegen(context, builder, sig, args):
        ptr = builder.bitcast(_elem_ptr(context, builder, sig.args[0], args[0], args[1]), ir.IntType(16).as_pointer())
        return builder.load(ptr, align=1)
    return types.uint16(raw, off), codegen


@njit(inline="always")
def _f16(raw, o):
    """The fp16 value at byte o of raw as float32."""
    return f16_to_f32(_u16(raw, o))


@njit(inline="always")
def _scales(kind, raw, so, buf, bo):
    """Store the sub-block scales of the super-block at byte so at buf[bo ...] (see `_ab`)."""
    if kind == Q6_K:
        vstore(buf, bo, vi8scales(raw, so + U64(192), _f16(raw, so + U64(208))))
    elif kind == Q3_K:
        vstore(buf, bo, vq3scales(raw, so + U64(96), _f16(raw, so + U64(108))))
    elif kind == Q2_K:
        vstore(buf, bo, vnibscales(raw, so, 0, _f16(raw, so + U64(80))))
        vstore(buf, bo + U64(16), vnibscales(raw, so, 4, -_f16(raw, so + U64(82))))
    else:
        vstore(buf, bo, vkscales(raw, so + U64(4), _f16(raw, so), -_f16(raw, so + U64(2))))


@njit(inline="always")
def _ab(kind, buf, bo, g):
    """(A, B) of 16-weight group g from `_scales`' buffer: Q4_K/Q5_K sub-block g // 2 has A = d * sc at bo + g // 2
    and B = -(dmin * m) at bo + 8 + g // 2; Q6_K sub-block g has A = d * sc at bo + g (and no B); Q2_K sub-block g
    has A at bo + g and B at bo + 16 + g."""
    if kind == Q6_K or kind == Q3_K:
        return buf[bo + U64(g)], F32(0.0)
    if kind == Q2_K:
        return buf[bo + U64(g)], buf[bo + U64(16 + g)]
    return buf[bo + U64(g // 2)], buf[bo + U64(8 + g // 2)]


@njit(inline="always")
def _group(kind, raw, so, g, a, b):
    """The 16 dequantized weights of group g (weights 16g .. 16g + 15) of the super-block at byte so."""
    if kind == Q6_K:
        c = g // 2                      # 32-weight chunk: half h of the super-block, quarter s of it
        h, s, l16 = c // 4, c % 4, U64(16 * (g % 2))
        ql = vcodes8(raw, so + U64(64 * h + 32 * (s % 2)) + l16, raw, U64(0), 0)
        qh = vcodes8(raw, so + U64(128 + 32 * h) + l16, raw, U64(0), 0)
        q = vmerge(vfield(ql, 4 * (s // 2), 15), vfield(qh, 2 * s, 3), 4)
        # (q - 32) * A as gguf computes it (an fma would give +0.0 where gguf gives -0.0)
        return vmul(vfma(vtofloat(q), vsplat(F32(1.0)), vsplat(F32(-32.0))), vsplat(a))
    if kind == Q3_K:
        # low crumbs as Q2_K's (at byte 32); high bit g // 2 of hmask bytes 16 (g % 2) ..; q - 4 with the bit clear
        h, s, l16 = g // 8, (g % 8) // 2, U64(16 * (g % 2))
        ql = vfield(vcodes8(raw, so + U64(32 + 32 * h) + l16, raw, U64(0), 0), 2 * s, 3)
        q = vmerge(ql, vfield(vcodes8(raw, so + l16, raw, U64(0), 0), g // 2, 1), 2)
        return vmul(vfma(vtofloat(q), vsplat(F32(1.0)), vsplat(F32(-4.0))), vsplat(a))
    if kind == Q2_K:
        # group g: half h = g // 8 of the super-block, crumb s = (g % 8) // 2 of the 32 bytes at 16 + 32h
        h, s, l16 = g // 8, (g % 8) // 2, U64(16 * (g % 2))
        q = vfield(vcodes8(raw, so + U64(16 + 32 * h) + l16, raw, U64(0), 0), 2 * s, 3)
        return vfma(vtofloat(q), vsplat(a), vsplat(b))
    c = g // 4                          # 64-weight chunk: 32 bytes, low nibbles then high nibbles
    sub = g // 2                        # 32-weight sub-block
    l16 = U64(16 * (g % 2))
    qs = so + U64(16 if kind == Q4_K else 48)
    q = vfield(vcodes8(raw, qs + U64(32 * c) + l16, raw, U64(0), 0), 4 * (sub % 2), 15)
    if kind == Q5_K:
        q = vmerge(q, vfield(vcodes8(raw, so + U64(16) + l16, raw, U64(0), 0), sub, 1), 4)
    return vfma(vtofloat(q), vsplat(a), vsplat(b))


@njit(cache=True, boundscheck=False)
def kq_dequant_rows(kind, raw, K, r0, nr, dst):
    """Rows r0 .. r0 + nr - 1 of a K-quant (or IQ4) matrix (raw: its bytes, flat) -> dst[i * K + k], float32."""
    if kind == Q4_K:
        _dequant(Q4_K, raw, K, r0, nr, dst)
    elif kind == IQ4_XS:
        iquant.iq_dequant(IQ4_XS, raw, K, r0, nr, dst)
    elif kind == IQ4_NL:
        iquant.iq_dequant(IQ4_NL, raw, K, r0, nr, dst)
    elif kind == Q2_K:
        _dequant(Q2_K, raw, K, r0, nr, dst)
    elif kind == Q3_K:
        _dequant(Q3_K, raw, K, r0, nr, dst)
    elif kind == Q5_K:
        _dequant(Q5_K, raw, K, r0, nr, dst)
    else:
        _dequant(Q6_K, raw, K, r0, nr, dst)


@njit(boundscheck=False)
def _dequant(kind, raw, K, r0, nr, dst):
    literally(kind)
    nsb = K // SUPER
    bs = _block_bytes(kind)
    buf = numba.carray(stack_block(), 128, np.float32)
    for i in range(nr):
        for sb in range(nsb):
            so = (U64(r0 + i) * U64(nsb) + U64(sb)) * U64(bs)
            _scales(kind, raw, so, buf, U64(0))
            o = U64(i) * U64(K) + U64(sb * SUPER)
            for g in range(16):
                a, b = _ab(kind, buf, U64(0), g)
                vstore(dst, o + U64(16 * g), _group(kind, raw, so, g, a, b))


@njit(inline="always")
def _k45w(kind, tab, tab16, q, a, b):
    """16 Q4_K/Q5_K weights of codes q (Q4_K: their low 4 bits): fma(q, a, b), the value the sub-block's table holds
    for q (tab: codes 0 .. 15, tab16: 16 .. 31). The table only on AVX-512, whose permute is one instruction; AVX2's
    lookup (8-lane permutes and blends) is slower than converting."""
    if kind == Q4_K:
        if HAS_AVX512:
            return vlookup16n(tab, q)   # reads an index's low 4 bits: a widened byte indexes its low nibble as it is
        return vfma(vtofloat(vfield(q, 0, 15)), a, b)
    if HAS_AVX512:
        return vlookup(tab, tab16, q)
    return vfma(vtofloat(q), a, b)


# _k45half, _q6half, _q23half and _acc4 are calls, not inlined by numba: inlined, their IR was copied into every
# caller and typed there for every kind (about a minute a kind); as calls each compiles once a kind, in seconds
@njit(boundscheck=False)
def _k45half(kind, raw, so, h, buf, bo, x, xo, acc):
    """acc plus one row's half h (weights 128h .., sub-blocks 4h .. 4h + 3) of a Q4_K/Q5_K super-block at byte so
    times x[xo ...]: 64-weight chunk c takes the low then the high nibbles of code bytes 32c .. 32c + 31 (and
    Q5_K bits 2c, 2c + 1 of the qh bytes)."""
    iota = viota()
    iota16 = vfma(iota, vsplat(F32(1.0)), vsplat(F32(16.0)))     # 16.0 .. 31.0: codes with the high bit
    h0 = vcodes8(raw, so + U64(16), raw, U64(0), 0)          # Q5_K's qh (Q4_K: unused, dropped by LLVM)
    h1 = vcodes8(raw, so + U64(32), raw, U64(0), 0)
    for cc in range(2):
        c = 2 * h + cc
        qs = so + U64(16 if kind == Q4_K else 48) + U64(32 * c)
        xc = xo + U64(64 * cc)
        a0 = vsplat(buf[bo + U64(2 * c)])
        b0 = vsplat(buf[bo + U64(8 + 2 * c)])
        a1 = vsplat(buf[bo + U64(2 * c + 1)])
        b1 = vsplat(buf[bo + U64(9 + 2 * c)])
        lo, hi = vfma(iota, a0, b0), vfma(iota, a1, b1)             # the tables of sub-blocks 2c, 2c + 1
        lo16, hi16 = vfma(iota16, a0, b0), vfma(iota16, a1, b1)
        c0 = vcodes8(raw, qs, raw, U64(0), 0)
        c1 = vcodes8(raw, qs + U64(16), raw, U64(0), 0)
        if kind == Q4_K:
            q0, q1, q2, q3 = c0, c1, vsrl4(c0), vsrl4(c1)
        else:
            q0 = vmerge(vfield(c0, 0, 15), vfield(h0, 2 * c, 1), 4)
            q1 = vmerge(vfield(c1, 0, 15), vfield(h1, 2 * c, 1), 4)
            q2 = vmerge(vfield(c0, 4, 15), vfield(h0, 2 * c + 1, 1), 4)
            q3 = vmerge(vfield(c1, 4, 15), vfield(h1, 2 * c + 1, 1), 4)
        acc = vfma(_k45w(kind, lo, lo16, q0, a0, b0), vload(x, xc), acc)
        acc = vfma(_k45w(kind, lo, lo16, q1, a0, b0), vload(x, xc + U64(16)), acc)
        acc = vfma(_k45w(kind, hi, hi16, q2, a1, b1), vload(x, xc + U64(32)), acc)
        acc = vfma(_k45w(kind, hi, hi16, q3, a1, b1), vload(x, xc + U64(48)), acc)
    return acc


@njit(inline="always")
def _q6w(ql, qh, qshift, hshift, a):
    """16 Q6_K weights: code (ql >> qshift) & 15 | ((qh >> hshift) & 3) << 4, as ((code - 32) * a)."""
    q = vmerge(vfield(ql, qshift, 15), vfield(qh, hshift, 3), 4)
    return vmul(vfma(vtofloat(q), vsplat(F32(1.0)), vsplat(F32(-32.0))), vsplat(a))


@njit(boundscheck=False)
def _q6half(raw, so, h, buf, bo, x, xo, acc):
    """acc plus one row's half h (weights 128h ..) of a Q6_K super-block at byte so times x[xo ...]; the scales of
    its 8 groups at buf[bo ...]. Groups in increasing order: quarter s takes ql bytes 32 (s % 2) .. and nibble s // 2,
    and qh bits 2s."""
    q0 = so + U64(64 * h)
    ql0 = vcodes8(raw, q0, raw, U64(0), 0)
    ql1 = vcodes8(raw, q0 + U64(16), raw, U64(0), 0)
    ql2 = vcodes8(raw, q0 + U64(32), raw, U64(0), 0)
    ql3 = vcodes8(raw, q0 + U64(48), raw, U64(0), 0)
    qh0 = vcodes8(raw, so + U64(128 + 32 * h), raw, U64(0), 0)
    qh1 = vcodes8(raw, so + U64(144 + 32 * h), raw, U64(0), 0)
    acc = vfma(_q6w(ql0, qh0, 0, 0, buf[bo]), vload(x, xo), acc)
    acc = vfma(_q6w(ql1, qh1, 0, 0, buf[bo + U64(1)]), vload(x, xo + U64(16)), acc)
    acc = vfma(_q6w(ql2, qh0, 0, 2, buf[bo + U64(2)]), vload(x, xo + U64(32)), acc)
    acc = vfma(_q6w(ql3, qh1, 0, 2, buf[bo + U64(3)]), vload(x, xo + U64(48)), acc)
    acc = vfma(_q6w(ql0, qh0, 4, 4, buf[bo + U64(4)]), vload(x, xo + U64(64)), acc)
    acc = vfma(_q6w(ql1, qh1, 4, 4, buf[bo + U64(5)]), vload(x, xo + U64(80)), acc)
    acc = vfma(_q6w(ql2, qh0, 4, 6, buf[bo + U64(6)]), vload(x, xo + U64(96)), acc)
    return vfma(_q6w(ql3, qh1, 4, 6, buf[bo + U64(7)]), vload(x, xo + U64(112)), acc)


@njit(inline="always")
def _q23w(kind, qs, hm, s, bit, buf, bo, g):
    """16 Q2_K or Q3_K weights of group g: crumb s of the code bytes qs (and, Q3_K, bit `bit` of the hmask bytes hm)."""
    a, b = _ab(kind, buf, bo, g)
    if kind == Q2_K:
        return vfma(vtofloat(vfield(qs, 2 * s, 3)), vsplat(a), vsplat(b))
    q = vmerge(vfield(qs, 2 * s, 3), vfield(hm, bit, 1), 2)
    return vmul(vfma(vtofloat(q), vsplat(F32(1.0)), vsplat(F32(-4.0))), vsplat(a))


@njit(boundscheck=False)
def _q23half(kind, raw, so, h, buf, bo, x, xo, acc):
    """acc plus one row's half h (weights 128h ..) of a Q2_K or Q3_K super-block at byte so times x[xo ...]: group
    8h + 2s + p takes crumb s of code bytes 16p .. of the half (and Q3_K bit 4h + s of hmask bytes 16p ..)."""
    base = so + U64((16 if kind == Q2_K else 32) + 32 * h)
    qs0 = vcodes8(raw, base, raw, U64(0), 0)
    qs1 = vcodes8(raw, base + U64(16), raw, U64(0), 0)
    hm0 = vcodes8(raw, so, raw, U64(0), 0)
    hm1 = vcodes8(raw, so + U64(16), raw, U64(0), 0)
    g = 8 * h
    acc = vfma(_q23w(kind, qs0, hm0, 0, 4 * h, buf, bo, g), vload(x, xo), acc)
    acc = vfma(_q23w(kind, qs1, hm1, 0, 4 * h, buf, bo, g + 1), vload(x, xo + U64(16)), acc)
    acc = vfma(_q23w(kind, qs0, hm0, 1, 4 * h + 1, buf, bo, g + 2), vload(x, xo + U64(32)), acc)
    acc = vfma(_q23w(kind, qs1, hm1, 1, 4 * h + 1, buf, bo, g + 3), vload(x, xo + U64(48)), acc)
    acc = vfma(_q23w(kind, qs0, hm0, 2, 4 * h + 2, buf, bo, g + 4), vload(x, xo + U64(64)), acc)
    acc = vfma(_q23w(kind, qs1, hm1, 2, 4 * h + 2, buf, bo, g + 5), vload(x, xo + U64(80)), acc)
    acc = vfma(_q23w(kind, qs0, hm0, 3, 4 * h + 3, buf, bo, g + 6), vload(x, xo + U64(96)), acc)
    return vfma(_q23w(kind, qs1, hm1, 3, 4 * h + 3, buf, bo, g + 7), vload(x, xo + U64(112)), acc)


@njit(boundscheck=False)
def _acc4(kind, raw, so, step, buf, x, xo, acc0, acc1, acc2, acc3):
    """The four accumulators plus one super-block of 4 rows (row j's block at so + j * step) times x[xo ...]."""
    literally(kind)
    if kind == Q6_K:
        for h in range(2):              # 128-weight halves: 8 groups of 16 share 64 ql and 32 qh bytes
            xh = xo + U64(128 * h)
            acc0 = _q6half(raw, so, h, buf, U64(8 * h), x, xh, acc0)
            acc1 = _q6half(raw, so + step, h, buf, U64(16 + 8 * h), x, xh, acc1)
            acc2 = _q6half(raw, so + U64(2) * step, h, buf, U64(32 + 8 * h), x, xh, acc2)
            acc3 = _q6half(raw, so + U64(3) * step, h, buf, U64(48 + 8 * h), x, xh, acc3)
        return acc0, acc1, acc2, acc3
    if kind == Q2_K or kind == Q3_K:
        st = U64(_stride(kind))
        for h in range(2):              # 128-weight halves: 8 groups of 16 share 32 code bytes
            xh = xo + U64(128 * h)
            acc0 = _q23half(kind, raw, so, h, buf, U64(0), x, xh, acc0)
            acc1 = _q23half(kind, raw, so + step, h, buf, st, x, xh, acc1)
            acc2 = _q23half(kind, raw, so + U64(2) * step, h, buf, U64(2) * st, x, xh, acc2)
            acc3 = _q23half(kind, raw, so + U64(3) * step, h, buf, U64(3) * st, x, xh, acc3)
        return acc0, acc1, acc2, acc3
    for h in range(2):                  # 128-weight halves: 2 chunks of 64 weights
        xh = xo + U64(128 * h)
        acc0 = _k45half(kind, raw, so, h, buf, U64(0), x, xh, acc0)
        acc1 = _k45half(kind, raw, so + step, h, buf, U64(16), x, xh, acc1)
        acc2 = _k45half(kind, raw, so + U64(2) * step, h, buf, U64(32), x, xh, acc2)
        acc3 = _k45half(kind, raw, so + U64(3) * step, h, buf, U64(48), x, xh, acc3)
    return acc0, acc1, acc2, acc3


@njit(boundscheck=False)
def kq_otf_rows(kind, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0):
    """K-quant (or IQ4) rows r0 .. r0 + nr - 1 times tokens i0 .. i1 - 1 -> out[orows[i] * ldo + col0 + row - r0]."""
    if kind & KROWS16:
        krows16_rows(kind, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)
    elif kind == Q4_K:
        _otf(Q4_K, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)
    elif kind == IQ4_XS:
        iquant.iq_otf(IQ4_XS, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)
    elif kind == IQ4_NL:
        iquant.iq_otf(IQ4_NL, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)
    elif kind == Q2_K:
        _otf(Q2_K, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)
    elif kind == Q3_K:
        _otf(Q3_K, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)
    elif kind == Q5_K:
        _otf(Q5_K, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)
    else:
        _otf(Q6_K, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)


@njit(boundscheck=False)
def _otf(kind, raw, K, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0):
    literally(kind)
    nsb = K // SUPER
    bs = _block_bytes(kind)
    step = U64(nsb) * U64(bs)           # bytes per row
    buf = numba.carray(stack_block(), 128, np.float32)   # [row 0..3][16 scales, see _ab]
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
                for sb in range(nsb):
                    so = U64(r) * step + U64(sb * bs)
                    for j in range(4):
                        _scales(kind, raw, so + U64(j) * step, buf, U64(_stride(kind) * j))
                        prefetch(raw, so + U64(j + 4) * step)
                        prefetch(raw, so + U64(j + 4) * step + U64(64))
                        prefetch(raw, so + U64(j + 4) * step + U64(128))
                    acc0, acc1, acc2, acc3 = _acc4(kind, raw, so, step, buf, x, xo + U64(sb * SUPER),
                                                   acc0, acc1, acc2, acc3)
                out[o] = vsum(acc0)
                out[o + U64(1)] = vsum(acc1)
                out[o + U64(2)] = vsum(acc2)
                out[o + U64(3)] = vsum(acc3)
            else:
                for j in range(rows):
                    acc = vzero()
                    for sb in range(nsb):
                        so = U64(r + j) * step + U64(sb * bs)
                        _scales(kind, raw, so, buf, U64(0))
                        for g in range(16):
                            xv = vload(x, xo + U64(sb * SUPER + 16 * g))
                            a, b = _ab(kind, buf, U64(0), g)
                            acc = vfma(_group(kind, raw, so, g, a, b), xv, acc)
                    out[o + U64(j)] = vsum(acc)
        r += 4


@njit(boundscheck=False)
def kq_rows(kind, raw, K, r0, r1, x, xrows, orows, i0, i1, out, ldo, col0, scratch):
    """Rows r0 .. r1 - 1 times tokens i0 .. i1 - 1: on the fly for few tokens, else a dequantized 4-row tile (the
    16-row layout runs its integer kernel for any count of tokens)."""
    if i1 - i0 <= KQ_OTF_MAX_TOKENS or kind & KROWS16:
        kq_otf_rows(kind, raw, K, r0, r1 - r0, x, xrows, orows, i0, i1, out, ldo, col0)
        return
    r = r0
    while r < r1:
        nr = min(TILE, r1 - r)
        kq_dequant_rows(kind, raw, K, r, nr, scratch)
        tile_rows(scratch, U64(0), K, nr, x, xrows, orows, i0, i1, out, ldo, col0 + r - r0)
        r += TILE


@njit(boundscheck=False)
def kq_desc_rows(desc, r0, nr, x, xrows, orows, i0, i1, out, ldo, col0):
    """Rows r0 .. r0 + nr - 1 of the K-quant matrix a 13-int descriptor describes (KQuantTensor.descriptor) times
    tokens i0 .. i1 - 1, on the fly -> out[orows[i] * ldo + col0 + row - r0] (the bits `kq_otf_rows` gives)."""
    raw = numba.carray(address_as_voidptr(desc[5]), (desc[6],), np.uint8)
    kq_otf_rows(desc[1], raw, desc[4], r0, nr, x, xrows, orows, i0, i1, out, ldo, col0)


@njit
def kq_matrix(desc):
    """(kind, rows, cols, raw bytes) of a K-quant descriptor (KQuantTensor.kq_descriptor)."""
    raw = numba.carray(address_as_voidptr(desc[3]), (desc[4],), np.uint8)
    return desc[0], desc[1], desc[2], raw


@njit(parallel=True, cache=True, boundscheck=False)
def kq_run_items(table, items, pieces, x, xrows, orows, out):
    """Work items (engine/kernels/matmul.py's `matmul_items`) over K-quant matrices `table` [M, DESC_FIELDS]. The
    tokens of rows16 matrices are quantized once, before the pieces."""
    q6 = (table[:, 0] == (Q6_K | KROWS16)).any()             # Q6_K's products also need the sums of 16 codes
    n, q, dq, sq, s16 = prequantize(x, xrows, shared_width(table[:, 0], table[:, 2], KROWS16), q6)
    for p in prange(pieces.shape[0] - 1):
        for j in range(pieces[p], pieces[p + 1]):
            kind, _, cols, raw = kq_matrix(table[items[j, 0]])
            r0, r1, i0, i1, base, ldo = items[j, 1], items[j, 2], items[j, 3], items[j, 4], items[j, 5], items[j, 6]
            if kind & KROWS16 and n:
                krows16_rows_pre(kind, raw, cols, r0, r1 - r0, x, xrows, orows, i0, i1, out[base:], ldo, r0, q, dq, sq,
                                 s16, True)
                continue
            scratch = np.empty(TILE * cols if i1 - i0 > KQ_OTF_MAX_TOKENS and not kind & KROWS16 else 0, np.float32)
            kq_rows(kind, raw, cols, r0, r1, x, xrows, orows, i0, i1, out[base:], ldo, r0, scratch)


@njit(cache=True, boundscheck=False)
def kq_gather_rows(desc, ids, dst):
    """Rows ids [T] of a K-quant matrix -> dst flat [T, cols], float32 (the dequantized weights)."""
    kind, _, cols, raw = kq_matrix(desc)
    for i in range(ids.shape[0]):
        kq_dequant_rows(kind, raw, cols, ids[i], 1, dst[i * cols:])
