"""The Colibri container: a folder holding a (quantized) model laid out for streaming.

    OUT/
      manifest.json          format, version, model hash, source, plan, every tensor's entry
      config.json ...        the source's config, tokenizer files, chat template, generation config
      dense.bin              tensors that stay resident (embedding, attention, norms, routers ...)
      experts-00000.bin ...  each routed expert's matrices and scales together, in one extent
                             aligned to 4 KiB: one read per expert, O_DIRECT-ready

A tensor entry gives its kind (f32 / f16 / bf16 / quant: a QuantizedTensor, or FP8 / MXFP4 weights or GGUF
K-quant / IQ4 blocks kept as published, told apart by their meta's kind), shape, file, byte offset, length and
CRC-32; a quantized tensor also its format (bits, group ...) and where each of its arrays lies
inside its span. Readers map the files and build tensors as views: nothing is copied but what
must be widened (f16/bf16 to float32). At open the manifest's shape (engine/formats/manifest.py) and
its model hash are checked, then every checksum.

Writing goes into `OUT.partial/` with a journal: finished tensors are flushed to disk before
their journal lines (each carries its own CRC-32), after every tensor or, with `sync_bytes`, once
that many bytes are written, so an interrupted conversion resumes where it last synced, from the
first torn or damaged record on, and the folder is renamed to OUT only when complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from engine.errors import ModelFormatError
from engine.formats.manifest import check_manifest, corrupt
from engine.formats.page_release import np_map, release_range
from engine.formats.safetensors_file import bf16_to_f32
from engine.pages import advise_huge_pages

FORMAT = "colibri-container"
VERSION = 2                    # 2: the model hash covers the whole manifest (1: config and tensors)
MANIFEST = "manifest.json"
JOURNAL = "journal.jsonl"
RESUME_KEY = "resume_key.json"  # in OUT.partial: what the conversion is (source, settings)
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
        return meta, {k: v if hasattr(v, "chunks") else np.ascontiguousarray(v) for k, v in buffers.items()}
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


def _buffer_bytes(arr: Any) -> Iterable[Any]:
    """The bytes of a buffer to store, in order: an array's whole, or a generated buffer's `chunks()`.

    A generated buffer (`colibri synth --bits`) has `dtype`, `shape` and `nbytes` like an array and yields its
    bytes piece by piece, so a tensor larger than the working set is written without ever being whole in memory.
    """
    if hasattr(arr, "chunks"):
        written = 0
        for piece in arr.chunks():
            data = memoryview(piece).cast("B")
            written += data.nbytes
            yield data
        if written != arr.nbytes:
            raise ValueError(f"a generated buffer yielded {written} bytes, it declares {arr.nbytes}")
        return
    yield memoryview(np.ascontiguousarray(arr)).cast("B")


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
        self.expected_bytes = 0         # what the finished container will take, once the caller knows (messages)
        # journal (and fsync) once this many bytes are written, 0: after every tensor. An fsync a tensor holds
        # a fast writer (`colibri synth`) to half the disk's speed; a kill then loses at most this much work.
        self.sync_bytes = 0
        self._pending: list[str] = []   # journal lines of finished tensors whose bytes are not yet synced
        self._dirty: set[str] = set()   # data files written since the last sync
        self._synced_at = 0             # written_bytes at the last sync
        self._run_crc: int | None = None    # an expert extent's CRC-32, computed while its bytes are written
        if self.out.exists():
            raise ModelFormatError(f"{self.out} already exists; choose another OUT or remove it")
        key_path = self.partial / RESUME_KEY
        self.complete = False           # an earlier run had finished all but the rename: OUT is ready
        self.resumed = 0
        self._journal: Any = None
        if self.partial.is_dir() and _holds_no_work(self.partial):
            shutil.rmtree(self.partial)     # a run stopped before its key was written: nothing to resume
        if self.partial.is_dir() and (self.partial / MANIFEST).is_file() and not (self.partial / JOURNAL).exists():
            # killed inside `finish`, after the manifest and the journal's removal: only the rename is left
            if key_path.exists() and _read_key(key_path, self.partial) != json.loads(json.dumps(resume_key)):
                raise ModelFormatError(
                    f"{self.partial} holds a finished conversion with other settings or another source; "
                    f"rename it to {self.out.name} to keep it, or remove it to start over"
                )
            key_path.unlink(missing_ok=True)
            os.replace(self.partial, self.out)
            self.complete = True
            return
        if self.partial.exists():
            if _read_key(key_path, self.partial) != json.loads(json.dumps(resume_key)):
                raise ModelFormatError(
                    f"{self.partial} holds an interrupted conversion with other settings or another source; "
                    "rerun with the same settings to resume it, or remove that folder to start over"
                )
            for name in os.listdir(self.partial):
                if _is_temp(name):      # a write the kill cut short: it would end up in OUT
                    (self.partial / name).unlink(missing_ok=True)
            self._replay()
        else:
            self.partial.mkdir(parents=True)
            try:
                _atomic_write(key_path, json.dumps(resume_key, indent=1, sort_keys=True))
            except BaseException:
                shutil.rmtree(self.partial, ignore_errors=True)     # it holds nothing yet
                raise
        self._journal = open(self.partial / JOURNAL, "a", encoding="utf-8")
        # dense tensors and expert extents an earlier, interrupted run had finished
        self.resumed = len(self.extents) + sum(1 for e in self.entries.values() if e.file == "dense.bin")


    def _replay(self) -> None:
        """Load the journal and cut every data file back to the end of its last finished tensor.

        The journal is read up to its first record that is torn (a kill mid-line), malformed, or whose bytes
        are missing or fail their CRC-32 (damage): that record and all after it are redone, and the journal
        is cut there too, so a damaged partial folder resumes to the same container as an undamaged one.
        """
        journal = self.partial / JOURNAL
        text = journal.read_text(encoding="utf-8", errors="replace") if journal.is_file() else ""
        sizes = {p.name: p.stat().st_size for p in self.partial.glob("*.bin") if p.is_file()}
        ends: dict[str, int] = {}
        good: list[str] = []
        for line in text.splitlines():
            try:
                rec = json.loads(line)
                if zlib.crc32(json.dumps({k: v for k, v in rec.items() if k != "crc"}).encode()) != rec["crc"]:
                    break
                if rec["type"] == "tensor":
                    e = TensorEntry.from_json(rec["entry"])
                    extent, entries, span = None, [e], (e.file, e.offset, e.length, e.crc32)
                else:
                    extent = ExpertExtent.from_json(rec["extent"])
                    entries = [TensorEntry.from_json(t) for t in rec["entries"]]
                    span = (extent.file, extent.offset, extent.length, extent.crc32)
                    if any(not _inside(t, extent) for t in entries):
                        break
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                break   # a line cut by the interruption, or damaged
            if not _span_intact(self.partial, sizes, *span):
                break
            if extent is not None:
                self.extents[(extent.layer, extent.expert)] = extent
            for e in entries:
                self.entries[e.name] = e
            ends[span[0]] = max(ends.get(span[0], 0), span[1] + span[2])
            good.append(line)
        for name in sizes:
            end = ends.get(name, 0)
            with open(self.partial / name, "r+b") as f:
                f.truncate(end)
            self._sizes[name] = end
        if self.extents:
            self._expert_file = max(x.file for x in self.extents.values())
        kept = "".join(ln + "\n" for ln in good)
        if kept != text:
            _atomic_write(journal, kept)

    @property
    def written_bytes(self) -> int:
        """Bytes in the data files so far (after a resume: what the earlier runs had finished)."""
        return sum(self._sizes.values())

    def close(self) -> None:
        """Close the open files without finishing (a failed conversion); OUT.partial stays for a resume,
        with the tensors finished so far journaled where the disk still takes them."""
        if self._pending and self._journal is not None and not self._journal.closed:
            with contextlib.suppress(OSError):      # a full disk: those tensors are redone on the resume
                self._sync()
        for f in [*self._handles.values(), self._journal]:
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self._handles.clear()

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
            self._put(f, b"\0" * pad)
        offset = start + pad
        table, pos, crc = {}, 0, 0
        for key, arr in parts.items():
            gap = _pad(pos, BUFFER_ALIGN)
            if gap:
                self._put(f, b"\0" * gap)
                crc = zlib.crc32(b"\0" * gap, crc)
                pos += gap
            for data in _buffer_bytes(arr):
                self._put(f, data)
                crc = zlib.crc32(data, crc)
            table[key] = [pos, arr.nbytes, arr.dtype.str, list(arr.shape)]
            pos += arr.nbytes
        self._sizes[fname] = offset + pos
        return offset, pos, crc, table

    def _put(self, f: Any, data: Any) -> None:
        """Write bytes; inside an expert extent also into its CRC-32 (reading the extent back costs a disk pass)."""
        f.write(data)
        if self._run_crc is not None:
            self._run_crc = zlib.crc32(data, self._run_crc)

    def _commit(self, fname: str, record: dict) -> None:
        """Journal a finished tensor, its bytes synced first: now, or with the next `sync_bytes` written."""
        # the line's own CRC-32: damage to an entry's fields (a bit width, a shape) is caught on resume
        self._pending.append(json.dumps({**record, "crc": zlib.crc32(json.dumps(record).encode())}) + "\n")
        self._dirty.add(fname)
        if self.written_bytes - self._synced_at >= self.sync_bytes:
            self._sync()

    def _sync(self) -> None:
        """fsync the data files written since the last sync, then journal their finished tensors."""
        for fname in sorted(self._dirty):
            f = self._file(fname)
            f.flush()
            os.fsync(f.fileno())
        self._dirty.clear()
        self._journal.write("".join(self._pending))
        self._journal.flush()
        os.fsync(self._journal.fileno())
        self._pending.clear()
        self._synced_at = self.written_bytes

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
        f = self._file(fname)
        start = self._sizes[fname]
        first = start + _pad(start, EXTENT_ALIGN)
        if first > start:       # the gap before the extent, outside its CRC
            f.write(b"\0" * (first - start))
            self._sizes[fname] = first
        entries = []
        self._run_crc = 0
        try:
            for i, (name, tensor) in enumerate(tensors.items()):
                entries.append(self._entry(name, tensor, kinds[name], fname, EXTENT_ALIGN if i == 0 else BUFFER_ALIGN))
            end = self._sizes[fname]
            tail = _pad(end, EXTENT_ALIGN)
            if tail:
                self._put(f, b"\0" * tail)
                self._sizes[fname] = end + tail
            crc = self._run_crc
        finally:
            self._run_crc = None
        extent = ExpertExtent(layer, expert, fname, first, self._sizes[fname] - first, crc, tuple(tensors))
        self.extents[(layer, expert)] = extent
        for e in entries:
            self.entries[e.name] = e
        self._commit(fname, {"type": "expert", "extent": extent.to_json(), "entries": [e.to_json() for e in entries]})

    def finish(self, manifest: dict, copy_files: Iterable[Path] = ()) -> Path:
        """Write the manifest (with the model hash), copy the source's small files, rename to OUT.

        The journal goes before the rename: a partial folder with a manifest and no journal is complete
        (`complete` on the next run)."""
        self._sync()            # the manifest must not name bytes the disk may not hold yet
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
        (self.partial / RESUME_KEY).unlink(missing_ok=True)
        os.replace(self.partial, self.out)
        return self.out


# Left out of the model hash: the hash itself, and where the model was converted from (the same model made from
# a copy elsewhere is the same model: sidecars such as the usage history and the atlas stay bound to it).
_UNHASHED = ("model_hash", "source")


def model_hash(manifest: Mapping) -> str:
    """sha256 over what defines the model; the identity sidecar files are bound to, re-checked at open.

    Version 2 hashes the whole manifest but `_UNHASHED` (config, plan, every tensor's and extent's entry:
    an edited offset, bit width or top-k is caught); version 1 hashed the config and each tensor's kind,
    shape, format and checksum.
    """
    if manifest.get("version", VERSION) >= 2:
        body = {k: v for k, v in manifest.items() if k not in _UNHASHED}
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    digest = hashlib.sha256()
    digest.update(json.dumps(manifest.get("config", {}), sort_keys=True).encode())
    for name, e in sorted(manifest["tensors"].items()):
        digest.update(json.dumps([name, e["kind"], e["shape"], e.get("quant"), e["crc32"]], sort_keys=True).encode())
    return digest.hexdigest()


def _atomic_write(path: Path, text: str) -> None:
    """Replace PATH with TEXT through a temporary beside it; a failed write (disk full) leaves PATH as it was."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_DATA_FILE = re.compile(r"dense\.bin|experts-\d{5}\.bin")


