"""Safetensors files read through a memory map: float32 tensors are views, never copies.

The header is parsed here rather than through the `safetensors` package because its numpy
loader copies every tensor and cannot represent bfloat16; a map lets float32 checkpoints load
in no time and lets the page cache, not Python, hold them. Every offset is checked against the
file size, so a truncated download fails at open with the file's name.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from engine.errors import ModelFormatError
from engine.formats.page_release import np_map, release_range

# safetensors dtype -> (numpy dtype of the stored bytes, item size)
_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype("u1"),   # float8_e4m3fn bits: read through engine.quant.published.FP8Tensor
}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_MAX_HEADER = 100 * 1024 * 1024


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32, exactly."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values of a floating-point dtype (safetensors spelling; bf16 as uint16) -> a float32 copy."""
    return bf16_to_f32(raw) if dtype == "BF16" else raw.astype(np.float32)


class SafetensorsFile:
    """One .safetensors file: its tensor table and a read-only map of its bytes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ModelFormatError(f"{self.path}: file is {size} bytes, too short for a safetensors header; download it again")
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_HEADER or 8 + n > size:
                    raise ModelFormatError(f"{self.path}: header length {n} does not fit in a {size}-byte file; "
                                           "the file is truncated or not safetensors: download it again")
                header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelFormatError(f"{self.path}: safetensors header is not valid JSON ({exc}); download the file again") from None
        except RecursionError:   # JSON nested thousands deep: no header a writer makes
            raise ModelFormatError(f"{self.path}: safetensors header is nested too deeply to be a tensor table; "
                                   "the file is corrupt: download it again") from None
        except OSError as exc:
            raise ModelFormatError(f"{self.path}: cannot read ({exc.strerror})") from None
        if not isinstance(header, dict):
            raise ModelFormatError(f"{self.path}: safetensors header is a JSON {type(header).__name__}, not a table of "
                                   "tensors; the file is corrupt: download it again")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise ModelFormatError(f"{self.path}: safetensors __metadata__ is not an object; the file is corrupt: "
                                   "download it again")
        self.metadata = metadata
        data_start, data_size = 8 + n, size - 8 - n
        self.tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
                ints = (begin, end, *shape)
                if not isinstance(dtype, str) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in ints):
                    raise TypeError
            except (KeyError, TypeError, ValueError):
                raise ModelFormatError(f"{self.path}: malformed entry for tensor {name} in the header; "
                                       "the file is corrupt: download it again") from None
            if dtype not in _DTYPES:
                raise ModelFormatError(
                    f"{self.path}: tensor {name} has dtype {dtype}, which Colibri does not read "
                    f"(it reads {', '.join(_DTYPES)}); use a float16, bfloat16, float32 or block-scaled FP8 version of the model"
                )
            nbytes = int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype].itemsize
            if not (0 <= begin <= end <= data_size) or end - begin != nbytes:
                raise ModelFormatError(
                    f"{self.path}: tensor {name} claims bytes {begin}..{end} of a {data_size}-byte data section "
                    f"(shape {list(shape)} {dtype} needs {nbytes}); the file is truncated or corrupt: download it again"
                )
            self.tensors[name] = (dtype, shape, data_start + begin, nbytes)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored values (bf16 as uint16, F8_E4M3 as uint8 bits), a read-only view of the map."""
        dtype, shape, offset, nbytes = self.tensors[name]
        view = np.asarray(self._map[offset : offset + nbytes]).view(_DTYPES[dtype]).reshape(shape)
        view.flags.writeable = False
        return view

    def drop_pages(self, name: str) -> None:
        """Give back the map's pages (and page cache) under a tensor whose bytes a reader has used up.

        Views of the tensor stay valid: a later read faults its pages in again from the file."""
        _, _, offset, nbytes = self.tensors[name]
        release_range(np_map(self._map), self.path, offset, nbytes)

    def float32(self, name: str) -> np.ndarray:
        """The tensor as float32: a view for F32, a converted copy for F16/BF16/F64 (whose mapped pages are then
        released from this process)."""
        dtype = self.tensors[name][0]
        if dtype not in FLOAT_DTYPES:
            raise ModelFormatError(f"{self.path}: tensor {name} is {dtype}, expected a floating-point weight")
        raw = self.raw(name)
        if dtype == "F32":
            return raw
        out = to_float32(raw, dtype)
        out.flags.writeable = False
        # the copy is what the caller keeps: the stored bytes leave this process's RSS (they stay in the page cache,
        # reclaimable, so a second read is no disk read); else a bf16 model would weigh 1.5 times its float32 size
        _, _, offset, nbytes = self.tensors[name]
        release_range(np_map(self._map), None, offset, nbytes)
        return out
