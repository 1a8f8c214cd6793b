"""A GGUF file given a memory budget: converted once, as published, into a container that streams its experts.

Only a container can stream (each expert's matrices in one aligned extent). The GGUF's blocks are copied as they
are (`colibri convert FILE OUT` without --bits: no second rounding, the same answers as the file) into
`<data dir>/converted/NAME-KEY`, KEY a digest of the file's size, modification time and header, so a changed file
is converted again and later runs reuse the container. The disk's room is checked before anything is written;
the conversion writes into a `.partial` folder renamed only when complete, so an interrupted one resumes on the
next run and never leaves a container that loads half-written.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from app.config.paths import converted_dir
from app.config.sizes import format_size
from app.hub.convert import ConvertSettings, convert, published_bytes
from app.hub.progress import Note, Report, to_stderr
from engine.errors import DiskFullError
from engine.formats.container import is_container

HEADER_BYTES = 1 << 20      # the start of the file hashed into the key: the metadata and tensor table


def is_gguf(path: Path) -> bool:
    """Whether `path` is a GGUF file (what the loader reads as one)."""
    return Path(path).is_file() and Path(path).suffix.lower() == ".gguf"


def cache_key(path: Path) -> str:
    """16 hex digits naming this version of the file: its size, modification time and first HEADER_BYTES."""
    st = Path(path).stat()
    digest = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:".encode())
    with open(path, "rb") as f:
        digest.update(f.read(HEADER_BYTES))
    return digest.hexdigest()[:16]


def cached_container(path: Path, folder: Path | None = None) -> Path:
    """Where the container of GGUF `path` lies (or will) in `folder` (default: the data dir's converted/)."""
    base = folder if folder is not None else converted_dir()
    return base / f"{Path(path).stem}-{cache_key(path)}"


def container_for(path: Path, progress: Report | None = None, folder: Path | None = None) -> Path:
    """The container of GGUF `path` kept as published: found in the cache, or made there now (reported to
    PROGRESS, else on stderr). Raises DiskFullError, naming the room needed and the fix, before writing anything
    when the disk cannot hold it."""
    report = progress if progress is not None else to_stderr
    out = cached_container(path, folder)
    if is_container(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    need = published_bytes(path)
    partial = out.with_name(out.name + ".partial")
    done = sum(p.stat().st_size for p in partial.glob("*.bin")) if partial.is_dir() else 0
    free = shutil.disk_usage(out.parent).free
    if need - done > free:
        raise DiskFullError(
            f"{path.name} runs under --max-memory from a container of {format_size(need)} made once in {out.parent}, "
            f"which has {format_size(free)} free: free {format_size(need - done - free)} there, or convert it onto "
            f"another disk (`colibri convert {path} OUT`) and run OUT")
    report(Note(f"{path.name}: converting once, as published, into {out} (later runs reuse it)"))
    return convert(path, out, ConvertSettings(), report)
