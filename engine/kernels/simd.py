"""A 16-lane float32 vector type for numba kernels, and the few operations the kernels need.

LLVM's auto-vectoriser is fragile on these loops (it may leave a dot product scalar, or vectorise
one loop and not its twin), and a float reduction it *does* vectorise changes the order of
additions. Writing the lanes out explicitly fixes both: every kernel accumulates a dot product in
the same 16 lanes (lane j sums the products of the indices k = j mod 16, in increasing k, with one
fused multiply-add each) and reduces them by the same fixed tree (`vsum`). That order is what
makes results bitwise identical whatever the batch size, tiling or thread count.

The vector is LLVM's `<16 x float>`: AVX-512 keeps it in one register, AVX2 in two. Operations
are generic LLVM IR (fma, masked loads, fp16 extension, prefetch), so the code compiles for any
x86-64 or ARM CPU; the one exception, a table lookup by lane (vpermps), is used only when the CPU
numba compiles for has AVX-512 (`HAS_AVX512`: one permute) or AVX2 (`HAS_AVX2`: 8-lane permutes and
blends) and has a generic fallback giving the same values.
Code loaders (`vcodes*`) unpack one half (16 codes) of a 32-weight block of each packed layout
(see `engine/kernels/layout.py`) into integer lanes.
"""

from __future__ import annotations

import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from engine import jit_cache

# every cached engine kernel imports this module first: from here on numba stamps their cache entries with
# all the engine's sources, so a kernel is never loaded with stale code linked from another file
jit_cache.install()

LANES = 16

_F32 = ir.FloatType()
_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_VF = ir.VectorType(_F32, LANES)
_VI = ir.VectorType(_I32, LANES)
_VB = ir.VectorType(_I8, LANES)


class F32x16Type(types.Type):
    """numba type of 16 float32 lanes held in registers."""

    def __init__(self) -> None:
        super().__init__(name="f32x16")


class I32x16Type(types.Type):
    """numba type of 16 int32 lanes held in registers (unpacked codes)."""

    def __init__(self) -> None:
        super().__init__(name="i32x16")


f32x16 = F32x16Type()
i32x16 = I32x16Type()


@register_model(F32x16Type)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF)


@register_model(I32x16Type)
class _I32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI)


def _host_has(feature: str) -> bool:
    """Whether the CPU numba compiles for has an x86 feature (False when numba targets a named CPU)."""
    from numba.core import config

    if config.CPU_NAME not in (None, "host"):  # e.g. a portable build for a generic CPU
        return False
    try:
        import llvmlite.binding as llvm
        return bool(llvm.get_host_cpu_features().get(feature, False))
    except Exception:  # non-x86 hosts, or an llvmlite without feature queries
        return False


HAS_AVX512 = _host_has("avx512f")
HAS_AVX2 = _host_has("avx2")    # 8-lane vpermps: a 16-lane lookup in two permutes per 8-entry piece of the table
HAS_F16C = _host_has("f16c")    # fp16 <-> float32 conversion instructions (the KV cache's fp16 rows)


def _ivec(values: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(values)), [ir.Constant(_I32, v) for v in values])


def _elem_ptr(context, builder, arrty, arr, off):
    """Pointer to element `off` of a 1-D array (no bounds or wraparound checks: callers own that)."""
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.gep(data, [off])


def _load_vec(builder, ptr, vec_type, align):
    return builder.load(builder.bitcast(ptr, vec_type.as_pointer()), align=align)


