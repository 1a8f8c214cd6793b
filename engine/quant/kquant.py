"""`KQuantTensor`: a weight matrix in a GGUF K-quant type (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) or a non-linear 4-bit one
(IQ4_NL, IQ4_XS), held in the file's bytes.

The rows are the file's own blocks (layouts in engine/kernels/kquant.py and iquant.py), as a read-only view
of the memory map: nothing is copied or widened, so a K-quant model takes the file's size in
memory. The kernels dequantize exactly as `gguf.quants.dequantize` does (bitwise), and the tensor
offers what the blocks call on a weight: `matmul` (decode and prefill), `rows` (embeddings).
Q4_K, Q5_K, Q6_K and IQ4_XS matrices of whole 16-row blocks can instead hold the same bytes in the "rows16"
layout (engine/kernels/krows16.py): a copy in another order, run by integer kernels with 8-bit activations.
A container keeps the same blocks in the same layout (`to_buffers` / `from_buffers`), read back into the same kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import gguf
import numba
import numpy as np

from engine.kernels import kquant, krows16, matmul
from engine.kernels.layout import DESCRIPTOR_FIELDS, check_activations

_Q = gguf.GGMLQuantizationType
KINDS = {_Q.Q2_K: kquant.Q2_K, _Q.Q3_K: kquant.Q3_K, _Q.Q4_K: kquant.Q4_K, _Q.Q5_K: kquant.Q5_K,   # types the kernels run
         _Q.Q6_K: kquant.Q6_K, _Q.IQ4_NL: kquant.IQ4_NL, _Q.IQ4_XS: kquant.IQ4_XS}
_NAMES = {kind: qtype.name for qtype, kind in KINDS.items()}
_BY_NAME = {qtype.name: qtype for qtype in KINDS}
# the width each type stands for (what tools that list a container's widths read; the scales come on top)
NOMINAL_BITS = {_Q.Q2_K: 2, _Q.Q3_K: 3, _Q.Q4_K: 4, _Q.Q5_K: 5, _Q.Q6_K: 6, _Q.IQ4_NL: 4, _Q.IQ4_XS: 4}
KQUANT_META_KIND = "colibri.kquant"     # a container's quant meta kind: blocks kept as the GGUF file holds them
LAYOUTS = ("blocks", "rows16")           # the file's order, or 16 rows interleaved (engine/kernels/krows16.py)


@dataclass(frozen=True, eq=False)
class KQuantTensor:
    """A [out, in] weight matrix in a K-quant or IQ4 type: `raw` [out, in / block weights * block bytes] uint8, the
    file's blocks."""

    shape: tuple[int, int]        # [out, in]; in % 256 == 0 (IQ4_NL: in % 32 == 0)
    qtype: gguf.GGMLQuantizationType
    raw: np.ndarray               # [out, in / BLOCK_WEIGHTS * BLOCK_BYTES] uint8
    layout: str = "blocks"        # "blocks" (the file's order) or "rows16" (the same bytes, 16 rows interleaved)
    _table: np.ndarray = field(init=False, repr=False)   # [1, DESC_FIELDS]: kind, rows, cols, address, bytes
    _descriptor: np.ndarray = field(init=False, repr=False)   # [13]: see `descriptor`
    _rows: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.qtype not in KINDS:
            raise ValueError(f"{getattr(self.qtype, 'name', self.qtype)} is not a K-quant type Colibri runs natively (nor an IQ4): "
                             f"one of {', '.join(_NAMES.values())}")
        out, n_in = (int(s) for s in self.shape)
        kind = KINDS[self.qtype]
        block = kquant.BLOCK_WEIGHTS[kind]
        if out <= 0 or n_in <= 0 or n_in % block:
            raise ValueError(f"a {self.qtype.name} matrix needs [out, in] with in a multiple of {block}, "
                             f"got {[out, n_in]}")
        want = (out, n_in // block * kquant.BLOCK_BYTES[kind])
        raw = self.raw
        if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or not raw.flags.c_contiguous or raw.size != want[0] * want[1]:
            raise ValueError(f"{self.qtype.name} {[out, n_in]} needs {want[0] * want[1]} C-contiguous uint8 bytes, "
                             f"got {getattr(raw, 'size', '?')} of {getattr(raw, 'dtype', type(raw).__name__)}: "
                             "the tensor's data does not match its shape and type")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown K-quant layout {self.layout!r}: one of {', '.join(LAYOUTS)}")
        if self.layout == "rows16":
            if not krows16.allowed(kind, out):
                raise ValueError(f"the rows16 layout holds Q4_K, Q5_K, Q6_K and IQ4_XS matrices of whole 16-row "
                                 f"blocks, not {self.qtype.name} {[out, n_in]}")
            kind |= krows16.KROWS16
        raw = raw.reshape(want).view()
        raw.flags.writeable = False
        set_ = object.__setattr__
        set_(self, "shape", (out, n_in))
        set_(self, "raw", raw)
        set_(self, "_table", np.array([[kind, out, n_in, raw.ctypes.data, raw.size]], np.int64))
        set_(self, "_rows", np.array([out], np.int64))
        desc = np.zeros(DESCRIPTOR_FIELDS, np.int64)
        desc[:7] = (kquant.KQUANT_FLAG, kind, block, out, n_in, raw.ctypes.data, raw.size)
        set_(self, "_descriptor", desc)

    @property
    def blocks(self) -> np.ndarray:
        """The blocks [out, bytes per row] in the file's order (the array itself, or a copy back from rows16)."""
        return self.raw if self.layout == "blocks" else krows16.from_krows16(KINDS[self.qtype], self.raw)

    def with_layout(self, layout: str) -> "KQuantTensor":
        """The same matrix in `layout` (this tensor if it is already; otherwise a reordered copy)."""
        if layout == self.layout:
            return self
        kind = KINDS[self.qtype]
        raw = krows16.to_krows16(kind, self.raw) if layout == "rows16" else self.blocks
        return KQuantTensor(self.shape, self.qtype, raw, layout)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x [T, in] float32 -> x @ W.T [T, out] float32 (bitwise independent of T and of threads; the rows16 layout
        rounds x to 8 bits per 32-block, as engine/kernels/krows16.py says)."""
        x = check_activations(x, self.shape[1])
        out = np.empty((x.shape[0], self.shape[0]), np.float32)
        if x.shape[0]:
            items, pieces, tokens = matmul.matmul_items(self._rows, x.shape[0], numba.get_num_threads())
            kquant.kq_run_items(self._table, items, pieces, x.reshape(-1), tokens, tokens, out.reshape(-1))
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows ids [T] of the weights [T, in] float32, dequantized by the kernels."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise IndexError(f"row ids must lie in 0 .. {self.shape[0] - 1}")
        out = np.empty((ids.size, self.shape[1]), np.float32)
        if not ids.size:
            return out
        if self.layout == "rows16":       # each asked row's whole 16-row block, back in the file's order
            first = ids // krows16.ROWS * krows16.ROWS
            blocks = np.unique(first)
            raw = krows16.from_krows16(KINDS[self.qtype], self.raw[(blocks[:, None] + np.arange(krows16.ROWS)).ravel()])
            plain = KQuantTensor((raw.shape[0], self.shape[1]), self.qtype, raw)
            return plain.rows(np.searchsorted(blocks, first) * krows16.ROWS + ids - first)
        kquant.kq_gather_rows(self._table[0], ids, out.reshape(-1))
        return out

    def dequantize(self) -> np.ndarray:
        """The weights [out, in] float32 by gguf's numpy dequantization (the reference the kernels match)."""
        return np.asarray(gguf.quants.dequantize(self.blocks, self.qtype), np.float32).reshape(self.shape)

    def take_rows(self, rows) -> "KQuantTensor":
        """Some rows (a slice gives a view of the same bytes, an index array a copy). A rows16 matrix keeps its layout
        when a slice cuts it along whole 16-row blocks (an expert of a stack), else the rows come in the file's order."""
        if self.layout == "rows16":
            start, stop, step = rows.indices(self.shape[0]) if isinstance(rows, slice) else (1, 0, 1)
            if step == 1 and start % krows16.ROWS == 0 and stop % krows16.ROWS == 0:
                return KQuantTensor((stop - start, self.shape[1]), self.qtype, self.raw[start:stop], "rows16")
            return KQuantTensor(self.shape, self.qtype, self.blocks).take_rows(rows)
        raw = self.raw[rows]
        return KQuantTensor((raw.shape[0], self.shape[1]), self.qtype, np.ascontiguousarray(raw))

    def __reduce__(self):
        # rebuild through __init__: the table's address belongs to this process's array
        return (type(self), (self.shape, self.qtype, self.raw, self.layout))

    def to_buffers(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(JSON-able meta, named C-contiguous storage arrays) for a container writer: the file's blocks, in this
        tensor's layout (named in the meta when it is rows16)."""
        meta = {"kind": KQUANT_META_KIND, "version": 1, "type": self.qtype.name, "shape": list(self.shape),
                "bits": NOMINAL_BITS[self.qtype], "group": kquant.BLOCK_WEIGHTS[KINDS[self.qtype]]}
        if self.layout == "rows16":
            meta["layout"] = "rows16-v1"
        return meta, {"blocks": self.raw}

    @classmethod
    def from_buffers(cls, meta: dict, buffers: dict[str, np.ndarray]) -> "KQuantTensor":
        """The tensor over the given buffers (read-only memory-map views are fine; nothing is copied)."""
        qtype = _BY_NAME.get(meta["type"])
        if qtype is None:
            raise ValueError(f"type {meta['type']!r} is not one of {', '.join(_BY_NAME)}")
        out, n_in = (int(v) for v in meta["shape"])
        layout = meta.get("layout", "blocks")
        if layout not in ("blocks", "rows16-v1"):
            raise ValueError(f"K-quant layout {layout!r} is not one this version reads (blocks, rows16-v1): "
                             "upgrade Colibri, or convert the model again")
        return cls((out, n_in), qtype, buffers["blocks"], "rows16" if layout == "rows16-v1" else "blocks")

    def __repr__(self) -> str:
        rows16 = ", rows16" if self.layout == "rows16" else ""
        return f"KQuantTensor(shape={list(self.shape)}, {self.qtype.name}{rows16}, {self.bits_per_weight:.3f} bits/weight)"

    @property
    def descriptor(self) -> tuple[int, ...]:
        """13 ints in the shape of QuantizedTensor.descriptor, for a fused step's table: KQUANT_FLAG, the kernels'
        kind, weights per block, out, in, the bytes' address and length, then zeros.

        Kernels that run only Colibri's formats must refuse it (field 0 is KQUANT_FLAG). The address is valid
        while this tensor lives: whoever passes it on keeps the tensor referenced.
        """
        return tuple(int(v) for v in self._descriptor)

    @property
    def descriptor_row(self) -> np.ndarray:
        """`descriptor` as an int64 array [13] (read-only use: copy it into a kernel's table)."""
        return self._descriptor

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks (codes and scales)."""
        return int(self.raw.nbytes)

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per weight, scales included."""
        return self.nbytes * 8 / (self.shape[0] * self.shape[1])


def kquant_matmul_many(x: np.ndarray, tensors: Sequence[KQuantTensor]) -> list[np.ndarray]:
    """x [T, in] times several K-quant [out_i, in] matrices sharing that input, in one parallel call -> [T, out_i]
    each, bitwise equal to each tensor's own matmul."""
    n_in = tensors[0].shape[1]
    if any(t.shape[1] != n_in for t in tensors):
        raise ValueError(f"matmul_many: the matrices do not share an input width: {[list(t.shape) for t in tensors]}")
    x = check_activations(x, n_in)
    rows = np.array([t.shape[0] for t in tensors], np.int64)
    t_count = x.shape[0]
    flat = np.empty(t_count * int(rows.sum()), np.float32)
    if t_count:
        table = np.concatenate([t._table for t in tensors])
        items, pieces, tokens = matmul.matmul_items(rows, t_count, numba.get_num_threads())
        kquant.kq_run_items(table, items, pieces, x.reshape(-1), tokens, tokens, flat)
    ends = np.cumsum(rows * t_count)
    return [flat[e - r * t_count:e].reshape(t_count, r) for e, r in zip(ends, rows)]
