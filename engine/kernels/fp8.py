"""Kernels for weights as published in 8-bit and 4-bit float formats: block-scaled FP8 and MXFP4.

- FP8 (DeepSeek-V3, Kimi K2, GLM-4.5-FP8, Qwen3-FP8, MiniMax-M2): one `float8_e4m3fn` byte per weight and
  one float32 `weight_scale_inv` per [bn, bk] block (128 x 128 as published; blocks at the edges may be
  partial). A weight is E4M3[byte] * scale, one float32 rounding.
- MXFP4 (gpt-oss): two `e2m1` codes per byte (the low nibble first) and one `e8m0` exponent byte per 32
  weights of a row. A weight is E2M1[code] * 2**(e - 127), exact in float32.

Neither format's values are evenly spaced, so neither maps onto Colibri's integer-code layouts without
loss: the bytes stay as published and a tile of 4 rows is decoded through a lookup table into float32
scratch, then multiplied by the same 16-lane FMA tile as float32 matrices (`matmul.tile_rows`). Every
output is thus computed in a fixed order: bitwise independent of the batch size and of the threads.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from engine.kernels.layout import check_activations
from engine.kernels.matmul import TILE, chunking, tile_rows
from engine.kernels.simd import U64

MX_GROUP = 32   # MXFP4 weights per e8m0 scale


def e4m3_table() -> np.ndarray:
    """The 256 values of float8_e4m3fn (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinities,
    0x7f and 0xff are NaN) as float32, computed from the definition."""
    code = np.arange(256)
    sign = np.where(code & 0x80, -1.0, 1.0)
    exp, man = (code >> 3) & 0xF, code & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    out = (sign * mag).astype(np.float32)
    out[(code & 0x7F) == 0x7F] = np.nan
    return out


def e2m1_table() -> np.ndarray:
    """The 16 values of e2m1 (1 sign, 2 exponent bits biased by 1, 1 mantissa bit) as float32."""
    code = np.arange(16)
    exp, man = (code >> 1) & 0x3, code & 0x1
    mag = np.where(exp == 0, man * 0.5, (1.0 + man / 2.0) * 2.0 ** (exp - 1.0))
    return (np.where(code & 0x8, -1.0, 1.0) * mag).astype(np.float32)


def e8m0_table() -> np.ndarray:
    """The 256 values of an e8m0 scale byte, 2**(e - 127), as float32 (255 is NaN; 2**-127 is subnormal)."""
    out = np.full(256, np.nan, np.float32)
    out[:255] = np.ldexp(np.float32(1.0), np.arange(255) - 127)
    return out


E4M3 = e4m3_table()
E2M1 = e2m1_table()
E8M0 = e8m0_table()


# -- decoding a tile of rows into float32 scratch ------------------------------------------

@njit(boundscheck=False)
def fp8_decode_rows(codes, scales, K, bn, bk, lut, r0, nr, dst):
    """Rows r0 .. r0 + nr - 1 of an FP8 matrix (codes flat [R, K], scales flat [ceil(R/bn), ceil(K/bk)])
    -> dst flat [nr, K] float32: lut[code] * the block's scale."""
    nkb = (K + bk - 1) // bk
    for j in range(nr):
        r = r0 + j
        src = U64(r) * U64(K)
        out = U64(j) * U64(K)
        srow = U64(r // bn) * U64(nkb)
        for kb in range(nkb):
            s = scales[srow + U64(kb)]
            k1 = min(K, (kb + 1) * bk)
            for k in range(kb * bk, k1):
                dst[out + U64(k)] = lut[codes[src + U64(k)]] * s


@njit(boundscheck=False)
def mxfp4_decode_rows(blocks, scales, K, lut, exps, r0, nr, dst):
    """Rows r0 .. r0 + nr - 1 of an MXFP4 matrix (blocks flat [R, K / 2], scales flat [R, K / 32])
    -> dst flat [nr, K] float32: lut[nibble] * 2**(e - 127), the low nibble first."""
    half = K // 2
    groups = K // 32
    for j in range(nr):
        r = r0 + j
        src = U64(r) * U64(half)
        out = U64(j) * U64(K)
        for g in range(groups):
            s = exps[scales[U64(r) * U64(groups) + U64(g)]]
            for i in range(16):
                b = blocks[src + U64(g * 16 + i)]
                k = out + U64(g * 32 + 2 * i)
                dst[k] = lut[b & 15] * s
                dst[k + U64(1)] = lut[b >> 4] * s


# -- matmuls --------------------------------------------------------------------------------

@njit(parallel=True, cache=True, boundscheck=False)
def fp8_matmul_flat(codes, scales, R, K, bn, bk, lut, x, T, out, threads):
    """FP8 w [R, K] times x (flat [T, K]) -> out (flat [T, R]), a 4-row tile decoded at a time."""
    tokens = np.arange(T)
    chunks, per = chunking(R, threads)
    for c in prange(chunks):
        scratch = np.empty(TILE * K, np.float32)
        r0 = c * per * TILE
        r1 = min(R, r0 + per * TILE)
        r = r0
        while r < r1:
            nr = min(TILE, r1 - r)
            fp8_decode_rows(codes, scales, K, bn, bk, lut, r, nr, scratch)
            tile_rows(scratch, U64(0), K, nr, x, tokens, tokens, 0, T, out, R, r)
            r += TILE


@njit(parallel=True, cache=True, boundscheck=False)
def mxfp4_matmul_flat(blocks, scales, R, K, lut, exps, x, T, out, threads):
    """MXFP4 w [R, K] times x (flat [T, K]) -> out (flat [T, R]), a 4-row tile decoded at a time."""
    tokens = np.arange(T)
    chunks, per = chunking(R, threads)
    for c in prange(chunks):
        scratch = np.empty(TILE * K, np.float32)
        r0 = c * per * TILE
        r1 = min(R, r0 + per * TILE)
        r = r0
        while r < r1:
            nr = min(TILE, r1 - r)
            mxfp4_decode_rows(blocks, scales, K, lut, exps, r, nr, scratch)
            tile_rows(scratch, U64(0), K, nr, x, tokens, tokens, 0, T, out, R, r)
            r += TILE


@njit(parallel=True, cache=True, boundscheck=False)
def fp8_gather_flat(codes, scales, K, bn, bk, lut, ids, dst):
    """Rows ids [N] of an FP8 matrix -> dst flat [N, K] float32."""
    for i in prange(ids.size):
        fp8_decode_rows(codes, scales, K, bn, bk, lut, ids[i], 1, dst[i * K:(i + 1) * K])


@njit(parallel=True, cache=True, boundscheck=False)
def mxfp4_gather_flat(blocks, scales, K, lut, exps, ids, dst):
    """Rows ids [N] of an MXFP4 matrix -> dst flat [N, K] float32."""
    for i in prange(ids.size):
        mxfp4_decode_rows(blocks, scales, K, lut, exps, ids[i], 1, dst[i * K:(i + 1) * K])


def fp8_matmul(codes: np.ndarray, scales: np.ndarray, block: tuple[int, int], x: np.ndarray) -> np.ndarray:
    """x [T, K] float32 @ FP8 w.T -> [T, R] (codes uint8 [R, K], scales float32 [ceil(R/bn), ceil(K/bk)])."""
    rows, k = codes.shape
    x = check_activations(x, k)
    out = np.empty((x.shape[0], rows), np.float32)
    if x.shape[0]:
        fp8_matmul_flat(codes.reshape(-1), scales.reshape(-1), rows, k, block[0], block[1], E4M3, x.reshape(-1),
                        x.shape[0], out.reshape(-1), numba.get_num_threads())
    return out


def mxfp4_matmul(blocks: np.ndarray, scales: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x [T, K] float32 @ MXFP4 w.T -> [T, R] (blocks uint8 [R, K / 2], scales uint8 [R, K / 32])."""
    rows, k = blocks.shape[0], scales.shape[1] * MX_GROUP
    x = check_activations(x, k)
    out = np.empty((x.shape[0], rows), np.float32)
    if x.shape[0]:
        mxfp4_matmul_flat(blocks.reshape(-1), scales.reshape(-1), rows, k, E2M1, E8M0, x.reshape(-1), x.shape[0],
                          out.reshape(-1), numba.get_num_threads())
    return out
