"""fp16 to float32 in the kernels (engine/kernels/simd.py): every one of the 65,536 bit patterns gives numpy's float32,
bit for bit, through the scalar and the vector conversions; subnormal halves included, which GGUF's Q6_K scales
often are."""

from __future__ import annotations

import numpy as np
from numba import njit

from engine.kernels.simd import f16_to_f32, tof32, vhalves, vstore

HALVES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


@njit
def _scalar(h, out, other):
    for i in range(h.size):
        out[i] = f16_to_f32(h[i])
        other[i] = tof32(h[i])


@njit
def _vector(h, out):
    for i in range(0, h.size, 16):
        vstore(out, i, vhalves(h, i, 16))


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    nan = np.isnan(want)
    return bool(np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32)) and np.isnan(got[nan]).all())


def test_every_half_converts_to_numpys_float32():
    want = HALVES.view(np.float16).astype(np.float32)
    assert ((HALVES & 0x7C00) == 0).sum() == 2048                   # the zeros and subnormals are in there
    scalar, other, vector = (np.full(HALVES.size, 7.0, np.float32) for _ in range(3))
    _scalar(HALVES, scalar, other)
    _vector(HALVES, vector)
    assert _same(scalar, want) and _same(other, want) and _same(vector, want)
    assert scalar[0x8000].view(np.uint32) == 0x80000000 and scalar[0x0001] == np.float32(2.0 ** -24)