def _is_temp(name: str) -> bool:
    """A temporary file of an atomic write in the partial folder (ours, or `engine.atomic`'s)."""
    return name.startswith(".") and name.endswith(".tmp")


def _holds_no_work(partial: Path) -> bool:
    """Whether a partial folder has nothing but temporaries (the run stopped before its key was written)."""
    return all(_is_temp(name) for name in os.listdir(partial))


def _read_key(key_path: Path, partial: Path) -> Any:
    """The resume key an interrupted conversion wrote; ModelFormatError if it is missing or unreadable."""
    try:
        return json.loads(key_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        raise ModelFormatError(f"{partial} holds an interrupted conversion whose key ({RESUME_KEY}) is missing or "
                               f"unreadable: remove {partial} to start over") from None


def _inside(e: TensorEntry, x: ExpertExtent) -> bool:
    return e.file == x.file and x.offset <= e.offset and e.offset + e.length <= x.offset + x.length


def _span_intact(folder: Path, sizes: Mapping[str, int], fname: Any, offset: Any, length: Any, crc: Any) -> bool:
    """Whether a journaled span names a data file, lies inside it and matches its CRC-32."""
    if not (isinstance(fname, str) and _DATA_FILE.fullmatch(fname)) or fname not in sizes:
        return False
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length, crc)):
        return False
    if offset + length > sizes[fname]:
        return False
    with open(folder / fname, "rb") as f:
        return _crc_file_range(f, folder / fname, offset, length) == crc


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
        """Read and check the manifest (its shape, and its model hash: an edit is refused), map the data files,
        verify sizes and checksums.

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
        except RecursionError:
            raise corrupt(mpath, "nested too deeply to be a manifest") from None
        if not isinstance(manifest, dict):
            raise corrupt(mpath, f"the manifest is a JSON {type(manifest).__name__}, expected an object")
        if manifest.get("format") != FORMAT:
            raise ModelFormatError(f"{mpath}: not a Colibri container manifest; convert the model with `colibri convert`")
        version = manifest.get("version")
        if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
            raise ModelFormatError(
                f"{mpath}: container format version {version} is newer than this Colibri reads ({VERSION}); "
                "upgrade Colibri, or convert the model again with this version"
            )
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise corrupt(mpath, f"format version {version!r} is not a version number")
        check_manifest(manifest, mpath)   # its shape first: the hash and the entries below read it
        if model_hash(manifest) != manifest["model_hash"]:
            raise corrupt(mpath, "the manifest does not match its model hash (it was edited or damaged after "
                                 "conversion)")
        entries = {n: TensorEntry.from_json(e) for n, e in manifest["tensors"].items()}
        extents = {(x["layer"], x["expert"]): ExpertExtent.from_json(x) for x in manifest.get("experts", [])}
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

    def verify_extents(self) -> None:
        """Check every expert extent's CRC-32 (what a streaming store checks on each read, padding included)."""
        for x in self.extents.values():
            crc = zlib.crc32(memoryview(self.maps[x.file][x.offset : x.offset + x.length]))
            self.drop_pages(x.file, x.offset, x.length)     # checked once: memory stays bounded by the budget
            if crc != x.crc32:
                raise ModelFormatError(
                    f"{Path(self.path) / x.file}: checksum mismatch in the extent of layer {x.layer} expert "
                    f"{x.expert}; the container is corrupt: convert the model again with `colibri convert`"
                )

    def drop_pages(self, fname: str, offset: int, length: int) -> None:
        """Give back the mapped pages (and page cache) of a byte range of data file `fname` read once; views stay
        valid (a later read faults the pages in again)."""
        release_range(np_map(self.maps[fname]), Path(self.path) / fname, offset, length)

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
        """A float32 array (a view for f32, a widened copy for f16/bf16, whose mapped pages are then released from
        this process) or a quantized tensor whose arrays are views of the map."""
        e = self.entries[name]
        out = tensor_from_span(e, self.maps[e.file][e.offset : e.offset + e.length])
        if e.kind in ("f16", "bf16"):
            release_range(np_map(self.maps[e.file]), None, e.offset, e.length)
        return out