def _splat_i32(builder, value):
    v = builder.insert_element(ir.Constant(_VI, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(_VI, ir.Undefined), _ivec([0] * LANES))


def _as_i32(builder, value):
    return builder.trunc(value, _I32) if value.type.width > 32 else builder.zext(value, _I32) if value.type.width < 32 else value


def _f16_bits_to_f32(builder, h):
    """fp16 bit patterns (i32 scalar or vector, high bits zero) -> float32, exact for every value.

    A normal half's exponent is rebased in the integers (e + 112) under its sign and mantissa; a subnormal half
    is its mantissa m as a float times 2**-24, whose product is a normal float32; infinities and NaNs keep an
    all-ones exponent. No arithmetic ever sees a float32 subnormal: on x86 such an operand costs a microcode
    assist of about a hundred cycles, and GGUF's Q6_K super-block scales are subnormal halves in many models.
    Integer ops, a conversion and one multiply, so no fp16 support (F16C) or runtime helper is needed.
    """
    ty = h.type
    vec = isinstance(ty, ir.VectorType)
    fty = ir.VectorType(_F32, ty.count) if vec else _F32

    def const(v):
        return ir.Constant(ty, [ir.Constant(_I32, v)] * ty.count) if vec else ir.Constant(_I32, v)

    sign = builder.shl(builder.and_(h, const(0x8000)), const(16))
    exp = builder.and_(builder.lshr(h, const(10)), const(0x1F))
    mant = builder.and_(h, const(0x3FF))
    top = builder.icmp_unsigned("==", exp, const(0x1F))                     # infinity or NaN
    rebased = builder.select(top, const(0xFF), builder.add(exp, const(112)))
    normal = builder.or_(builder.or_(sign, builder.shl(rebased, const(23))), builder.shl(mant, const(13)))
    scale = ir.Constant(_F32, 2.0 ** -24)
    tiny = builder.fmul(builder.sitofp(mant, fty), ir.Constant(fty, [scale] * ty.count) if vec else scale)
    tiny = builder.or_(builder.bitcast(tiny, ty), sign)                     # (zero keeps its sign)
    bits = builder.select(builder.icmp_unsigned("==", exp, const(0)), tiny, normal)
    return builder.bitcast(bits, fty)


def halves_to_f32(builder, bits):
    """16 fp16 bit patterns (<16 x i16>) -> float32 lanes, exact: one conversion instruction where the CPU has F16C
    (the same values as the integer path for finite inputs), else `_f16_bits_to_f32`."""
    if HAS_F16C:
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)), _VF)
    return _f16_bits_to_f32(builder, builder.zext(bits, _VI))


def _permute8(builder, table, ix):
    """Lane j = table[ix[j] & 15] (16-lane table and indices) by AVX2's 8-lane vpermps, which reads an index's low 3
    bits: each 8-lane half of ix permutes both halves of the table and bit 3 picks one."""
    v8f, v8i = ir.VectorType(_F32, 8), ir.VectorType(_I32, 8)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8f, [v8f, v8i]), "llvm.x86.avx2.permps")
    low = builder.shuffle_vector(table, table, _ivec(list(range(8))))
    high = builder.shuffle_vector(table, table, _ivec(list(range(8, 16))))
    out = []
    for h in range(2):
        i = builder.shuffle_vector(ix, ix, _ivec(list(range(8 * h, 8 * h + 8))))
        bit3 = builder.icmp_unsigned("!=", builder.and_(i, ir.Constant(v8i, [ir.Constant(_I32, 8)] * 8)),
                                     ir.Constant(v8i, [ir.Constant(_I32, 0)] * 8))
        out.append(builder.select(bit3, builder.call(fn, [high, i]), builder.call(fn, [low, i])))
    return builder.shuffle_vector(out[0], out[1], _ivec(list(range(LANES))))


# -- float vectors ---------------------------------------------------------------------------

@intrinsic
def vzero(typingctx):
    """16 lanes of +0.0."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_VF, [ir.Constant(_F32, 0.0)] * LANES)
    return f32x16(), codegen


@intrinsic
def vsplat(typingctx, x):
    """16 lanes of the float32 `x`."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        v = builder.insert_element(ir.Constant(_VF, ir.Undefined), args[0], ir.Constant(_I32, 0))
        return builder.shuffle_vector(v, ir.Constant(_VF, ir.Undefined), _ivec([0] * LANES))
    return f32x16(types.float32), codegen


