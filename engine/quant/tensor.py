"""`QuantizedTensor`: one group-wise quantized weight matrix, and `quantize` / `weighted_error`.

The tensor holds its storage arrays (layout in `engine/kernels/layout.py`) as read-only views, so
nothing can change weights under a running model and a memory-mapped tensor is never copied.
Kernels reach the arrays through `descriptor` (addresses and sizes), the same way for a memory
map, a cache buffer or a freshly quantized array.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numba
import numpy as np

from engine.kernels import matmul
from engine.kernels.layout import (
    BITS,
    BLOCK,
    FORMATS,
    GROUPS,
    ROWS16_FLAG,
    ROWS16_ROWS,
    check_activations,
    f16_bits,
    f16_values,
    from_rows16,
    pack_codes,
    rows16_allowed,
    to_rows16,
    unpack_codes,
)
from engine.quant import search
from engine.quant.kquant import KQuantTensor, kquant_matmul_many

META_KIND = "colibri.quant"
META_VERSION = 1
LAYOUT = "planes32-v1"          # meta "layout" of the plane layout
LAYOUT_ROWS16 = "rows16-v1"     # and of the rows16 layout (engine/kernels/layout.py)
LAYOUTS = {"planes": LAYOUT, "rows16": LAYOUT_ROWS16}
_LAYOUT_NAMES = {meta: name for name, meta in LAYOUTS.items()}
F16_MAX = 65504.0


def _check_format(bits: int, group: int) -> None:
    if bits not in BITS:
        raise ValueError(f"unsupported bit width {bits!r}: choose one of {', '.join(map(str, BITS))}")
    if group not in GROUPS:
        raise ValueError(f"unsupported group size {group!r}: choose one of {', '.join(map(str, GROUPS))}")


def _check_layout(layout: str, bits: int, asymmetric: bool, shape: tuple[int, int]) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown quantized layout {layout!r}: one of {', '.join(LAYOUTS)}")
    if layout == "rows16" and not rows16_allowed(bits, asymmetric, shape[0]):
        raise ValueError(f"the rows16 layout holds 4- and 8-bit symmetric matrices of whole 16-row blocks, not "
                         f"{bits}-bit {'asymmetric' if asymmetric else 'symmetric'} {list(shape)}")


def _readonly(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


def _storage(name: str, arr: np.ndarray, dtype, shape: tuple[int, int]) -> np.ndarray:
    """arr as a read-only [rows, cols] array of dtype, reinterpreting raw bytes or a flat buffer; never copies."""
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"quantized tensor buffer {name!r} must be a numpy array, got {type(arr).__name__}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"quantized tensor buffer {name!r} must be C-contiguous")
    want = np.dtype(dtype)
    if arr.dtype != want:
        if arr.dtype != np.uint8 or arr.nbytes % want.itemsize:
            raise ValueError(f"quantized tensor buffer {name!r} has dtype {arr.dtype}, expected {want} (or raw uint8 bytes)")
        arr = arr.reshape(-1).view(want)
    if arr.size != shape[0] * shape[1]:
        raise ValueError(
            f"quantized tensor buffer {name!r} holds {arr.size} {want} values, expected {shape[0]} x {shape[1]}: "
            "the buffer does not match the tensor's shape, bits and group"
        )
    return _readonly(arr.reshape(shape))


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A [out, in] weight matrix in group-wise `bits`-bit codes with fp16 scales (and offsets)."""

    shape: tuple[int, int]   # [out, in]; in % group == 0
    bits: int                # 2, 3, 4, 5, 6 or 8
    group: int               # 32, 64 or 128 weights per scale, along `in`
    asymmetric: bool         # True: w = d * u + m with a stored offset m per group
    a: np.ndarray            # [out, in / 32 * a_bytes] uint8: plane a (low bits of each code)
    b: np.ndarray            # [out, in / 32 * b_bytes] uint8: plane b (high bits), [out, 0] when unused
    scales: np.ndarray       # [out, in / group] uint16: fp16 bits of d
    mins: np.ndarray         # [out, in / group] uint16: fp16 bits of m, [out, 0] when symmetric
    layout: str = "planes"   # "planes", or "rows16": 4/8-bit symmetric codes and scales in rows16 order (same shapes)
    _flat: tuple = field(init=False, repr=False)          # the four arrays flattened, as the kernels take them
    _descriptor: tuple = field(init=False, repr=False)
    _table: np.ndarray = field(init=False, repr=False)
    _rows: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_format(self.bits, self.group)
        if len(self.shape) != 2 or min(self.shape) <= 0:
            raise ValueError(f"quantized tensor shape must be [out, in] with both > 0, got {list(self.shape)}")
        out, n_in = (int(s) for s in self.shape)
        if n_in % self.group:
            raise ValueError(f"in = {n_in} is not a multiple of the group size {self.group}: use a group that divides it")
        fmt = FORMATS[self.bits]
        nb, ng = n_in // BLOCK, n_in // self.group
        set_ = object.__setattr__
        set_(self, "shape", (out, n_in))
        set_(self, "asymmetric", bool(self.asymmetric))
        _check_layout(self.layout, self.bits, self.asymmetric, self.shape)
        set_(self, "a", _storage("a", self.a, np.uint8, (out, nb * fmt.a_bytes)))
        set_(self, "b", _storage("b", self.b, np.uint8, (out, nb * fmt.b_bytes)))
        set_(self, "scales", _storage("scales", self.scales, np.uint16, (out, ng)))
        set_(self, "mins", _storage("mins", self.mins, np.uint16, (out, ng if self.asymmetric else 0)))
        set_(self, "_flat", tuple(arr.reshape(-1) for arr in (self.a, self.b, self.scales, self.mins)))
        row = [self.bits | (ROWS16_FLAG if self.layout == "rows16" else 0), int(self.asymmetric), self.group, out, n_in]
        for arr in self._flat:
            row += [arr.ctypes.data, arr.size]
        set_(self, "_descriptor", tuple(int(v) for v in row))
        set_(self, "_table", np.array([row], np.int64))  # [1, 13]: a one-matrix table for matmul.run_items
        set_(self, "_rows", np.array([out], np.int64))

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x [T, in] float32 -> x @ W.T [T, out] float32 (bitwise independent of T and of threads)."""
        x = check_activations(x, self.shape[1])
        out = np.empty((x.shape[0], self.shape[0]), np.float32)
        if x.shape[0]:
            items, pieces, tokens = matmul.matmul_items(self._rows, x.shape[0], numba.get_num_threads())
            matmul.run_items(self._table, items, pieces, x.reshape(-1), tokens, tokens, out.reshape(-1))
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows ids [T] of the weights [T, in] float32, dequantized by the kernels (the values `dequantize` gives)."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise IndexError(f"row ids must lie in 0 .. {self.shape[0] - 1}")
        out = np.empty((ids.size, self.shape[1]), np.float32)
        if ids.size:
            matmul.gather_rows(self._table[0], ids, out.reshape(-1))
        return out

    def dequantize(self) -> np.ndarray:
        """The weights [out, in] float32 in plain numpy (the reference the kernels must match)."""
        return self.dequantize_rows(0, self.shape[0])

    def dequantize_rows(self, r0: int, r1: int) -> np.ndarray:
        """Rows r0 .. r1 - 1 of the weights [r1 - r0, in] float32 (numpy; bounded memory for big tensors)."""
        if self.layout == "rows16":      # the whole row blocks around the rows, back in plane order
            first = r0 // ROWS16_ROWS * ROWS16_ROWS
            end = -(-r1 // ROWS16_ROWS) * ROWS16_ROWS
            a, scales = from_rows16(self.a[first:end], self.scales[first:end])
            a, scales = a[r0 - first:r1 - first], scales[r0 - first:r1 - first]
        else:
            a, scales = self.a[r0:r1], self.scales[r0:r1]
        rows = slice(r0, r1)
        u = unpack_codes(a, self.b[rows], self.bits, self.shape[1]).astype(np.float32)             # [rows, in]
        d = np.repeat(f16_values(scales), self.group, axis=1)                                     # [rows, in]
        if self.asymmetric:
            m = np.repeat(f16_values(self.mins[rows]), self.group, axis=1)
        else:
            m = d * np.float32(-(1 << (self.bits - 1)))
        return u * d + m  # u * d is exact in float32, so this rounds once, like the kernels' fma

    def __reduce__(self):
        # rebuild through __init__ (pickle, copy): the descriptor's addresses belong to this process's arrays
        return (type(self), (self.shape, self.bits, self.group, self.asymmetric, self.a, self.b, self.scales, self.mins,
                             self.layout))

    def with_layout(self, layout: str) -> "QuantizedTensor":
        """This matrix in another layout (the same weights; a copy unless it is already in that layout)."""
        if layout == self.layout:
            return self
        _check_layout(layout, self.bits, self.asymmetric, self.shape)
        a, scales = (to_rows16 if layout == "rows16" else from_rows16)(self.a, self.scales)
        return QuantizedTensor(self.shape, self.bits, self.group, self.asymmetric, a, self.b, scales, self.mins, layout)

    def __repr__(self) -> str:
        kind = ("asymmetric" if self.asymmetric else "symmetric") + (", rows16" if self.layout == "rows16" else "")
        return (f"QuantizedTensor(shape={list(self.shape)}, bits={self.bits}, group={self.group}, {kind}, "
                f"{self.bits_per_weight:.3f} bits/weight)")

    @property
    def nbytes(self) -> int:
        """Bytes of all storage arrays."""
        return int(self.a.nbytes + self.b.nbytes + self.scales.nbytes + self.mins.nbytes)

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per weight, scales and offsets included."""
        return self.nbytes * 8 / (self.shape[0] * self.shape[1])

    @property
    def descriptor(self) -> tuple[int, ...]:
        """13 ints: bits (or-ed with ROWS16_FLAG in the rows16 layout), asym, group, out, in, then (address, length)
        of a, b, scales, mins (for fused kernels).

        The addresses are valid while this tensor lives: whoever passes them on keeps the tensor referenced.
        """
        return self._descriptor

    @property
    def descriptor_row(self) -> np.ndarray:
        """`descriptor` as an int64 array [13] (read-only use: copy it into a kernel's table)."""
        return self._table[0]

    def to_buffers(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(JSON-able meta, named C-contiguous storage arrays) for a container writer."""
        meta = {"kind": META_KIND, "version": META_VERSION, "layout": LAYOUTS[self.layout], "shape": list(self.shape),
                "bits": self.bits, "group": self.group, "asymmetric": self.asymmetric}
        buffers = {"a": self.a, "scales": self.scales}
        if self.b.size:
            buffers["b"] = self.b
        if self.asymmetric:
            buffers["mins"] = self.mins
        return meta, buffers

    @classmethod
    def from_buffers(cls, meta: dict, buffers: dict[str, np.ndarray]) -> "QuantizedTensor":
        """The tensor over the given buffers (read-only memory-map views are fine; nothing is copied)."""
        if meta.get("kind") != META_KIND or meta.get("layout") not in _LAYOUT_NAMES:
            raise ValueError(f"not a Colibri quantized tensor of layout {' or '.join(_LAYOUT_NAMES)}: meta says "
                             f"kind={meta.get('kind')!r}, layout={meta.get('layout')!r}")
        if int(meta.get("version", 0)) > META_VERSION:
            raise ValueError(f"quantized tensor format version {meta['version']} is newer than this Colibri reads "
                             f"({META_VERSION}): update Colibri")
        bits, group, asym = int(meta["bits"]), int(meta["group"]), bool(meta["asymmetric"])
        _check_format(bits, group)
        needed = ["a", "scales"] + (["b"] if FORMATS[bits].plane_b else []) + (["mins"] if asym else [])
        missing = [n for n in needed if n not in buffers]
        if missing:
            raise ValueError(f"quantized tensor buffers missing: {', '.join(missing)}")
        rows = int(meta["shape"][0])
        return cls(tuple(meta["shape"]), bits, group, asym, buffers["a"],
                   buffers.get("b", np.zeros((rows, 0), np.uint8)), buffers["scales"],
                   buffers.get("mins", np.zeros((rows, 0), np.uint16)), _LAYOUT_NAMES[meta["layout"]])


def matmul_many(x: np.ndarray, tensors: Sequence[QuantizedTensor]) -> list[np.ndarray]:
    """x [T, in] times several quantized [out_i, in] matrices sharing that input (q, k, v; gate, up) in one
    parallel call (one per matrix for a mix of QuantizedTensors and KQuantTensors) -> [T, out_i] each, bitwise
    equal to each tensor's own matmul."""
    if tensors and all(isinstance(t, KQuantTensor) for t in tensors):
        return kquant_matmul_many(x, tensors)
    if tensors and all(isinstance(t, (QuantizedTensor, KQuantTensor)) for t in tensors):
        if any(isinstance(t, KQuantTensor) for t in tensors):   # a mix (a GGUF Q4_K_M's q, k, v): one call each
            return [t.matmul(x) for t in tensors]
    if not tensors or not all(isinstance(t, QuantizedTensor) for t in tensors):
        raise ValueError("matmul_many takes a non-empty sequence of QuantizedTensors or KQuantTensors")
    n_in = tensors[0].shape[1]
    if any(t.shape[1] != n_in for t in tensors):
        raise ValueError(f"matmul_many: the matrices do not share an input width: {[list(t.shape) for t in tensors]}")
    x = check_activations(x, n_in)
    rows = np.array([t.shape[0] for t in tensors], np.int64)
    t_count = x.shape[0]
    flat = np.empty(t_count * int(rows.sum()), np.float32)
    if t_count:
        table = np.array([t.descriptor for t in tensors], np.int64)
        items, pieces, tokens = matmul.matmul_items(rows, t_count, numba.get_num_threads())
        matmul.run_items(table, items, pieces, x.reshape(-1), tokens, tokens, flat)
    ends = np.cumsum(rows * t_count)
    return [flat[e - r * t_count:e].reshape(t_count, r) for e, r in zip(ends, rows)]


def _check_weights(w: np.ndarray, group: int) -> np.ndarray:
    if not isinstance(w, np.ndarray):
        raise ValueError(f"weights must be a numpy array, got {type(w).__name__}")
    if w.dtype.kind != "f":
        raise ValueError(f"weights must be floating point, got {w.dtype}")
    if w.ndim != 2 or 0 in w.shape:
        raise ValueError(f"weights must be a non-empty [out, in] matrix, got shape {list(w.shape)}")
    if w.shape[1] % group:
        raise ValueError(f"in = {w.shape[1]} is not a multiple of the group size {group}: use a group that divides it")
    w = np.ascontiguousarray(w, np.float32)
    if not np.isfinite(w).all():
        raise ValueError("weights contain NaN or infinity: the checkpoint is damaged")
    return w


def _check_importance(importance: np.ndarray | None, n_in: int) -> np.ndarray:
    """Per-channel search weights c (float64 [in]), with a small floor so no channel is ignored outright."""
    if importance is None:
        return np.ones(n_in, np.float64)
    imp = np.asarray(importance)
    if imp.dtype.kind not in "fiu":
        raise ValueError(f"importance must be real numbers, got {imp.dtype}")
    if imp.shape != (n_in,):
        raise ValueError(f"importance has shape {list(imp.shape)}, expected [{n_in}] (one value per input channel)")
    imp = imp.astype(np.float64)
    if not np.isfinite(imp).all() or (imp < 0).any():
        raise ValueError("importance must be finite and >= 0 (mean squared activation per input channel)")
    mean = imp.mean()
    if mean <= 0:
        return np.ones(n_in, np.float64)
    return imp / mean + 1e-3


ROWS_PER_CHUNK_WEIGHTS = 1 << 23  # quantize about 8 M weights at a time to bound temporaries


def quantize(w: np.ndarray, bits: int, group: int, *, importance: np.ndarray | None = None,
             clip_search: bool = True, asymmetric: bool | None = None, layout: str | None = None) -> QuantizedTensor:
    """w [out, in] -> QuantizedTensor minimising sum_c importance[c] * sum_r (w - w_q)[r, c]^2 per group.

    `asymmetric` None takes the format's default (zero points at 2 bits only). `layout` None takes
    rows16 where it applies (4- and 8-bit symmetric, whole 16-row blocks: the fast integer kernels), else planes.
    """
    _check_format(bits, group)
    w = _check_weights(w, group)
    c = _check_importance(importance, w.shape[1])
    asym = FORMATS[bits].asymmetric if asymmetric is None else bool(asymmetric)
    out, n_in = w.shape
    ratios = search.clip_ratios(bits, clip_search)
    step = max(1, ROWS_PER_CHUNK_WEIGHTS // n_in)
    parts = []
    for r0 in range(0, out, step):
        wc = w[r0:r0 + step]                                                              # [rows, in]
        d = np.empty((wc.shape[0], n_in // group), np.float32)
        m = np.zeros_like(d)
        if asym:
            search.search_asymmetric(wc, c, bits, group, ratios, d, m)
        else:
            search.search_symmetric(wc, c, bits, group, ratios, d)
        if np.abs(d).max() > F16_MAX or np.abs(m).max() > F16_MAX:
            raise ValueError("weights too large for fp16 scales (|scale| > 65504): this tensor cannot be quantized")
        d16, m16 = f16_bits(d), f16_bits(m)
        codes = np.empty(wc.shape, np.uint8)
        search.encode(wc, bits, group, asym, f16_values(d16), f16_values(m16), codes)
        a, b = pack_codes(codes, bits)
        parts.append((a, b, d16, m16 if asym else np.zeros((wc.shape[0], 0), np.uint16)))
    cat = [np.concatenate(p) if len(parts) > 1 else p[0] for p in zip(*parts)]
    q = QuantizedTensor((out, n_in), bits, group, asym, *cat)
    if layout is None:
        layout = "rows16" if rows16_allowed(bits, asym, out) else "planes"
    return q.with_layout(layout)


def quantized_error(w: np.ndarray, bits: int, group: int, *, importance: np.ndarray | None = None,
                    asymmetric: bool | None = None) -> float:
    """`weighted_error(w, quantize(w, ...), importance)` without building the codes: the same search and fp16
    scales, the error summed as they are encoded (the planner measures every format of every matrix)."""
    _check_format(bits, group)
    w = _check_weights(w, group)
    c = _check_importance(importance, w.shape[1])
    imp = np.ones(w.shape[1]) if importance is None else np.asarray(importance, np.float64)
    asym = FORMATS[bits].asymmetric if asymmetric is None else bool(asymmetric)
    ratios = search.clip_ratios(bits, True)
    d = np.empty((w.shape[0], w.shape[1] // group), np.float32)
    m = np.zeros_like(d)
    if asym:
        search.search_asymmetric(w, c, bits, group, ratios, d, m)
    else:
        search.search_symmetric(w, c, bits, group, ratios, d)
    if np.abs(d).max() > F16_MAX or np.abs(m).max() > F16_MAX:
        raise ValueError("weights too large for fp16 scales (|scale| > 65504): this tensor cannot be quantized")
    err = np.empty(w.shape[0], np.float64)
    search.encoded_error(w, imp, bits, group, asym, f16_values(f16_bits(d)), f16_values(f16_bits(m)), err)
    return float(err.sum())


def weighted_error(w: np.ndarray, q: QuantizedTensor, importance: np.ndarray | None = None) -> float:
    """sum_c importance[c] * sum_r (w - q.dequantize())[r, c]^2 (uniform importance when None)."""
    w = np.asarray(w)
    if w.shape != q.shape:
        raise ValueError(f"weights have shape {list(w.shape)} but the quantized tensor {list(q.shape)}")
    imp = None
    if importance is not None:
        imp = np.asarray(importance, np.float64)
        if imp.shape != (q.shape[1],):
            raise ValueError(f"importance has shape {list(imp.shape)}, expected [{q.shape[1]}]")
    per_channel = np.zeros(q.shape[1], np.float64)                                          # [in]
    step = max(1, ROWS_PER_CHUNK_WEIGHTS // q.shape[1])
    for r0 in range(0, q.shape[0], step):
        diff = w[r0:r0 + step].astype(np.float64) - q.dequantize_rows(r0, min(q.shape[0], r0 + step))
        per_channel += np.einsum("rc,rc->c", diff, diff)
    return float(per_channel.sum() if imp is None else per_channel @ imp)
