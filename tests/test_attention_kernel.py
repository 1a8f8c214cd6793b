"""The numba attention kernel against plain numpy, and its batch invariance."""

from __future__ import annotations

import numpy as np
import pytest

from engine.blocks.attention import attend, causal_mask
from engine.blocks.attention_kernel import attend_causal


@pytest.mark.parametrize("heads, kv_heads, window", [(8, 8, None), (8, 2, None), (6, 1, 5), (4, 2, 1)])
def test_kernel_matches_numpy(heads, kv_heads, window):
    rng = np.random.default_rng(heads * 10 + kv_heads)
    t, start, d = 9, 7, 16
    q = rng.standard_normal((t, heads, d)).astype(np.float32)
    k = rng.standard_normal((kv_heads, 40, d)).astype(np.float32)   # capacity beyond the positions used
    v = rng.standard_normal((kv_heads, 40, d)).astype(np.float32)
    positions = np.arange(start, start + t)
    end = start + t
    expected = attend(q, k[:, :end], v[:, :end], causal_mask(positions, end, window), 0.25)
    got = attend_causal(q, k, v, positions, 0.25, window)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_each_row_is_the_same_alone_or_in_a_batch():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((33, 8, 64)).astype(np.float32)
    k = rng.standard_normal((2, 64, 64)).astype(np.float32)
    v = rng.standard_normal((2, 64, 64)).astype(np.float32)
    positions = np.arange(10, 43)
    batch = attend_causal(q, k, v, positions, 0.125)
    for t in (0, 5, 32):
        alone = attend_causal(q[t : t + 1], k, v, positions[t : t + 1], 0.125)
        assert np.array_equal(alone[0], batch[t])  # bitwise