@intrinsic
def vload(typingctx, arr, off):
    """Lanes arr[off : off + 16] of a 1-D float32 array."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        return _load_vec(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1]), _VF, 4)
    return f32x16(arr, off), codegen


@intrinsic
def vstore(typingctx, arr, off, v):
    """arr[off : off + 16] = lanes of v (1-D float32 array)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
        builder.store(args[2], builder.bitcast(ptr, _VF.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(arr, off, f32x16), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """a * b + c per lane with one rounding (IEEE fused multiply-add)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3), "llvm.fma.v16f32")
        return builder.call(fn, args)
    return f32x16(f32x16, f32x16, f32x16), codegen


@intrinsic
def vsum(typingctx, a):
    """Sum of the 16 lanes by a fixed tree: halves added lane-wise (j + 8, then + 4, + 2, + 1)."""
    def codegen(context, builder, sig, args):
        v, n = args[0], LANES
        while n > 1:
            h = n // 2
            lo = builder.shuffle_vector(v, v, _ivec(list(range(h))))
            hi = builder.shuffle_vector(v, v, _ivec(list(range(h, n))))
            v, n = builder.fadd(lo, hi), h
        return builder.extract_element(v, ir.Constant(_I32, 0))
    return types.float32(f32x16), codegen


# -- scalars ---------------------------------------------------------------------------------

@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c for float32 scalars with one rounding (the same operation as a `vfma` lane)."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
        return builder.call(fn, args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def f16_to_f32(typingctx, h):
    """fp16 bits (uint16) -> float32, exact for every finite value (subnormals included)."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _f16_bits_to_f32(builder, _as_i32(builder, args[0]))
    return types.float32(h), codegen


@intrinsic
def address_as_voidptr(typingctx, addr):
    """A raw address (int64) as a pointer, for numba.carray over buffers handed in by address."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(addr), codegen


# -- packed codes -> float lanes ---------------------------------------------------------------
# Each loader returns the 16 codes of half `half` (0: weights 0..15 of the block, 1: 16..31) of
# the 32-weight block whose plane bytes start at `off`. Codes are unsigned integers.

def _nibbles(builder, ptr, half):
    b = builder.zext(_load_vec(builder, ptr, _VB, 1), _VI)
    shift = _splat_i32(builder, builder.mul(_as_i32(builder, half), ir.Constant(_I32, 4)))
    return builder.and_(builder.lshr(b, shift), _splat_i32(builder, ir.Constant(_I32, 15)))


def _bytes(builder, ptr, half):
    p = builder.gep(ptr, [builder.mul(_as_i32(builder, half), ir.Constant(_I32, 16))])
    return builder.zext(_load_vec(builder, p, _VB, 1), _VI)


def _word(builder, ptr, index):
    p = builder.bitcast(builder.gep(ptr, [builder.mul(index, ir.Constant(_I32, 4))]), _I32.as_pointer())
    return _splat_i32(builder, builder.load(p, align=1))


def _crumbs(builder, ptr, half):
    w = _word(builder, ptr, _as_i32(builder, half))  # word `half` holds the 16 two-bit codes
    return builder.and_(builder.lshr(w, _ivec([2 * j for j in range(LANES)])), _splat_i32(builder, ir.Constant(_I32, 3)))


def _bits(builder, ptr, half):
    w = _word(builder, ptr, ir.Constant(_I32, 0))  # one word, bit k = weight k of the block
    shift = builder.add(_ivec(list(range(LANES))), _splat_i32(builder, builder.mul(_as_i32(builder, half), ir.Constant(_I32, 16))))
    return builder.and_(builder.lshr(w, shift), _splat_i32(builder, ir.Constant(_I32, 1)))


def _codes_intrinsic(main, aux=None, aux_shift=0):
    """Build an intrinsic (a, a_off, b, b_off, half) -> i32x16 of codes main | aux << aux_shift."""

    def typer(typingctx, a, a_off, b, b_off, half):
        def codegen(context, builder, sig, args):
            pa = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
            codes = main(builder, pa, args[4])
            if aux is not None:
                pb = _elem_ptr(context, builder, sig.args[2], args[2], args[3])
                high = builder.shl(aux(builder, pb, args[4]), _splat_i32(builder, ir.Constant(_I32, aux_shift)))
                codes = builder.or_(codes, high)
            return codes
        return i32x16(a, a_off, b, b_off, half), codegen

    return intrinsic(typer)


vcodes8 = _codes_intrinsic(_bytes)
vcodes6 = _codes_intrinsic(_nibbles, _crumbs, 4)
vcodes5 = _codes_intrinsic(_nibbles, _bits, 4)
vcodes4 = _codes_intrinsic(_nibbles)
vcodes3 = _codes_intrinsic(_crumbs, _bits, 2)
vcodes2 = _codes_intrinsic(_crumbs)


@intrinsic
def vtofloat(typingctx, codes):
    """Unsigned integer lanes -> float32 lanes (exact below 2**24)."""
    def codegen(context, builder, sig, args):
        return builder.uitofp(args[0], _VF)
    return f32x16(i32x16), codegen


@intrinsic
def viota(typingctx):
    """Lanes 0.0, 1.0, ..., 15.0."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_VF, [ir.Constant(_F32, float(i)) for i in range(LANES)])
    return f32x16(), codegen


@intrinsic
def vlookup(typingctx, low, high, idx):
    """Lane j = table[idx[j]] from a 32-entry table (entries 0-15 in `low`, 16-31 in `high`); idx < 32.

    On AVX-512 one two-table permute (vpermi2ps; LLVM uses a one-table vpermps when `high` is
    unused); on AVX2 8-lane permutes of each table and a select by bit 4; elsewhere a per-lane
    select, which gives the same values.
    """
    def codegen(context, builder, sig, args):
        lo, hi, ix = args
        if HAS_AVX512:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_VF, [_VF, _VI, _VF]), "llvm.x86.avx512.vpermi2var.ps.512")
            return builder.call(fn, [lo, ix, hi])
        if HAS_AVX2:
            in_high = builder.icmp_unsigned("!=", builder.and_(ix, _splat_i32(builder, ir.Constant(_I32, LANES))),
                                            _splat_i32(builder, ir.Constant(_I32, 0)))
            return builder.select(in_high, _permute8(builder, hi, ix), _permute8(builder, lo, ix))
        out = ir.Constant(_VF, ir.Undefined)
        for j in range(LANES):
            k = builder.extract_element(ix, ir.Constant(_I32, j))
            in_low = builder.icmp_unsigned("<", k, ir.Constant(_I32, LANES))
            k16 = builder.and_(k, ir.Constant(_I32, LANES - 1))
            v = builder.select(in_low, builder.extract_element(lo, k16), builder.extract_element(hi, k16))
            out = builder.insert_element(out, v, ir.Constant(_I32, j))
        return out
    return f32x16(f32x16, f32x16, i32x16), codegen


