"""Integer lanes for the rows16 kernels (engine/kernels/rows16.py): byte dot products and 8-bit activations.

64 bytes are held as numba type i32x16 (lane j holds bytes 4j .. 4j + 3). `vdot_bcast` adds to each
int32 lane the four products of its bytes (unsigned weight codes) with the same four signed
activation bytes: one `vpdpbusd` with a broadcast operand where the CPU has AVX512-VNNI, widening
multiplies and adds elsewhere. Integer sums are exact, so both give the same lanes.
"""

from __future__ import annotations

import llvmlite.ir as ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.kernels.simd import (
    _F32,
    _I32,
    _VF,
    _VI,
    HAS_AVX2,
    HAS_AVX512,
    LANES,
    _as_i32,
    _elem_ptr,
    _host_has,
    _ivec,
    _load_vec,
    _splat_i32,
    f32x16,
    halves_to_f32,
    i32x16,
)

HAS_VNNI = HAS_AVX512 and _host_has("avx512vnni")

_I8 = ir.IntType(8)
_V64 = ir.VectorType(_I8, 64)


def _dot4(builder, acc, w, q):
    """acc + per lane the sum of 4 products unsigned w byte * signed q byte (w, q: <64 x i8>)."""
    if HAS_VNNI:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI, [_VI, _V64, _V64]),
                                            "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(fn, [acc, w, q])
    wide = ir.VectorType(_I32, 64)
    p = builder.mul(builder.zext(w, wide), builder.sext(q, wide))
    for k in range(4):
        acc = builder.add(acc, builder.shuffle_vector(p, p, _ivec([4 * j + k for j in range(LANES)])))
    return acc


