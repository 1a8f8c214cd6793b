"""Packed layout of group-wise quantized weights: bit planes per 32-weight block, fp16 scales.

A weight matrix [out, in] is cut along `in` into blocks of 32 weights; each row is stored block
after block. A b-bit code u (unsigned, 0 <= u < 2**b) is split into at most two bit planes, so
that the kernels unpack a whole block half (16 lanes) with one load, a shift and a mask:

    bits  plane a (low bits)          plane b (high bits)      bytes per block (a + b)
    8     byte   u                    -                        32
    6     nibble u & 15               crumb (u >> 4) & 3       16 + 8
    5     nibble u & 15               bit   (u >> 4) & 1       16 + 4
    4     nibble u & 15               -                        16
    3     crumb  u & 3                bit   (u >> 2) & 1        8 + 4
    2     crumb  u & 3                -                         8

    nibble: 16 bytes; byte j holds weight j in its low 4 bits and weight 16 + j in its high 4 bits.
    byte:   32 bytes; byte k holds weight k.
    crumb:  two little-endian uint32 words; word h holds weight 16h + j in bits 2j, 2j + 1.
    bit:    one little-endian uint32 word; bit k holds weight k.

So lane j of either half h of a block always holds weight 16h + j, whatever the format.

A group of `group` weights (32, 64 or 128, along `in`) shares a scale d and an offset m, and
w = d * u + m (computed as one fused multiply-add in float32). Symmetric formats store only d
and use m = -2**(b-1) * d, i.e. w = d * (u - 2**(b-1)), exact in float32. Asymmetric formats (the
default at 2 bits, the one width where they pay off per byte) also store m. d and m are fp16, kept as uint16 bits
(numba has no float16): `scales` [out, in / group] and `mins` [out, in / group].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32  # weights per packed block (the unit of the layout; a group is 1, 2 or 4 blocks)
BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)

# kinds of plane: bytes per 32-weight block
PLANE_BYTES = {"byte": 32, "nibble": 16, "crumb": 8, "bit": 4}


@dataclass(frozen=True)
class Format:
    """How one bit width is split into planes, and whether it stores zero points by default."""

    bits: int
    plane_a: str            # kind of the low-bits plane
    plane_b: str | None     # kind of the high-bits plane, None when one plane holds every bit
    a_bits: int             # how many low bits plane a holds
    asymmetric: bool        # default: store fp16 offsets (mins) per group

    @property
    def a_bytes(self) -> int:
        """Bytes of plane a per 32-weight block."""
        return PLANE_BYTES[self.plane_a]

    @property
    def b_bytes(self) -> int:
        """Bytes of plane b per 32-weight block (0 without plane b)."""
        return PLANE_BYTES[self.plane_b] if self.plane_b else 0


FORMATS = {
    8: Format(8, "byte", None, 8, False),
    6: Format(6, "nibble", "crumb", 4, False),
    5: Format(5, "nibble", "bit", 4, False),
    4: Format(4, "nibble", None, 4, False),
    3: Format(3, "crumb", "bit", 2, False),
    2: Format(2, "crumb", None, 2, True),
}


def _pack_plane(codes: np.ndarray, kind: str) -> np.ndarray:
    """Codes [out, nb, 32] (each < 2**width of the kind) -> plane bytes [out, nb * bytes]."""
    out, nb, _ = codes.shape
    if kind == "byte":
        packed = codes.astype(np.uint8)
    elif kind == "nibble":
        packed = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)                  # [out, nb, 16]
    elif kind == "crumb":
        halves = codes.reshape(out, nb, 2, 16).astype(np.uint32)
        words = (halves << (2 * np.arange(16, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32)  # [out, nb, 2]
        packed = words.astype("<u4").view(np.uint8)
    elif kind == "bit":
        words = (codes.astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)  # [out, nb]
        packed = words.astype("<u4")[..., None].view(np.uint8)
    else:
        raise ValueError(f"unknown plane kind {kind!r}")
    return np.ascontiguousarray(packed.reshape(out, nb * PLANE_BYTES[kind]))


def _unpack_plane(plane: np.ndarray, kind: str, nb: int) -> np.ndarray:
    """Plane bytes [out, nb * bytes] -> codes [out, nb, 32] as uint8."""
    out = plane.shape[0]
    raw = np.asarray(plane).reshape(out, nb, PLANE_BYTES[kind])
    if kind == "byte":
        return raw.copy()
    if kind == "nibble":
        return np.concatenate([raw & 15, raw >> 4], axis=-1)
    if kind == "crumb":
        words = raw.view("<u4").astype(np.uint32)                                                # [out, nb, 2]
        codes = (words[..., None] >> (2 * np.arange(16, dtype=np.uint32))) & 3                  # [out, nb, 2, 16]
        return codes.reshape(out, nb, 32).astype(np.uint8)
    if kind == "bit":
        words = raw.view("<u4").astype(np.uint32)                                                # [out, nb, 1]
        return ((words >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    raise ValueError(f"unknown plane kind {kind!r}")


def pack_codes(codes: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Unsigned codes [out, in] (uint8, < 2**bits) -> (plane a, plane b) uint8 [out, bytes per row]."""
    fmt = FORMATS[bits]
    out, n_in = codes.shape
    blocks = codes.reshape(out, n_in // BLOCK, BLOCK)
    low = blocks & ((1 << fmt.a_bits) - 1)
    a = _pack_plane(low, fmt.plane_a)
    if fmt.plane_b is None:
        return a, np.zeros((out, 0), np.uint8)
    return a, _pack_plane(blocks >> fmt.a_bits, fmt.plane_b)


def unpack_codes(a: np.ndarray, b: np.ndarray, bits: int, n_in: int) -> np.ndarray:
    """(plane a, plane b) -> unsigned codes [out, in] uint8 (the inverse of `pack_codes`)."""
    fmt = FORMATS[bits]
    nb = n_in // BLOCK
    codes = _unpack_plane(a, fmt.plane_a, nb)
    if fmt.plane_b is not None:
        codes = codes | (_unpack_plane(b, fmt.plane_b, nb) << fmt.a_bits)
    return codes.reshape(a.shape[0], n_in)


def f16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values -> fp16 bit patterns (uint16), rounded to nearest."""
    return np.asarray(x, np.float32).astype(np.float16).view(np.uint16)


def f16_values(bits: np.ndarray) -> np.ndarray:
    """fp16 bit patterns (uint16) -> float32 values."""
    return np.asarray(bits).view(np.float16).astype(np.float32)


# -- rows16: 4- and 8-bit symmetric codes with 16 rows interleaved ---------------------------------
# The same bytes as the nibble (4-bit) or byte (8-bit) plane, reordered so that one 64-byte vector holds
# 4 consecutive bytes of 16 rows: byte 4l + c of vector p of block kb of row block rb is byte 4p + c of
# block kb of row 16 rb + l (4-bit: low nibble weight 4p + c, high nibble weight 16 + 4p + c; 8-bit:
# weight 4p + c). An integer dot product lane (vpdpbusd: 4 bytes per 32-bit lane) then holds one row,
# so a block of 16 rows needs no horizontal sums. Scales are reordered alike: the 16 rows' fp16 scales
# of a group sit together. Arrays keep their [out, ...] shapes and sizes (rows 16 rb .. 16 rb + 15 hold
# row block rb), so the byte counts, extents and files of a container are those of the plane layout.

ROWS16_ROWS = 16
ROWS16_FLAG = 16  # or-ed into `bits` in a rows16 tensor's kernel descriptor: 4 | 16 or 8 | 16


def rows16_allowed(bits: int, asymmetric: bool, out: int) -> bool:
    """Whether a matrix can take the rows16 layout: 4- or 8-bit symmetric codes, whole blocks of 16 rows."""
    return bits in (4, 8) and not asymmetric and out % ROWS16_ROWS == 0


def to_rows16(a: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(plane a [out, bytes per row], scales [out, groups]) -> the same arrays in rows16 order (copies); the
    plane holds 16 (4-bit) or 32 (8-bit) bytes per 32-weight block."""
    out, width = a.shape
    nrb = out // ROWS16_ROWS
    a16 = np.asarray(a).reshape(nrb, ROWS16_ROWS, -1, 4).transpose(0, 2, 1, 3)              # rb, (kb, p), l, c
    s16 = np.asarray(scales).reshape(nrb, ROWS16_ROWS, -1).transpose(0, 2, 1)              # rb, g, l
    return np.ascontiguousarray(a16).reshape(out, width), np.ascontiguousarray(s16).reshape(scales.shape)


def from_rows16(a: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `to_rows16` (whole row blocks: out % 16 == 0)."""
    out, width = a.shape
    nrb = out // ROWS16_ROWS
    a_pl = np.asarray(a).reshape(nrb, -1, ROWS16_ROWS, 4).transpose(0, 2, 1, 3)            # rb, l, (kb, p), c
    s_pl = np.asarray(scales).reshape(nrb, -1, ROWS16_ROWS).transpose(0, 2, 1)             # rb, l, g
    return np.ascontiguousarray(a_pl).reshape(out, width), np.ascontiguousarray(s_pl).reshape(scales.shape)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 x [T, in] -> (q int8 [T, in], d float32 [T, in / 32], sums int32 [T, in / 32]) per 32-block:
    amax the largest magnitude, d = amax / 127, q = rint(x * (127 / amax)), sums = sum of q (numpy reference
    of the kernels' `quant_block`)."""
    x = np.asarray(x, np.float32)
    t, n_in = x.shape
    xb = x.reshape(t, n_in // BLOCK, BLOCK)
    amax = np.abs(xb).max(axis=2)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int8)
    return q.reshape(t, n_in), (amax / np.float32(127.0)).astype(np.float32), q.astype(np.int32).sum(axis=2, dtype=np.int32)


DESCRIPTOR_FIELDS = 13  # int64 fields of one matrix in a kernel table: see QuantizedTensor.descriptor


def check_activations(x: np.ndarray, n_in: int) -> np.ndarray:
    """x as a C-contiguous float32 [T, n_in] array, or a ValueError naming what is wrong."""
    if not isinstance(x, np.ndarray):
        raise ValueError(f"activations must be a numpy array, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise ValueError(f"activations must be float32, got {x.dtype}: convert with x.astype(np.float32)")
    if x.ndim != 2 or x.shape[1] != n_in:
        raise ValueError(f"activations have shape {list(x.shape)}, expected [T, {n_in}]")
    if not x.flags.writeable:  # a read-only array is another numba type: copying beats compiling the kernels twice
        return x.copy()
    return np.ascontiguousarray(x)
