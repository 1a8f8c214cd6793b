"""Weights kept in the float formats they are published in: `FP8Tensor` (block-scaled float8_e4m3fn) and
`MXFP4Tensor` (e2m1 codes with e8m0 scales per 32 weights).

Both hold their stored bytes as read-only views (a memory map of the safetensors file, never a float32
copy) and bring their own kernels (engine/kernels/fp8.py), like `QuantizedTensor`: `matmul`, `rows`,
`dequantize`. `dequantize` is plain numpy from the formats' definitions, the reference the kernels match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.kernels import fp8 as kernels
from engine.quant.kquant import KQUANT_META_KIND, KQuantTensor

FP8_META_KIND = "colibri.fp8"
MXFP4_META_KIND = "colibri.mxfp4"


def _readonly(a: np.ndarray, dtype, shape: tuple[int, ...], what: str) -> np.ndarray:
    """a as a read-only C-contiguous array of dtype and shape (reinterpreting raw bytes), never a copy."""
    a = np.asarray(a)
    if a.dtype != np.dtype(dtype):
        if a.dtype != np.uint8 or not a.flags.c_contiguous:
            raise ValueError(f"{what} has dtype {a.dtype}, expected {np.dtype(dtype)}")
        a = a.reshape(-1).view(dtype)
    if a.size != int(np.prod(shape)):
        raise ValueError(f"{what} holds {a.size} values, expected {list(shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    view = a.reshape(shape).view()
    view.flags.writeable = False
    return view


def _check_ids(ids, rows: int) -> np.ndarray:
    ids = np.asarray(ids, np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= rows):
        raise IndexError(f"row ids must lie in 0 .. {rows - 1}")
    return ids


@dataclass(frozen=True, eq=False)
class FP8Tensor:
    """A [out, in] matrix of float8_e4m3fn codes, each [bn, bk] block times its float32 scale."""

    codes: np.ndarray          # [out, in] uint8: float8_e4m3fn bits
    scales: np.ndarray         # [ceil(out / bn), ceil(in / bk)] float32: weight_scale_inv
    block: tuple[int, int]     # (bn, bk) rows and columns per scale

    def __post_init__(self) -> None:
        codes = np.asarray(self.codes)
        if codes.ndim != 2 or min(codes.shape) <= 0:
            raise ValueError(f"FP8 codes must be a non-empty [out, in] matrix, got shape {list(codes.shape)}")
        bn, bk = (int(b) for b in self.block)
        if bn <= 0 or bk <= 0:
            raise ValueError(f"FP8 block must be two positive sizes, got {list(self.block)}")
        out, n_in = codes.shape
        grid = (-(-out // bn), -(-n_in // bk))
        object.__setattr__(self, "block", (bn, bk))
        object.__setattr__(self, "codes", _readonly(codes.view(np.uint8), np.uint8, (out, n_in), "FP8 codes"))
        object.__setattr__(self, "scales", _readonly(self.scales, np.float32, grid,
                                                     f"FP8 scales of a {out} x {n_in} matrix in {bn} x {bk} blocks"))

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in]."""
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales."""
        return int(self.codes.nbytes + self.scales.nbytes)

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per weight, scales included."""
        return self.nbytes * 8 / (self.shape[0] * self.shape[1])

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x [T, in] float32 -> x @ W.T [T, out] float32 (bitwise independent of T and of threads)."""
        return kernels.fp8_matmul(self.codes, self.scales, self.block, x)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows ids [T] of the weights [T, in] float32, decoded by the kernels."""
        ids = _check_ids(ids, self.shape[0])
        out = np.empty((ids.size, self.shape[1]), np.float32)
        if ids.size:
            kernels.fp8_gather_flat(self.codes.reshape(-1), self.scales.reshape(-1), self.shape[1], self.block[0],
                                    self.block[1], kernels.E4M3, ids, out.reshape(-1))
        return out

    def dequantize(self) -> np.ndarray:
        """The weights [out, in] float32 in plain numpy (the reference the kernels must match)."""
        return self.dequantize_rows(0, self.shape[0])

    def dequantize_rows(self, r0: int, r1: int) -> np.ndarray:
        """Rows r0 .. r1 - 1 of the weights [r1 - r0, in] float32 (numpy; bounded memory for big tensors)."""
        bn, bk = self.block
        values = kernels.E4M3[self.codes[r0:r1]]                                          # [rows, in]
        scale = np.repeat(self.scales[np.arange(r0, r1) // bn], bk, axis=1)[:, :self.shape[1]]   # [rows, in]
        return values * scale

    def __reduce__(self):
        return (type(self), (self.codes, self.scales, self.block))

    def __repr__(self) -> str:
        return f"FP8Tensor(shape={list(self.shape)}, block={list(self.block)}, {self.bits_per_weight:.3f} bits/weight)"

    def to_buffers(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(JSON-able meta, named C-contiguous storage arrays) for a container writer."""
        # bits and group: what tools that list a container's widths read (8 bits, a block's columns a scale)
        meta = {"kind": FP8_META_KIND, "version": 1, "shape": list(self.shape), "block": list(self.block), "bits": 8,
                "group": self.block[1]}
        return meta, {"codes": self.codes, "scales": self.scales}

    @classmethod
    def from_buffers(cls, meta: dict, buffers: dict[str, np.ndarray]) -> "FP8Tensor":
        """The tensor over the given buffers (read-only memory-map views are fine; nothing is copied)."""
        out, n_in = (int(v) for v in meta["shape"])
        return cls(_readonly(buffers["codes"], np.uint8, (out, n_in), "FP8 codes"), buffers["scales"],
                   tuple(meta["block"]))


@dataclass(frozen=True, eq=False)
class MXFP4Tensor:
    """A [out, in] matrix of e2m1 codes, two per byte (the low nibble first), with an e8m0 scale per 32."""

    blocks: np.ndarray         # [out, in / 2] uint8
    scales: np.ndarray         # [out, in / 32] uint8: exponent e, scale 2**(e - 127)

    def __post_init__(self) -> None:
        scales = np.asarray(self.scales)
        if scales.ndim != 2 or min(scales.shape) <= 0:
            raise ValueError(f"MXFP4 scales must be a non-empty [out, in / 32] matrix, got {list(scales.shape)}")
        out, groups = scales.shape
        object.__setattr__(self, "scales", _readonly(scales, np.uint8, (out, groups), "MXFP4 scales"))
        object.__setattr__(self, "blocks", _readonly(self.blocks, np.uint8, (out, groups * 16),
                                                     f"MXFP4 blocks of {out} rows of {groups} groups"))

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in]."""
        return (self.scales.shape[0], self.scales.shape[1] * kernels.MX_GROUP)

    @property
    def nbytes(self) -> int:
        """Bytes of blocks and scales."""
        return int(self.blocks.nbytes + self.scales.nbytes)

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per weight, scales included (4.25)."""
        return self.nbytes * 8 / (self.shape[0] * self.shape[1])

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x [T, in] float32 -> x @ W.T [T, out] float32 (bitwise independent of T and of threads)."""
        return kernels.mxfp4_matmul(self.blocks, self.scales, x)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows ids [T] of the weights [T, in] float32, decoded by the kernels."""
        ids = _check_ids(ids, self.shape[0])
        out = np.empty((ids.size, self.shape[1]), np.float32)
        if ids.size:
            kernels.mxfp4_gather_flat(self.blocks.reshape(-1), self.scales.reshape(-1), self.shape[1], kernels.E2M1,
                                      kernels.E8M0, ids, out.reshape(-1))
        return out

    def dequantize(self) -> np.ndarray:
        """The weights [out, in] float32 in plain numpy (the reference the kernels must match)."""
        return self.dequantize_rows(0, self.shape[0])

    def dequantize_rows(self, r0: int, r1: int) -> np.ndarray:
        """Rows r0 .. r1 - 1 of the weights [r1 - r0, in] float32 (numpy)."""
        b = self.blocks[r0:r1]
        codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[0], -1)            # [rows, in]
        scale = np.repeat(kernels.E8M0[self.scales[r0:r1]], kernels.MX_GROUP, axis=1)     # [rows, in]
        return kernels.E2M1[codes] * scale

    def __reduce__(self):
        return (type(self), (self.blocks, self.scales))

    def __repr__(self) -> str:
        return f"MXFP4Tensor(shape={list(self.shape)}, {self.bits_per_weight:.3f} bits/weight)"

    def to_buffers(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(JSON-able meta, named C-contiguous storage arrays) for a container writer."""
        return {"kind": MXFP4_META_KIND, "version": 1, "shape": list(self.shape), "bits": 4,
                "group": kernels.MX_GROUP}, \
            {"blocks": self.blocks, "scales": self.scales}

    @classmethod
    def from_buffers(cls, meta: dict, buffers: dict[str, np.ndarray]) -> "MXFP4Tensor":
        """The tensor over the given buffers (read-only memory-map views are fine; nothing is copied)."""
        out, n_in = (int(v) for v in meta["shape"])
        return cls(_readonly(buffers["blocks"], np.uint8, (out, n_in // 2), "MXFP4 blocks"),
                   _readonly(buffers["scales"], np.uint8, (out, n_in // kernels.MX_GROUP), "MXFP4 scales"))


# container meta kind -> type (GGUF K-quant and IQ4 blocks too: engine/quant/kquant.py)
PUBLISHED_KINDS: dict[str, Any] = {FP8_META_KIND: FP8Tensor, MXFP4_META_KIND: MXFP4Tensor,
                                   KQUANT_META_KIND: KQuantTensor}
PUBLISHED_BITS = {FP8Tensor: 8, MXFP4Tensor: 4}                                # the width each stands for
