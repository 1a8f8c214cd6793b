"""The Colibri container: a folder holding a (quantized) model laid out for streaming.

    OUT/
      manifest.json          format, version, model hash, source, plan, every tensor's entry
      config.json ...        the source's config, tokenizer files, chat template, generation config
      dense.bin              tensors that stay resident (embedding, attention, norms, routers ...)
      experts-00000.bin ...  each routed expert's matrices and scales together, in one extent
                             aligned to 4 KiB: one read per expert, O_DIRECT-ready

A tensor entry gives its kind (f32 / f16 / bf16 / quant), shape, file, byte offset, length and
CRC-32; a quantized tensor also its format (bits, group ...) and where each of its arrays lies
inside its span. Readers map the files and build tensors as views: nothing is copied but what
must be widened (f16/bf16 to float32). Every checksum is verified at open.

Writing goes into `OUT.partial/` with a journal: each finished tensor is flushed to disk before
its journal line, so an interrupted conversion resumes where it stopped, and the folder is
renamed to OUT only when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from engine.errors import ModelFormatError
from engine.formats.safetensors_file import bf16_to_f32
from engine.pages import advise_huge_pages

FORMAT = "colibri-container"
VERSION = 1
MANIFEST = "manifest.json"
JOURNAL = "journal.jsonl"
EXTENT_ALIGN = 4096            # expert extents: one aligned read each
BUFFER_ALIGN = 64              # arrays inside a span: cache-line aligned for the kernels
EXPERT_FILE_BYTES = 2 << 30    # start a new experts file past this size
_PLAIN = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype("<u2")}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies and what it is."""

    name: str
    kind: str                       # f32 | f16 | bf16 | quant
    shape: tuple[int, ...]
    file: str
    offset: int                     # byte offset of the tensor's span in `file`
    length: int                     # bytes of the span
    crc32: int
    quant: dict | None = None       # quantized: the format's meta (bits, group ...)
    buffers: dict | None = None     # quantized: name -> [offset in span, nbytes, dtype, shape]

    def to_json(self) -> dict:
        """The manifest form."""
        d = asdict(self)
        d["shape"] = list(self.shape)
        return {k: v for k, v in d.items() if v is not None}

    @classmethod
    def from_json(cls, d: dict) -> "TensorEntry":
        """Read a manifest entry."""
        return cls(**{**d, "shape": tuple(d["shape"])})


@dataclass(frozen=True)
class ExpertExtent:
    """One routed expert's bytes: all its tensors, one aligned read."""

    layer: int
    expert: int
    file: str
    offset: int
    length: int
    crc32: int
    tensors: tuple[str, ...]

    def to_json(self) -> dict:
        """The manifest form."""
        return {**asdict(self), "tensors": list(self.tensors)}

    @classmethod
    def from_json(cls, d: dict) -> "ExpertExtent":
        """Read a manifest entry."""
        return cls(**{**d, "tensors": tuple(d["tensors"])})


def _pad(n: int, align: int) -> int:
    return -n % align


def _tensor_parts(tensor: Any, kind: str) -> tuple[dict | None, dict[str, np.ndarray]]:
    """(quant meta or None, named arrays to store) for a float array or a quantized tensor."""
    if kind == "quant":
        meta, buffers = tensor.to_buffers()
        return meta, {k: np.ascontiguousarray(v) for k, v in buffers.items()}
    arr = np.asarray(tensor, dtype=np.float32)
    if kind == "f32":
        return None, {"data": np.ascontiguousarray(arr)}
    if kind == "f16":
        return None, {"data": arr.astype("<f2")}
    if kind == "bf16":  # round to nearest even
        bits = arr.view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return None, {"data": rounded.astype("<u2")}
    raise ValueError(f"unknown tensor kind {kind!r}")


def kind_of(tensor: Any, float_kind: str = "f32") -> str:
    """'quant' for a quantized tensor, else the float kind to store it as."""
    return float_kind if isinstance(tensor, np.ndarray) else "quant"