@intrinsic
def vizero(typingctx):
    """16 integer lanes of 0."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_VI, [ir.Constant(_I32, 0)] * LANES)
    return i32x16(), codegen


@intrinsic
def vnibbles(typingctx, a, off):
    """(low nibbles, high nibbles) of the 64 bytes a[off : off + 64], each as 64 bytes (uint8 array)."""
    if not (isinstance(a, types.Array) and a.dtype == types.uint8 and a.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        raw = _load_vec(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1]), _V64, 1)
        mask = ir.Constant(_V64, [ir.Constant(_I8, 15)] * 64)
        low = builder.and_(raw, mask)
        i16 = ir.VectorType(ir.IntType(16), 32)   # shifted as 16-bit words (bytes have no shift); the mask drops
        four = ir.Constant(i16, [ir.Constant(ir.IntType(16), 4)] * 32)   # what crossed in from the next byte
        high = builder.and_(builder.bitcast(builder.lshr(builder.bitcast(raw, i16), four), _V64), mask)
        return cgutils.make_anonymous_struct(builder, [builder.bitcast(low, _VI), builder.bitcast(high, _VI)])
    return types.UniTuple(i32x16, 2)(a, off), codegen


@intrinsic
def vbytes(typingctx, a, off):
    """The 64 bytes a[off : off + 64] as they are (uint8 array)."""
    if not (isinstance(a, types.Array) and a.dtype == types.uint8 and a.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        return _load_vec(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1]), _VI, 1)
    return i32x16(a, off), codegen


@intrinsic
def vdot_bcast(typingctx, acc, w, q, qoff):
    """acc plus, per lane j, sum over b < 4 of byte 4j + b of w (unsigned) times q[qoff + b] (signed int8)."""
    if not (isinstance(q, types.Array) and q.dtype == types.int8 and q.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        ptr = builder.bitcast(_elem_ptr(context, builder, sig.args[2], args[2], args[3]), _I32.as_pointer())
        chunk = builder.bitcast(_splat_i32(builder, builder.load(ptr, align=1)), _V64)
        return _dot4(builder, args[0], builder.bitcast(args[1], _V64), chunk)
    return i32x16(i32x16, i32x16, q, qoff), codegen


@intrinsic
def visplat(typingctx, s):
    """16 integer lanes of the integer s (taken modulo 2**32)."""
    if not isinstance(s, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _splat_i32(builder, _as_i32(builder, args[0]))
    return i32x16(s), codegen


@intrinsic
def vsub_splat(typingctx, v, s):
    """Integer lanes minus the integer s (taken modulo 2**32, as the lanes are)."""
    if not isinstance(s, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.sub(args[0], _splat_i32(builder, _as_i32(builder, args[1])))
    return i32x16(i32x16, s), codegen


@intrinsic
def vitof(typingctx, v):
    """Signed integer lanes -> float32 (exact below 2**24)."""
    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _VF)
    return f32x16(i32x16), codegen


@intrinsic
def quant_block(typingctx, x, xoff, q, qoff):
    """Quantize the 32 float32 x[xoff : xoff + 32] to signed bytes q[qoff : qoff + 32]; return (d, sum of q).

    amax = the largest magnitude, d = amax / 127 and q = rint(x * (127 / amax)) (round half to even), all in
    float32; an all-zero block gives d = 0 and zero bytes (`quantize_activations` is the numpy twin).
    """
    if not (isinstance(x, types.Array) and x.dtype == types.float32 and isinstance(q, types.Array)
            and q.dtype == types.int8):
        return None

    def codegen(context, builder, sig, args):
        v32 = ir.VectorType(_F32, 32)

        def call(name, ret, *vals):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [v.type for v in vals]), name)
            return builder.call(fn, list(vals))

        xv = _load_vec(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1]), v32, 4)
        amax = call("llvm.vector.reduce.fmax.v32f32", _F32, call("llvm.fabs.v32f32", v32, xv))
        zero = ir.Constant(_F32, 0.0)
        inv = builder.select(builder.fcmp_ordered(">", amax, zero), builder.fdiv(ir.Constant(_F32, 127.0), amax), zero)
        splat = builder.shuffle_vector(builder.insert_element(ir.Constant(v32, ir.Undefined), inv, ir.Constant(_I32, 0)),
                                       ir.Constant(v32, ir.Undefined), _ivec([0] * 32))
        r = call("llvm.rint.v32f32", v32, builder.fmul(xv, splat))
        qv = builder.fptosi(r, ir.VectorType(_I8, 32))
        ptr = _elem_ptr(context, builder, sig.args[2], args[2], args[3])
        builder.store(qv, builder.bitcast(ptr, ir.VectorType(_I8, 32).as_pointer()), align=1)
        total = call("llvm.vector.reduce.add.v32i32", _I32, builder.sext(qv, ir.VectorType(_I32, 32)))
        d = builder.fdiv(amax, ir.Constant(_F32, 127.0))
        return cgutils.make_anonymous_struct(builder, [d, total])
    return types.Tuple((types.float32, types.int32))(x, xoff, q, qoff), codegen


@intrinsic
def vfield(typingctx, v, shift, mask):
    """Integer lanes (v >> shift) & mask (shift and mask scalars)."""
    def codegen(context, builder, sig, args):
        s = _splat_i32(builder, _as_i32(builder, args[1]))
        m = _splat_i32(builder, _as_i32(builder, args[2]))
        return builder.and_(builder.lshr(args[0], s), m)
    return i32x16(i32x16, shift, mask), codegen


@intrinsic
def vmerge(typingctx, low, high, up):
    """Integer lanes low | (high << up)."""
    def codegen(context, builder, sig, args):
        return builder.or_(args[0], builder.shl(args[1], _splat_i32(builder, _as_i32(builder, args[2]))))
    return i32x16(i32x16, i32x16, up), codegen


def _byte_array(a) -> bool:
    return isinstance(a, types.Array) and a.dtype == types.uint8 and a.ndim == 1


def _load16(context, builder, sig, args, width):
    """The 16 `width`-bit integers at byte a[off] of a uint8 array (args: a, off), as <16 x iN>."""
    ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
    return _load_vec(builder, ptr, ir.VectorType(ir.IntType(width), LANES), 1)


@intrinsic
def vwiden(typingctx, a, off):
    """The 16 bytes a[off : off + 16] as unsigned integer lanes (uint8 array)."""
    if not _byte_array(a):
        return None

    def codegen(context, builder, sig, args):
        return builder.zext(_load16(context, builder, sig, args, 8), _VI)
    return i32x16(a, off), codegen


@intrinsic
def vsigned_f(typingctx, a, off):
    """The 16 bytes a[off : off + 16] read as int8, as float32 lanes (uint8 array; exact)."""
    if not _byte_array(a):
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(_load16(context, builder, sig, args, 8), _VF)
    return f32x16(a, off), codegen


@intrinsic
def vhalf_f(typingctx, a, off):
    """The 16 fp16 values in the 32 bytes a[off : off + 32] as float32 lanes (uint8 array; exact)."""
    if not _byte_array(a):
        return None

    def codegen(context, builder, sig, args):
        return halves_to_f32(builder, _load16(context, builder, sig, args, 16))
    return f32x16(a, off), codegen


@intrinsic
def vwiden16(typingctx, a, off):
    """The 16 little-endian uint16 in the 32 bytes a[off : off + 32] as integer lanes (uint8 array)."""
    if not _byte_array(a):
        return None

    def codegen(context, builder, sig, args):
        return builder.zext(_load16(context, builder, sig, args, 16), _VI)
    return i32x16(a, off), codegen


@intrinsic
def vlut_bytes(typingctx, v, table):
    """Each byte b of v (all < 16) replaced by byte b of the 16-byte table (a tuple of 16 ints), per lane of 4 bytes:
    `vpshufb` on AVX-512 (or on two halves with AVX2), byte by byte elsewhere."""
    if not isinstance(table, types.UniTuple) or table.count != 16:
        return None

    def codegen(context, builder, sig, args):
        raw = builder.bitcast(args[0], _V64)
        entries = [builder.trunc(builder.extract_value(args[1], j), _I8) for j in range(16)]
        if HAS_AVX512 or HAS_AVX2:
            width = 64 if HAS_AVX512 else 32
            vt = ir.VectorType(_I8, width)
            tab = ir.Constant(vt, ir.Undefined)
            for j in range(width):
                tab = builder.insert_element(tab, entries[j % 16], ir.Constant(_I32, j))
            name = "llvm.x86.avx512.pshuf.b.512" if HAS_AVX512 else "llvm.x86.avx2.pshuf.b"
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt, vt]), name)
            if HAS_AVX512:
                return builder.bitcast(builder.call(fn, [tab, raw]), _VI)
            lo = builder.shuffle_vector(raw, raw, _ivec(list(range(32))))
            hi = builder.shuffle_vector(raw, raw, _ivec(list(range(32, 64))))
            both = builder.shuffle_vector(builder.call(fn, [tab, lo]), builder.call(fn, [tab, hi]), _ivec(list(range(64))))
            return builder.bitcast(both, _VI)
        out = ir.Constant(_V64, ir.Undefined)
        arr = cgutils.alloca_once(builder, ir.ArrayType(_I8, 16))
        for j in range(16):
            builder.store(entries[j], cgutils.gep(builder, arr, 0, j))
        for j in range(64):
            idx = builder.zext(builder.extract_element(raw, ir.Constant(_I32, j)), _I32)
            out = builder.insert_element(out, builder.load(builder.gep(arr, [ir.Constant(_I32, 0), idx])),
                                         ir.Constant(_I32, j))
        return builder.bitcast(out, _VI)
    return i32x16(i32x16, table), codegen

