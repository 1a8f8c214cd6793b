"""GGUF metadata as plain Python values (str, int, float, bool, lists of them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

from engine.errors import ModelFormatError
from engine.formats.page_release import np_map, release_range


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Open a GGUF file (memory-mapped), turning the reader's failures into a clear error."""
    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such GGUF file; check the path")
    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors ... on bad bytes
        raise ModelFormatError(
            f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc}); "
            "the file may be truncated or corrupt: download or convert it again"
        ) from exc


def gguf_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every key-value field of the file, decoded (strings as str, arrays as lists)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def release_tensor_pages(reader: gguf.GGUFReader, tensor: Any) -> None:
    """Give back the mapped pages (and page cache) of one of the reader's tensors once its bytes are used up;
    views of it stay valid (a later read faults the pages in again from the file)."""
    release_range(np_map(reader.data), reader.data.filename, int(tensor.data_offset), int(tensor.n_bytes))
