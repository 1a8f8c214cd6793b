"""The model library: what the models folder holds, one entry per model, and deleting one.

Each model is described from its own files, read only in their headers: a Colibri container from its manifest,
a Hugging Face folder from `config.json` and its safetensors headers, a GGUF file from its metadata. An entry says
the model's name, family (the checkpoint's `model_type` or GGUF architecture), parameters, bits per weight,
size on disk, kind, and whether an atlas is beside it. A model that cannot be read is listed with the reason,
never skipped in silence. Unfinished pulls and conversions (hidden `.partial` folders) are left out.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ColibriError

CONTAINER, HUGGING_FACE, GGUF = "container", "Hugging Face", "GGUF"
# bits of one value of each safetensors dtype
_DTYPE_BITS = {"F64": 64, "I64": 64, "U64": 64, "F32": 32, "I32": 32, "U32": 32, "BF16": 16, "F16": 16, "I16": 16,
               "U16": 16, "F8_E4M3": 8, "F8_E5M2": 8, "I8": 8, "U8": 8, "BOOL": 8}


@dataclass(frozen=True)
class ModelEntry:
    """One model of the models folder."""

    path: Path
    name: str                       # relative to the models folder
    kind: str                       # CONTAINER, HUGGING_FACE or GGUF
    family: str = "?"
    params: int | None = None       # weights, as stored (None: not known)
    bits: float | None = None       # average bits per weight (None: not known)
    size: int = 0                   # bytes on disk
    atlas: bool = False             # an atlas sidecar lies beside it (`colibri atlas`)
    problem: str | None = None      # why it could not be described, if it could not


def scan(folder: Path) -> list[ModelEntry]:
    """The models in folder (and in its subfolders holding GGUF files, as `colibri pull` leaves them), by name."""
    found: list[ModelEntry] = []
    if not folder.is_dir():
        return found
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.name.endswith(".partial"):
            continue
        if path.is_file() and path.suffix.lower() == ".gguf":
            found.append(describe(path, folder))
        elif path.is_dir():
            if (path / "manifest.json").is_file() or (path / "config.json").is_file():
                found.append(describe(path, folder))
            else:
                found += [describe(p, folder) for p in sorted(path.glob("*.gguf"))]
    return found


def describe(path: Path, root: Path) -> ModelEntry:
    """The entry of one model (a problem instead of its figures when its files cannot be read)."""
    from app.atlas.build import default_sidecar

    name = str(path.relative_to(root)) if path.is_relative_to(root) else path.name
    kind = GGUF if path.is_file() else CONTAINER if (path / "manifest.json").is_file() else HUGGING_FACE
    entry = ModelEntry(path, name, kind, size=disk_size(path), atlas=default_sidecar(path).is_file())
    try:
        family, params, stored_bits = {CONTAINER: _container, HUGGING_FACE: _hugging_face, GGUF: _gguf}[kind](path)
    except (OSError, ValueError, KeyError, TypeError, struct.error, ColibriError) as exc:
        return _with(entry, problem=f"{type(exc).__name__}: {exc}" if not isinstance(exc, ColibriError) else str(exc))
    bits = stored_bits / params if params else None
    return _with(entry, family=family, params=params or None, bits=bits)


def _with(entry: ModelEntry, **changes) -> ModelEntry:
    from dataclasses import replace

    return replace(entry, **changes)


def disk_size(path: Path) -> int:
    """Bytes of a file, or of every file under a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _container(path: Path) -> tuple[str, int, float]:
    manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    config = manifest.get("config") or {}
    family = str(config.get("model_type") or manifest.get("source", {}).get("architecture", "?"))
    params, stored = 0, 0.0
    for t in manifest["tensors"]:
        entry = manifest["tensors"][t] if isinstance(manifest["tensors"], dict) else t
        n = math.prod(entry["shape"])
        params += n
        stored += 8 * entry["length"]           # quantized values and their scales
    return family, params, stored


def _hugging_face(path: Path) -> tuple[str, int, float]:
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    family = str(config.get("model_type") or (config.get("architectures") or ["?"])[0])
    params, stored = 0, 0.0
    for shard in sorted(path.glob("*.safetensors")):
        with open(shard, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for key, t in header.items():
            if key == "__metadata__":
                continue
            n = math.prod(t["shape"])
            params += n
            stored += n * _DTYPE_BITS.get(t["dtype"], 8 * (t["data_offsets"][1] - t["data_offsets"][0]) / max(n, 1))
    return family, params, stored


def _gguf(path: Path) -> tuple[str, int, float]:
    from engine.formats.gguf_meta import gguf_metadata, open_gguf

    reader = open_gguf(path)
    family = str(gguf_metadata(reader).get("general.architecture", "?"))
    params = sum(int(t.n_elements) for t in reader.tensors)
    stored = sum(8.0 * int(t.n_bytes) for t in reader.tensors)
    return family, params, stored


def delete_model(entry: ModelEntry, root: Path) -> None:
    """Remove a model of the models folder (its atlas beside a GGUF file too); ColibriError for a path outside it."""
    path, root = entry.path.resolve(), root.resolve()
    if path == root or not path.is_relative_to(root):
        raise ColibriError(f"{entry.path} is not inside the models folder {root}: delete it yourself if you mean to")
    if path.is_dir():
        shutil.rmtree(path)
    else:
        from app.atlas.build import default_sidecar

        path.unlink(missing_ok=True)
        default_sidecar(path).unlink(missing_ok=True)