@intrinsic
def vhalves(typingctx, arr, off, n):
    """Lanes float32(arr[off + j]) for j < n (arr holds fp16 bits as uint16), 0.0 beyond; reads only n values."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint16 and arr.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        vh = ir.VectorType(ir.IntType(16), LANES)
        ptr = builder.bitcast(_elem_ptr(context, builder, sig.args[0], args[0], args[1]), vh.as_pointer())
        count = _splat_i32(builder, _as_i32(builder, args[2]))
        mask = builder.icmp_signed("<", _ivec(list(range(LANES))), count)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vh, [vh.as_pointer(), _I32, ir.VectorType(ir.IntType(1), LANES), vh]),
            "llvm.masked.load.v16i16.p0")
        bits = builder.call(fn, [ptr, ir.Constant(_I32, 2), mask, ir.Constant(vh, [ir.Constant(ir.IntType(16), 0)] * LANES)])
        return _f16_bits_to_f32(builder, builder.zext(bits, _VI))
    return f32x16(arr, off, n), codegen


@intrinsic
def vmul(typingctx, a, b):
    """a * b per lane."""
    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1])
    return f32x16(f32x16, f32x16), codegen


@intrinsic
def vlookup16(typingctx, table, idx):
    """Lane j = table[idx[j]] from a 16-entry table; idx < 16 (vpermps on AVX-512, `_permute8` on AVX2, a per-lane
    select elsewhere)."""
    def codegen(context, builder, sig, args):
        tab, ix = args
        if HAS_AVX512:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_VF, [_VF, _VI]), "llvm.x86.avx512.permvar.sf.512")
            return builder.call(fn, [tab, ix])
        if HAS_AVX2:
            return _permute8(builder, tab, ix)
        out = ir.Constant(_VF, ir.Undefined)
        for j in range(LANES):
            v = builder.extract_element(tab, builder.extract_element(ix, ir.Constant(_I32, j)))
            out = builder.insert_element(out, v, ir.Constant(_I32, j))
        return out
    return f32x16(f32x16, i32x16), codegen


@intrinsic
def vloadf(typingctx, arr, off):
    """Lanes arr[off : off + 16] of a 1-D float32 array, or of an int8 array or a uint16 array of fp16 bits
    converted to float32 (exact)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype in (types.float32, types.int8, types.uint16)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
        if sig.args[0].dtype == types.float32:
            return _load_vec(builder, ptr, _VF, 4)
        if sig.args[0].dtype == types.uint16:
            return halves_to_f32(builder, _load_vec(builder, ptr, ir.VectorType(ir.IntType(16), LANES), 2))
        return builder.sitofp(_load_vec(builder, ptr, _VB, 1), _VF)
    return f32x16(arr, off), codegen


