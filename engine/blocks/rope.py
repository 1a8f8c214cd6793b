"""Rotary position embeddings: cos/sin tables and their application to [T, H, D] tensors."""

from __future__ import annotations

import numpy as np

from engine.errors import GenerationError
from engine.kernels.rows import rope_rows
from engine.spec import RopeSpec


class Rotary:
    """Cos/sin tables for one RopeSpec, grown on demand as positions advance."""

    def __init__(self, spec: RopeSpec):
        self.spec = spec
        self.inv_freq = spec.inv_freq()             # [dim/2]
        self._scale = np.float32(spec.cos_sin_scale)
        self._cos = np.zeros((0, spec.dim // 2), np.float32)  # [P, dim/2]
        self._sin = np.zeros((0, spec.dim // 2), np.float32)

    def _ensure(self, n: int) -> None:
        if n <= self._cos.shape[0]:
            return
        size = max(n, 2 * self._cos.shape[0], 256)
        pos = np.arange(size, dtype=np.float32)
        angles = pos[:, None] * self.inv_freq[None, :]   # [P, dim/2], float32 like the reference
        self._cos = (np.cos(angles) * self._scale).astype(np.float32)
        self._sin = (np.sin(angles) * self._scale).astype(np.float32)

    def tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin for the given positions: [T, dim/2] each."""
        limit = self.spec.max_position
        if limit is not None and int(positions.max()) >= limit:
            raise GenerationError(
                f"position {int(positions.max())} is past this model's {limit}: its LongRoPE switches to other "
                f"factors for longer sequences, which Colibri does not implement; keep prompt and answer within "
                f"{limit} tokens (--ctx {limit})")
        self._ensure(int(positions.max()) + 1)
        return self._cos[positions], self._sin[positions]

    def apply(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Rotate the first `dim` features of x [T, H, D]; returns a new array.

        Interleaved pairs (x0, x1), (x2, x3) ... rotate together and come out de-interleaved (evens then
        odds) as the reference lays them out, consistently for q and k.
        """
        return rope_rows(x, cos, sin, self.spec.dim, self.spec.interleaved)
