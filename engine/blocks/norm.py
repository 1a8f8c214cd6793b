"""RMSNorm (and LayerNorm, for the families that use it) and activations, in float32."""

from __future__ import annotations

import numpy as np

from engine.errors import ModelFormatError
from engine.kernels.rows import gelu_erf_rows, layer_norm_rows, rms_norm_rows


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x * rsqrt(mean(x^2) + eps) * weight over the last axis, in float32 (row by row, the same bits in any batch)."""
    return rms_norm_rows(x, weight, eps)


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis, in float32 (row by row)."""
    return layer_norm_rows(x, weight, bias, eps)


def normalize(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, eps: float, kind: str = "rms") -> np.ndarray:
    """A model's norm of kind `kind` (ModelSpec.norm): RMSNorm, or LayerNorm with its bias."""
    return layer_norm(x, weight, bias, eps) if kind == "layer" else rms_norm(x, weight, eps)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), without overflow warnings for large negative x."""
    with np.errstate(over="ignore"):
        return x / (np.float32(1.0) + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """The tanh approximation of GELU (gelu_pytorch_tanh, gelu_new)."""
    c = np.float32(np.sqrt(2.0 / np.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU with the exact error function (transformers' "gelu"), in float32."""
    return gelu_erf_rows(x)


ACTIVATIONS = {"silu": silu, "swish": silu, "gelu_pytorch_tanh": gelu_tanh, "gelu_new": gelu_tanh, "gelu": gelu}


def activation(name: str):
    """The activation function called `name` in a config.json."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ModelFormatError(
            f"activation {name!r} is not supported (supported: {', '.join(sorted(ACTIVATIONS))})"
        ) from None
