"""`matmul_f32`: float32 weights times activations with the quantized kernels' batch invariance.

For matrices kept in float32 (routers now, any fp32 matrix later): x @ w.T through BLAS changes
its summation order with the batch size; this kernel computes every output element by the same
16-lane FMA sequence as the quantized kernels (engine/kernels/matmul.py), whatever T or threads.
"""

from __future__ import annotations

import numba
import numpy as np

from engine.kernels.layout import check_activations
from engine.kernels.matmul import f32_matmul


def matmul_f32(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, in] float32 @ w [out, in] float32 .T -> [T, out], bitwise independent of T and of threads."""
    if not isinstance(w, np.ndarray) or w.dtype != np.float32 or w.ndim != 2:
        raise ValueError(f"weights must be a float32 [out, in] array, got {getattr(w, 'dtype', type(w).__name__)} "
                         f"{list(getattr(w, 'shape', []))}")
    x = check_activations(x, w.shape[1])
    w = np.ascontiguousarray(w)  # a no-op for memory-mapped and freshly loaded weights
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    if x.shape[0] and w.shape[0]:
        f32_matmul(w.reshape(-1), w.shape[0], w.shape[1], x.reshape(-1), x.shape[0], out.reshape(-1),
                   numba.get_num_threads())
    elif x.shape[0]:
        out[:] = 0.0
    return out
