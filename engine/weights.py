"""Read-only weights, looked up by Hugging Face tensor name, checked against the spec's shapes.

A `TensorSource` is what a format reader offers (safetensors folder, GGUF file, later the Colibri
container); `Weights` checks every tensor a model needs before anything runs, so that a wrong
checkpoint fails at load with the tensor's name and file, not deep inside a matmul.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Protocol

import numpy as np

from engine.errors import ModelFormatError


class TensorSource(Protocol):
    """Tensors of one checkpoint by Hugging Face name."""

    path: str

    def names(self) -> Iterable[str]:
        """Every tensor name the checkpoint holds."""

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, without reading it."""

    def load(self, name: str):
        """The tensor as float32 (a read-only memory map where the stored dtype allows), or a
        quantized tensor (an object with `shape`, `matmul(x)` and `dequantize()`)."""

    def location(self, name: str) -> str:
        """The file that holds the tensor, for error messages."""


class Weights:
    """The tensors a model uses, validated once against the shapes its spec implies."""

    def __init__(self, source: TensorSource, expected: Mapping[str, tuple[int, ...]]):
        self.source = source
        available = set(source.names())
        missing = [n for n in expected if n not in available]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelFormatError(
                f"{source.path}: {len(missing)} tensor(s) the config implies are missing: {shown}; "
                "the weights do not match config.json (or the download is incomplete): fetch the model again"
            )
        for name, shape in expected.items():
            have = tuple(source.shape(name))
            if have != tuple(shape):
                raise ModelFormatError(
                    f"{source.location(name)}: tensor {name} has shape {list(have)} but config.json implies "
                    f"{list(shape)}; the weights and config.json disagree: use the config.json that came with them"
                )
        self.expected = dict(expected)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.expected:
            raise KeyError(name)
        arr = self.source.load(name)
        if isinstance(arr, np.ndarray):
            if arr.dtype != np.float32:
                raise ModelFormatError(f"{self.source.location(name)}: tensor {name} loaded as {arr.dtype}, expected float32")
        elif not hasattr(arr, "matmul"):  # a quantized tensor brings its own kernel
            raise ModelFormatError(f"{self.source.location(name)}: tensor {name} loaded as {type(arr).__name__}")
        return arr

    def dense(self, name: str) -> np.ndarray:
        """The tensor as a float32 array, dequantized if stored quantized (for small tensors used whole)."""
        arr = self[name]
        return arr if isinstance(arr, np.ndarray) else arr.dequantize()

    def get(self, name: str) -> np.ndarray | None:
        """The tensor, or None when the model does not use it."""
        return self[name] if name in self.expected else None