class ContainerWriter:
    """Writes a container into OUT.partial, resumable, and renames it to OUT when finished."""

    def __init__(self, out: str | Path, resume_key: dict):
        """`resume_key` identifies the conversion (source hash, plan settings): a partial folder
        with another key is not resumed but refused."""
        self.out = Path(out)
        self.partial = self.out.with_name(self.out.name + ".partial")
        self.entries: dict[str, TensorEntry] = {}
        self.extents: dict[tuple[int, int], ExpertExtent] = {}
        self._handles: dict[str, Any] = {}
        self._sizes: dict[str, int] = {}
        self._expert_file = "experts-00000.bin"
        if self.out.exists():
            raise ModelFormatError(f"{self.out} already exists; choose another OUT or remove it")
        key_path = self.partial / "resume_key.json"
        if self.partial.exists():
            old = json.loads(key_path.read_text()) if key_path.is_file() else None
            if old != json.loads(json.dumps(resume_key)):
                raise ModelFormatError(
                    f"{self.partial} holds an interrupted conversion with other settings or another source; "
                    "rerun with the same settings to resume it, or remove that folder to start over"
                )
            self._replay()
        else:
            self.partial.mkdir(parents=True)
            _atomic_write(key_path, json.dumps(resume_key, indent=1, sort_keys=True))
        self._journal = open(self.partial / JOURNAL, "a", encoding="utf-8")
        # dense tensors and expert extents an earlier, interrupted run had finished
        self.resumed = len(self.extents) + sum(1 for e in self.entries.values() if e.file == "dense.bin")


    def _replay(self) -> None:
        """Load the journal and cut every data file back to the end of its last finished tensor."""
        journal = self.partial / JOURNAL
        ends: dict[str, int] = {}
        if journal.is_file():
            for line in journal.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line cut by the interruption: everything after it is redone
                if rec["type"] == "tensor":
                    e = TensorEntry.from_json(rec["entry"])
                    self.entries[e.name] = e
                    ends[e.file] = max(ends.get(e.file, 0), e.offset + e.length)
                else:
                    x = ExpertExtent.from_json(rec["extent"])
                    self.extents[(x.layer, x.expert)] = x
                    ends[x.file] = max(ends.get(x.file, 0), x.offset + x.length)
                    for t in rec["entries"]:
                        e = TensorEntry.from_json(t)
                        self.entries[e.name] = e
        for path in self.partial.glob("*.bin"):
            end = ends.get(path.name, 0)
            with open(path, "r+b") as f:
                f.truncate(end)
            self._sizes[path.name] = end
        if self.extents:
            self._expert_file = max(x.file for x in self.extents.values())
        with open(journal, "a+", encoding="utf-8") as f:  # drop a half-written last line
            f.seek(0)
            good = [ln for ln in f.read().splitlines() if _is_json(ln)]
        _atomic_write(journal, "".join(ln + "\n" for ln in good))

    def has(self, name: str) -> bool:
        """Whether the tensor is already written (resume)."""
        return name in self.entries

    def has_expert(self, layer: int, expert: int) -> bool:
        """Whether the expert's extent is already written (resume)."""
        return (layer, expert) in self.extents

    def _file(self, name: str):
        if name not in self._handles:
            self._handles[name] = open(self.partial / name, "ab")
            self._sizes.setdefault(name, self._handles[name].tell())
        return self._handles[name]

    def _write_span(self, fname: str, parts: dict[str, np.ndarray], align: int) -> tuple[int, int, int, dict]:
        """Append arrays to a file (aligned); returns (offset, length, crc32, buffer table)."""
        f = self._file(fname)
        start = self._sizes[fname]
        pad = _pad(start, align)
        if pad:
            f.write(b"\0" * pad)
        offset = start + pad
        table, pos, crc = {}, 0, 0
        for key, arr in parts.items():
            gap = _pad(pos, BUFFER_ALIGN)
            if gap:
                f.write(b"\0" * gap)
                crc = zlib.crc32(b"\0" * gap, crc)
                pos += gap
            data = memoryview(np.ascontiguousarray(arr)).cast("B")
            f.write(data)
            crc = zlib.crc32(data, crc)
            table[key] = [pos, arr.nbytes, arr.dtype.str, list(arr.shape)]
            pos += arr.nbytes
        self._sizes[fname] = offset + pos
        return offset, pos, crc, table

    def _commit(self, fname: str, record: dict) -> None:
        f = self._file(fname)
        f.flush()
        os.fsync(f.fileno())
        self._journal.write(json.dumps(record) + "\n")
        self._journal.flush()
        os.fsync(self._journal.fileno())

    def _entry(self, name: str, tensor: Any, kind: str, fname: str, align: int) -> TensorEntry:
        meta, parts = _tensor_parts(tensor, kind)
        offset, length, crc, table = self._write_span(fname, parts, align)
        return TensorEntry(name, kind, tuple(int(d) for d in tensor.shape), fname, offset, length, crc,
                           meta, table if kind == "quant" else None)

    def add_dense(self, name: str, tensor: Any, kind: str = "f32") -> None:
        """Write a resident tensor to dense.bin."""
        entry = self._entry(name, tensor, kind, "dense.bin", BUFFER_ALIGN)
        self.entries[name] = entry
        self._commit("dense.bin", {"type": "tensor", "entry": entry.to_json()})

    def add_expert(self, layer: int, expert: int, tensors: Mapping[str, Any], kinds: Mapping[str, str]) -> None:
        """Write one routed expert's tensors together in one 4 KiB-aligned extent."""
        if self._sizes.get(self._expert_file, 0) >= EXPERT_FILE_BYTES:
            self._expert_file = f"experts-{int(self._expert_file[8:13]) + 1:05d}.bin"
        fname = self._expert_file
        self._file(fname)
        start = self._sizes[fname]
        first = start + _pad(start, EXTENT_ALIGN)
        entries = []
        for i, (name, tensor) in enumerate(tensors.items()):
            entries.append(self._entry(name, tensor, kinds[name], fname, EXTENT_ALIGN if i == 0 else BUFFER_ALIGN))
        end = self._sizes[fname]
        tail = _pad(end, EXTENT_ALIGN)
        if tail:
            self._file(fname).write(b"\0" * tail)
            self._sizes[fname] = end + tail
        crc = _crc_file_range(self._file(fname), self.partial / fname, first, self._sizes[fname] - first)
        extent = ExpertExtent(layer, expert, fname, first, self._sizes[fname] - first, crc, tuple(tensors))
        self.extents[(layer, expert)] = extent
        for e in entries:
            self.entries[e.name] = e
        self._commit(fname, {"type": "expert", "extent": extent.to_json(), "entries": [e.to_json() for e in entries]})

    def finish(self, manifest: dict, copy_files: Iterable[Path] = ()) -> Path:
        """Write the manifest (with the model hash), copy the source's small files, rename to OUT."""
        for f in self._handles.values():
            f.close()
        self._journal.close()
        for src in copy_files:
            (self.partial / src.name).write_bytes(src.read_bytes())
        body = {
            "format": FORMAT,
            "version": VERSION,
            **manifest,
            "tensors": {n: e.to_json() for n, e in sorted(self.entries.items())},
            "experts": [x.to_json() for _, x in sorted(self.extents.items())],
        }
        body["model_hash"] = model_hash(body)
        _atomic_write(self.partial / MANIFEST, json.dumps(body, indent=1))
        (self.partial / JOURNAL).unlink(missing_ok=True)
        (self.partial / "resume_key.json").unlink(missing_ok=True)
        os.replace(self.partial, self.out)
        return self.out