def tensor_from_span(e: TensorEntry, span: np.ndarray):
    """The tensor `e` describes over its bytes `span` (uint8): views for f32 and quantized, widened f16/bf16."""
    if e.kind == "quant":
        from engine.quant import QuantizedTensor
        from engine.quant.published import PUBLISHED_KINDS

        buffers = {}
        for key, (off, nbytes, dtype, shape) in e.buffers.items():
            view = np.asarray(span[off : off + nbytes]).view(np.dtype(dtype)).reshape(shape)
            view.flags.writeable = False
            buffers[key] = view
        try:
            if e.quant.get("kind") in PUBLISHED_KINDS:          # FP8 / MXFP4 / K-quants kept as published
                return PUBLISHED_KINDS[e.quant["kind"]].from_buffers(e.quant, buffers)
            return QuantizedTensor.from_buffers(e.quant, buffers)
        except (KeyError, TypeError, ValueError) as exc:   # a format the buffers do not hold (bits, group ...)
            raise corrupt(e.file, f"tensor {e.name}: {exc}") from None
    raw = np.asarray(span[: e.length]).view(_PLAIN[e.kind]).reshape(e.shape)
    if e.kind == "f32":
        raw = raw.view()
        raw.flags.writeable = False
        return raw
    out = bf16_to_f32(raw) if e.kind == "bf16" else raw.astype(np.float32)
    out.flags.writeable = False
    return out