@intrinsic
def tof32(typingctx, x):
    """One stored value as float32: a float32 as it is, an int8 exactly, a uint16 read as fp16 bits (exact)."""
    if x not in (types.float32, types.int8, types.uint16):
        return None

    def codegen(context, builder, sig, args):
        if sig.args[0] == types.float32:
            return args[0]
        if sig.args[0] == types.uint16:
            return _f16_bits_to_f32(builder, builder.zext(args[0], _I32))
        return builder.sitofp(args[0], _F32)
    return types.float32(x), codegen


@intrinsic
def f32_to_f16(typingctx, x):
    """float32 -> fp16 bits (uint16), rounded to nearest even as numpy's astype(np.float16) does."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        half = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(half, ir.IntType(16))
    return types.uint16(x), codegen


def _vconst(value: float) -> ir.Constant:
    return ir.Constant(_VF, [ir.Constant(_F32, value)] * LANES)


def _vcall(builder, name: str, args, ret=_VF):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _vexp(builder, x):
    """e**x per lane in float32 (Cephes' expf: 2**n times a degree-7 polynomial on [-ln2/2, ln2/2], within
    2 ulp), x clamped to [-87, 88] so that no lane overflows or goes subnormal."""
    fma = "llvm.fma.v16f32"
    x = _vcall(builder, "llvm.minnum.v16f32", [_vcall(builder, "llvm.maxnum.v16f32", [x, _vconst(-87.0)]), _vconst(88.0)])
    n = _vcall(builder, "llvm.rint.v16f32", [builder.fmul(x, _vconst(1.44269504088896341))])
    r = _vcall(builder, fma, [n, _vconst(-0.693359375), x])
    r = _vcall(builder, fma, [n, _vconst(2.12194440e-4), r])
    y = _vconst(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = _vcall(builder, fma, [y, r, _vconst(c)])
    y = _vcall(builder, fma, [y, builder.fmul(r, r), r])
    y = builder.fadd(y, _vconst(1.0))
    bits = builder.shl(builder.add(builder.fptosi(n, _VI), _splat_i32(builder, ir.Constant(_I32, 127))),
                       _splat_i32(builder, ir.Constant(_I32, 23)))
    return builder.fmul(y, builder.bitcast(bits, _VF))


@intrinsic
def vexp(typingctx, v):
    """e**v per lane (see _vexp): the exponential of softmaxes and SiLU, the same bits wherever it runs."""
    def codegen(context, builder, sig, args):
        return _vexp(builder, args[0])
    return f32x16(f32x16), codegen


@intrinsic
def vsilu(typingctx, g, u):
    """silu(g) * u per lane: (g / (1 + e**-g)) * u."""
    def codegen(context, builder, sig, args):
        g_, u_ = args
        e = _vexp(builder, builder.fneg(g_))
        return builder.fmul(builder.fdiv(g_, builder.fadd(_vconst(1.0), e)), u_)
    return f32x16(f32x16, f32x16), codegen


def _lane_mask(builder, n):
    return builder.icmp_signed("<", _ivec(list(range(LANES))), _splat_i32(builder, _as_i32(builder, n)))


@intrinsic
def vload_part(typingctx, arr, off, n):
    """Lanes arr[off : off + n] of a 1-D float32 array, n <= 16, zeros beyond; reads only n values."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        ptr = builder.bitcast(_elem_ptr(context, builder, sig.args[0], args[0], args[1]), _VF.as_pointer())
        mask = _lane_mask(builder, args[2])
        return _vcall(builder, "llvm.masked.load.v16f32.p0", [ptr, ir.Constant(_I32, 4), mask, _vconst(0.0)])
    return f32x16(arr, off, n), codegen


