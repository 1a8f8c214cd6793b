"""A GGUF file's header read lean: metadata decoded straight to Python values, tensors as views of one memory map.

`gguf.GGUFReader` keeps a numpy view of every part of every field, so a tokenizer's vocabulary and merges become
hundreds of thousands of small arrays: seconds and hundreds of MB before a weight is touched. `GGUFFile` reads the
same header with `struct` (string arrays element by element, numeric arrays with one `np.frombuffer` each) and
exposes what Colibri uses of the reader: `tensors` (name, type, ggml-order shape, element and byte counts, absolute
offset, and `data` shaped as the reader shapes it: float arrays for F16/F32/F64 and integer types, bytes
[..., row bytes] for block types), `data` (the map) and `metadata` (key -> str, int, float, bool or lists of them).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_SCALARS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
_PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
          GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, its bytes a view of the file's map (fields as gguf.ReaderTensor's)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray          # ggml order: [in, out, ...]
    n_elements: int
    n_bytes: int
    data_offset: int           # from the start of the file
    data: np.ndarray


class GGUFFile:
    """A GGUF file, memory-mapped read-only; ValueError (with what is wrong) on bytes that are not one."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.data = np.memmap(self.path, mode="r")
        self._bytes = memoryview(self.data)      # the header's parse slices this: a memmap slice costs far more
        self._end = self.data.shape[0]
        self._pos = 0
        if self._take("<I") != gguf.GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self._take("<I")
        self._order = "<"
        if version & 0xFFFF == 0:      # written on a machine of the other byte order
            self._order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in gguf.READER_SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version}, which this reader does not handle")
        n_tensors, n_kv = self._take("Q"), self._take("Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(GGUFValueType(self._take("I")))
        infos = [(self._string(), [self._take("Q") for _ in range(self._take("I"))], self._take("I"), self._take("Q"))
                 for _ in range(n_tensors)]
        alignment = self.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r}: must be a power of two")
        self.data_offset = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(*info) for info in infos]
        del self._bytes                           # only the header needed it
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("a tensor name appears twice")

    def _take(self, fmt: str) -> Any:
        fmt = fmt if fmt[0] in "<>" else self._order + fmt
        size = struct.calcsize(fmt)
        if self._pos + size > self._end:
            raise ValueError(f"the header runs past the end of the file (at byte {self._pos})")
        (value,) = struct.unpack_from(fmt, self._bytes, self._pos)
        self._pos += size
        return value

    def _string(self) -> str:
        n = self._take("Q")
        if self._pos + n > self._end:
            raise ValueError(f"a string runs past the end of the file (at byte {self._pos})")
        text = str(self._bytes[self._pos : self._pos + n], "utf-8")
        self._pos += n
        return text

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind != GGUFValueType.ARRAY:
            return self._take(_SCALARS[kind])
        item, n = GGUFValueType(self._take("I")), self._take("Q")
        if item in (GGUFValueType.STRING, GGUFValueType.ARRAY):
            return [self._value(item) for _ in range(n)]
        dtype = np.dtype(self._order + _SCALARS[item])
        if self._pos + n * dtype.itemsize > self._end:
            raise ValueError(f"an array runs past the end of the file (at byte {self._pos})")
        values = np.frombuffer(self.data, dtype, n, self._pos).tolist()
        self._pos += n * dtype.itemsize
        return values

    def _tensor(self, name: str, dims: list[int], kind: int, offset: int) -> GGUFTensor:
        qtype = GGMLQuantizationType(kind)
        block, size = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(dims, dtype=np.int64))
        n_bytes = n * size // block
        start = self.data_offset + offset
        if start + n_bytes > self._end:
            raise ValueError(f"tensor {name} ({n_bytes} bytes at {start}) runs past the end of the file "
                             f"({self._end} bytes)")
        shape = tuple(reversed(dims))                                    # numpy order: [..., out, in]
        if qtype in _PLAIN:
            dtype = np.dtype(_PLAIN[qtype]).newbyteorder(self._order)
            data = np.frombuffer(self.data, dtype, n, start).reshape(shape)
        else:
            data = np.frombuffer(self.data, np.uint8, n_bytes, start).reshape(
                gguf.quant_shape_to_byte_shape(shape, qtype))
        return GGUFTensor(name, qtype, np.array(dims, np.uint64), n, n_bytes, start, data)
