"""The one place a block multiplies by a weight matrix, whatever the matrix is stored as.

A weight is a float32 [out, in] array (BLAS) or a quantized tensor that brings its own kernel
(`w.matmul(x)`). A `Probe`, when given, sees the input of every matrix by its tensor name: the
planner measures activation energy with it, moefy clusters feed-forward inputs with it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

Probe = Callable[[str, np.ndarray], None]  # (weight tensor name, its input [n, in])


def linear(x: np.ndarray, w) -> np.ndarray:
    """x [T, in] times the [out, in] weight, transposed -> [T, out]."""
    if isinstance(w, np.ndarray):
        return x @ w.T
    return w.matmul(x)