@intrinsic
def vstore_part(typingctx, arr, off, v, n):
    """arr[off : off + n] = the first n lanes of v (1-D float32 array, n <= 16); writes only n values."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        ptr = builder.bitcast(_elem_ptr(context, builder, sig.args[0], args[0], args[1]), _VF.as_pointer())
        mask = _lane_mask(builder, args[3])
        _vcall(builder, "llvm.masked.store.v16f32.p0", [args[2], ptr, ir.Constant(_I32, 4), mask], ir.VoidType())
        return context.get_dummy_value()
    return types.none(arr, off, f32x16, n), codegen


@intrinsic
def vlookup16n(typingctx, table, idx):
    """Lane j = table[idx[j] & 15] from a 16-entry table, for any idx: vpermps reads only an index's
    low 4 bits, so a byte widened to a lane serves as the index of its low nibble as it is."""
    def codegen(context, builder, sig, args):
        tab, ix = args
        if HAS_AVX512:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_VF, [_VF, _VI]), "llvm.x86.avx512.permvar.sf.512")
            return builder.call(fn, [tab, ix])
        if HAS_AVX2:
            return _permute8(builder, tab, ix)
        ix = builder.and_(ix, _splat_i32(builder, ir.Constant(_I32, LANES - 1)))
        out = ir.Constant(_VF, ir.Undefined)
        for j in range(LANES):
            v = builder.extract_element(tab, builder.extract_element(ix, ir.Constant(_I32, j)))
            out = builder.insert_element(out, v, ir.Constant(_I32, j))
        return out
    return f32x16(f32x16, i32x16), codegen


@intrinsic
def vsrl4(typingctx, v):
    """Integer lanes shifted right by 4 bits (the high nibble of a widened byte)."""
    def codegen(context, builder, sig, args):
        return builder.lshr(args[0], _splat_i32(builder, ir.Constant(_I32, 4)))
    return i32x16(i32x16), codegen


@intrinsic
def stack_block(typingctx):
    """Pointer to 128 float32 on the calling function's stack (wrap with numba.carray; never let it escape)."""
    def codegen(context, builder, sig, args):
        buf = cgutils.alloca_once(builder, ir.ArrayType(_F32, 8 * LANES))
        return builder.bitcast(buf, cgutils.voidptr_t)
    return types.voidptr(), codegen


@intrinsic
def prefetch(typingctx, arr, off):
    """Hint the CPU to fetch the cache line of arr[off] (any 1-D array; never faults, even past the end)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), cgutils.voidptr_t)  # no inbounds: may point past the end
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, _I32, _I32, _I32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.none(arr, off), codegen


U64 = np.uint64  # index type of kernel offsets: unsigned, so numba emits no negative-index wraparound