def model_hash(manifest: Mapping) -> str:
    """sha256 over what defines the model: the config and every tensor's kind, shape, format and checksum."""
    digest = hashlib.sha256()
    digest.update(json.dumps(manifest.get("config", {}), sort_keys=True).encode())
    for name, e in sorted(manifest["tensors"].items()):
        digest.update(json.dumps([name, e["kind"], e["shape"], e.get("quant"), e["crc32"]], sort_keys=True).encode())
    return digest.hexdigest()


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _crc_file_range(handle, path: Path, offset: int, length: int) -> int:
    handle.flush()
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left:
            chunk = f.read(min(left, 16 << 20))
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk)
    return crc


def is_container(path: str | Path) -> bool:
    """Whether the folder is a Colibri container."""
    return (Path(path) / MANIFEST).is_file()


@dataclass
class Container:
    """A container opened for reading: a TensorSource whose tensors are views of mapped files."""

    path: str
    manifest: dict
    entries: dict[str, TensorEntry]
    extents: dict[tuple[int, int], ExpertExtent]
    maps: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def open(cls, folder: str | Path, verify: bool = True, verify_experts: bool = True,
             huge_pages: bool = False) -> "Container":
        """Read and check the manifest, map the data files, verify sizes and checksums.

        verify_experts=False leaves the expert files unread (a streaming store checks each extent's CRC-32
        when it first reads it): opening a model larger than memory must not read all of it.
        huge_pages=True maps every file on 2 MB pages (see advise_huge_pages): a model held whole.
        """
        folder = Path(folder)
        mpath = folder / MANIFEST
        try:
            manifest = json.loads(mpath.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelFormatError(f"{mpath}: missing; this folder is not a Colibri container") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelFormatError(f"{mpath}: not valid JSON ({exc}); convert the model again with `colibri convert`") from None
        if manifest.get("format") != FORMAT:
            raise ModelFormatError(f"{mpath}: not a Colibri container manifest; convert the model with `colibri convert`")
        version = manifest.get("version")
        if not isinstance(version, int) or version > VERSION:
            raise ModelFormatError(
                f"{mpath}: container format version {version} is newer than this Colibri reads ({VERSION}); "
                "upgrade Colibri, or convert the model again with this version"
            )
        try:
            entries = {n: TensorEntry.from_json(e) for n, e in manifest["tensors"].items()}
            extents = {(x["layer"], x["expert"]): ExpertExtent.from_json(x) for x in manifest.get("experts", [])}
        except (KeyError, TypeError) as exc:
            raise ModelFormatError(f"{mpath}: malformed entry ({exc}); convert the model again with `colibri convert`") from None
        self = cls(str(folder), manifest, entries, extents)
        files = {e.file for e in entries.values()}
        for fname in sorted(files):
            path = folder / fname
            need = max(e.offset + e.length for e in entries.values() if e.file == fname)
            size = path.stat().st_size if path.is_file() else -1
            if size < need:
                what = "is missing" if size < 0 else f"is {size} bytes but the manifest needs {need}"
                raise ModelFormatError(f"{path}: {what}; the container is truncated: convert the model again with `colibri convert`")
            self.maps[fname] = np.memmap(path, dtype=np.uint8, mode="r")
        if huge_pages:
            self.advise_huge_pages()
        if verify:
            self.verify(experts=verify_experts)
        return self

    @property
    def expert_files(self) -> set[str]:
        """The data files that hold expert extents."""
        return {x.file for x in self.extents.values()}

    def advise_huge_pages(self, experts: bool = True) -> None:
        """Ask for 2 MB pages (engine/pages.py) on the mapped files the kernels read weights through: all, or
        with experts=False those without expert extents (the experts are streamed: read into a store's slots, or
        with `--io mmap` by the baseline's 4 KB page faults). Pages read before the advice stay as they are."""
        expert_files = self.expert_files
        for fname, m in self.maps.items():
            if experts or fname not in expert_files:
                advise_huge_pages(m._mmap)

    def verify(self, experts: bool = True, names: Iterable[str] | None = None) -> None:
        """Check tensors' CRC-32 (about 4 GB/s): all, those outside expert extents (experts=False), or `names`."""
        expert_files = self.expert_files
        chosen = self.entries.values() if names is None else [self.entries[n] for n in names]
        for e in chosen:
            if not experts and e.file in expert_files:
                continue
            span = self.maps[e.file][e.offset : e.offset + e.length]
            if zlib.crc32(memoryview(span)) != e.crc32:
                raise ModelFormatError(
                    f"{Path(self.path) / e.file}: checksum mismatch in tensor {e.name}; the container is corrupt: "
                    "convert the model again with `colibri convert`"
                )

    @property
    def config(self) -> dict:
        """The source's config.json (stored in the manifest too)."""
        return self.manifest["config"]

    @property
    def model_hash(self) -> str:
        """The hash sidecar files are bound to."""
        return self.manifest["model_hash"]

    def names(self) -> Iterable[str]:
        """Every tensor name."""
        return self.entries.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape."""
        return self.entries[name].shape

    def location(self, name: str) -> str:
        """The file holding a tensor."""
        e = self.entries.get(name)
        return str(Path(self.path) / e.file) if e else self.path

    def load(self, name: str):
        """A float32 array (a view for f32) or a quantized tensor whose arrays are views of the map."""
        e = self.entries[name]
        return tensor_from_span(e, self.maps[e.file][e.offset : e.offset + e.length])


def tensor_from_span(e: TensorEntry, span: np.ndarray):
    """The tensor `e` describes over its bytes `span` (uint8): views for f32 and quantized, widened f16/bf16."""
    if e.kind == "quant":
        from engine.quant import QuantizedTensor

        buffers = {}
        for key, (off, nbytes, dtype, shape) in e.buffers.items():
            view = np.asarray(span[off : off + nbytes]).view(np.dtype(dtype)).reshape(shape)
            view.flags.writeable = False
            buffers[key] = view
        return QuantizedTensor.from_buffers(e.quant, buffers)
    raw = np.asarray(span[: e.length]).view(_PLAIN[e.kind]).reshape(e.shape)
    if e.kind == "f32":
        raw = raw.view()
        raw.flags.writeable = False
        return raw
    out = bf16_to_f32(raw) if e.kind == "bf16" else raw.astype(np.float32)
    out.flags.writeable = False
    return out
