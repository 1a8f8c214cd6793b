"""The one place a block multiplies by a weight matrix, whatever the matrix is stored as.

A weight is a float32 [out, in] array (BLAS) or a quantized tensor that brings its own kernel
(`w.matmul(x)`): Colibri's group-wise `QuantizedTensor`, or a format kept as published (FP8, MXFP4).
A `Probe`, when given, sees the input of every matrix by its tensor name: the planner measures
activation energy with it, moefy clusters feed-forward inputs with it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

Probe = Callable[[str, np.ndarray], None]  # (weight tensor name, its input [n, in])


def linear(x: np.ndarray, w) -> np.ndarray:
    """x [T, in] times the [out, in] weight, transposed -> [T, out]."""
    if isinstance(w, np.ndarray):
        return x @ w.T
    return w.matmul(x)


def linear_many(x: np.ndarray, ws: Sequence) -> list[np.ndarray]:
    """x [T, in] times several weights sharing that input (q, k, v; gate, up): one parallel call
    when all are Colibri QuantizedTensors or all GGUF KQuantTensors, else one product each."""
    if all(is_block_quantized(w) for w in ws):
        from engine.quant import matmul_many

        return matmul_many(x, ws)
    return [linear(x, w) for w in ws]


def is_block_quantized(w) -> bool:
    """Whether a weight is a Colibri QuantizedTensor or a GGUF KQuantTensor (K-quant, IQ4), the kinds the batched
    and fused expert kernels take (an FP8 or MXFP4 weight brings only its own matmul)."""
    from engine.quant.kquant import KQuantTensor
    from engine.quant.tensor import QuantizedTensor

    return isinstance(w, (QuantizedTensor, KQuantTensor))
