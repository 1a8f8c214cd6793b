"""The KV cache of one sequence: per-layer key/value (or latent) arrays written at its positions.

Contiguous and grown by doubling; the paged cache with prefix reuse comes later and will keep
this interface: `positions(T)`, per-layer `write` + `view`, `commit(T)`, `truncate(n)`.
"""

from __future__ import annotations

import numpy as np

from engine.errors import GenerationError
from engine.spec import AttentionSpec, MLASpec, ModelSpec


class _Grown:
    """A [cap, ...] float32 array along axis `axis` that doubles when full."""

    def __init__(self, shape: tuple[int, ...], axis: int):
        self.axis = axis
        self.data = np.zeros(shape, np.float32)

    def ensure(self, n: int, limit: int) -> None:
        cap = self.data.shape[self.axis]
        if n <= cap:
            return
        new_cap = min(max(n, 2 * cap, 64), max(limit, n))
        shape = list(self.data.shape)
        shape[self.axis] = new_cap
        grown = np.zeros(shape, np.float32)
        idx = [slice(None)] * self.data.ndim
        idx[self.axis] = slice(0, cap)
        grown[tuple(idx)] = self.data
        self.data = grown


class HeadsKV:
    """Keys [Hkv, S, D] and values [Hkv, S, Dv] of one GQA layer."""

    def __init__(self, spec: AttentionSpec, limit: int):
        self.limit = limit
        self._k = _Grown((spec.n_kv_heads, 0, spec.head_dim), axis=1)
        self._v = _Grown((spec.n_kv_heads, 0, spec.head_dim), axis=1)

    def write(self, start: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k, v [T, Hkv, D] at positions start.. and return the whole buffers [Hkv, capacity, D]
        (positions past start + T hold nothing meaningful: readers stop at their query's position)."""
        end = start + k.shape[0]
        self._k.ensure(end, self.limit)
        self._v.ensure(end, self.limit)
        self._k.data[:, start:end] = k.transpose(1, 0, 2)
        self._v.data[:, start:end] = v.transpose(1, 0, 2)
        return self._k.data, self._v.data

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self._k.data.nbytes + self._v.data.nbytes


class LatentKV:
    """The compressed latent [S, R] and shared rotary key [S, dr] of one MLA layer."""

    def __init__(self, spec: MLASpec, limit: int):
        self.limit = limit
        self._c = _Grown((0, spec.kv_lora_rank), axis=0)
        self._r = _Grown((0, spec.qk_rope_dim), axis=0)

    def write(self, start: int, latent: np.ndarray, k_rot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store latent [T, R] and k_rot [T, dr] at positions start.. and return all so far."""
        end = start + latent.shape[0]
        self._c.ensure(end, self.limit)
        self._r.ensure(end, self.limit)
        self._c.data[start:end] = latent
        self._r.data[start:end] = k_rot
        return self._c.data[:end], self._r.data[:end]

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self._c.data.nbytes + self._r.data.nbytes


class KVCache:
    """The cache of one sequence across all layers, with the number of positions filled."""

    def __init__(self, spec: ModelSpec, max_len: int | None = None):
        self.max_len = int(max_len or spec.max_position)
        self.layers = [
            LatentKV(layer.attn, self.max_len) if isinstance(layer.attn, MLASpec) else HeadsKV(layer.attn, self.max_len)
            for layer in spec.layers
        ]
        self.length = 0

    def positions(self, n: int) -> np.ndarray:
        """Positions of the next n tokens; refuses to pass the context length."""
        if self.length + n > self.max_len:
            raise GenerationError(
                f"the sequence would reach {self.length + n} tokens but the context holds {self.max_len}; "
                "use a shorter prompt, fewer --max-tokens or a larger --ctx"
            )
        return np.arange(self.length, self.length + n, dtype=np.int64)

    def commit(self, n: int) -> None:
        """Mark n more positions as filled (after every layer wrote them)."""
        self.length += n

    def truncate(self, n: int) -> None:
        """Forget every position from n on (the data stays allocated and is overwritten)."""
        self.length = min(self.length, n)

    @property
    def nbytes(self) -> int:
        """Bytes held by all layers."""
        return sum(layer.nbytes for layer in self.layers)
