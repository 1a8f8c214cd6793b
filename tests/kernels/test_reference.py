"""The plain numpy reference of the kernels' arithmetic (tests/support/kernels.py) checked on its own."""

from __future__ import annotations

import numpy as np

from support.kernels import LANES, fma32, hardware_fma, lane_dot, lane_sum  # noqa: F401


def test_fma_emulation_matches_hardware_on_random_values():
    rng = np.random.default_rng(0)
    n = 200_000
    a = rng.standard_normal(n).astype(np.float32)
    b = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    c = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    assert np.array_equal(fma32(a, b, c), hardware_fma(a, b, c))


def test_fma_emulation_breaks_double_rounding_ties():
    # a * b = 2**-24 - 2**-54 makes the float64 sum land exactly halfway between two float32:
    # rounding that to float32 again would give 1 + 2**-22; the true result rounds to 1 + 2**-23
    a = np.float32(1 + 2.0**-15)
    b = np.float32(2.0**-24 * (1 - 2.0**-15))
    c = np.float32(1 + 2.0**-23)
    naive = np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    assert naive == np.float32(1 + 2.0**-22)
    assert fma32(a, b, c) == np.float32(1 + 2.0**-23)
    assert hardware_fma(np.array([a]), np.array([b]), np.array([c]))[0] == np.float32(1 + 2.0**-23)
    # and the mirror case below zero, and an exact tie that stays a tie (ties to even)
    assert fma32(-a, b, -c) == np.float32(-(1 + 2.0**-23))
    assert fma32(np.float32(1), np.float32(2.0**-24), np.float32(1 + 2.0**-23)) == np.float32(1 + 2.0**-22)


def test_lane_dot_is_close_to_float64():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((7, 83)).astype(np.float32)
    x = rng.standard_normal((5, 83)).astype(np.float32)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = 83 * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64))
    assert (np.abs(lane_dot(w, x) - exact) <= bound).all()
