"""GGUF metadata as plain Python values (str, int, float, bool, lists of them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import ModelFormatError
from engine.formats.gguf_file import GGUFFile, GGUFTensor
from engine.formats.page_release import np_map, release_range


def open_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file (memory-mapped, its header read by engine/formats/gguf_file.py), turning a failure to read
    it into a clear error."""
    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such GGUF file; check the path")
    try:
        return GGUFFile(path)
    except Exception as exc:  # ValueError on bad bytes, UnicodeDecodeError, an unknown type's ValueError ...
        raise ModelFormatError(
            f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc}); "
            "the file may be truncated or corrupt: download or convert it again"
        ) from exc


def gguf_metadata(reader: GGUFFile) -> dict[str, Any]:
    """Every key-value field of the file, decoded (strings as str, arrays as lists), in a new dict."""
    return dict(reader.metadata)


def release_tensor_pages(reader: GGUFFile, tensor: GGUFTensor) -> None:
    """Give back the mapped pages (and page cache) of one of the reader's tensors once its bytes are used up;
    views of it stay valid (a later read faults the pages in again from the file)."""
    release_range(np_map(reader.data), reader.data.filename, int(tensor.data_offset), int(tensor.n_bytes))
