"""Whole decoder layers of a dense model streamed from a container: the first N held, the others read per use.

A dense model larger than memory keeps its embedding, head and first `resident_layers` layers; every
other layer is read from dense.bin each time it runs, into one of `prefetch_depth + 1` page-aligned
slot buffers, while the layers before it compute: when layer i is asked for, the reads of the next
`prefetch_depth` streamed layers start (cyclically: after the last layer come the first streamed
layers of the next token). A layer's tensors are read in as few `pread`s as their layout allows
(one per contiguous run), straight into the slot, through O_DIRECT when the file system allows.
When the slots outnumber the streamed layers, each is read once and then stays.

A slot's bytes are the container's bytes (each tensor's CRC-32 checked on its layer's first read,
on the I/O thread), and the layer is built over them with the model's own builder, so streaming
never changes an answer. All bookkeeping runs on the engine thread; I/O threads only fill slots.

`io="mmap"` is the baseline: no reads, each layer built over the container's maps per use, its
pages dropped (MADV_DONTNEED) once the next layer is asked for, so RSS stays about one layer.
"""

from __future__ import annotations

import concurrent.futures as cf
import mmap
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from engine.errors import ColibriError, ModelFormatError
from engine.formats.container import Container, TensorEntry, tensor_from_span
from engine.offload.io import PAGE, IOPool, aligned_empty, round_up
from engine.offload.store_types import IO_MODES
from engine.spec import ModelSpec, MoESpec
from engine.telemetry import NULL, Telemetry
from engine.weights import TensorSource

if TYPE_CHECKING:
    from engine.models.transformer import Layer

GAP_SHARE = 10   # tensors closer than 1/GAP_SHARE of their joint range (or a page) are read together


@dataclass(frozen=True)
class LayerStats:
    """Counters since the store opened."""

    reads: int              # layers read (or mapped) from the container
    bytes_read: int         # bytes asked of the disk (mmap: at most, page faults read what is touched)
    hits: int               # layers asked for while in memory or already being read ahead
    waits: int              # layers asked for before their read had finished
    wait_seconds: float     # engine time spent in those waits


@dataclass(frozen=True)
class _Run:
    """Tensors of one layer that lie together in one file: one read."""

    file: str                                      # the container's file name
    path: str                                      # its full path
    offset: int                                    # page-aligned file offset of the read
    length: int                                    # bytes to read
    at: int                                        # page-aligned position of the read in the slot
    tensors: tuple[tuple[TensorEntry, int], ...]   # (entry, position in the slot)


@dataclass(frozen=True)
class _LayerPlan:
    """How one streamed layer is read and where its tensors land in a slot."""

    runs: tuple[_Run, ...]
    nbytes: int              # slot bytes it needs (its runs, each rounded to PAGE)
    widened: int             # float32 bytes its f16/bf16 tensors take once built (copies, not views)

    def tensors(self) -> Iterable[tuple[TensorEntry, int]]:
        """Every (entry, position in the slot)."""
        return (t for run in self.runs for t in run.tensors)


def _plan_layer(container: Container, i: int) -> _LayerPlan:
    """Group layer i's tensors into runs (by file, in offset order) and lay the runs out in a slot."""
    prefix = f"model.layers.{i}."
    entries = sorted((e for n, e in container.entries.items() if n.startswith(prefix)), key=lambda e: (e.file, e.offset))
    if not entries:
        raise ModelFormatError(f"{container.path}: layer {i} has no tensors in the container; "
                               "convert the model again with `colibri convert`")
    groups: list[list[TensorEntry]] = []
    end = 0
    for e in entries:
        if groups and groups[-1][0].file == e.file:
            start = groups[-1][0].offset
            gap = e.offset - end
            if gap <= max(PAGE, (e.offset + e.length - start) // GAP_SHARE):
                groups[-1].append(e)
                end = max(end, e.offset + e.length)
                continue
        groups.append([e])
        end = e.offset + e.length
    runs, at = [], 0
    for g in groups:
        start = g[0].offset - g[0].offset % PAGE   # O_DIRECT reads from a page boundary
        stop = max(e.offset + e.length for e in g)
        runs.append(_Run(g[0].file, str(Path(container.path) / g[0].file), start, stop - start, at,
                         tuple((e, at + e.offset - start) for e in g)))
        at += round_up(stop - start, PAGE)
    widened = sum(e.length * 2 for e in entries if e.kind in ("f16", "bf16"))
    return _LayerPlan(tuple(runs), at, widened)


def slot_bytes(container: Container, layers: Iterable[int]) -> int:
    """Bytes one layer buffer needs to hold any of `layers` as the store reads them (page-aligned runs)."""
    return max((_plan_layer(container, i).nbytes for i in layers), default=0)


class _SlotSource:
    """The tensors of one layer over its bytes in a slot (the TensorSource `build` reads)."""

    def __init__(self, path: str, plan: _LayerPlan, data: np.ndarray):
        self.path = path
        self._tensors = {e.name: (e, at) for e, at in plan.tensors()}
        self._data = data    # [slot_bytes] uint8

    def names(self) -> Iterable[str]:
        """The layer's tensor names."""
        return self._tensors.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape."""
        return self._tensors[name][0].shape

    def load(self, name: str):
        """The tensor as views of the slot (f16/bf16 widened to a float32 copy)."""
        e, at = self._tensors[name]
        return tensor_from_span(e, self._data[at : at + e.length])

    def location(self, name: str) -> str:
        """The container file holding the tensor."""
        e = self._tensors.get(name)
        return str(Path(self.path) / e[0].file) if e else self.path


class _LayerRead:
    """One layer's reads in flight: `future` completes when every run is in the slot and checked."""

    def __init__(self, n_runs: int, check: bool):
        self.future: cf.Future = cf.Future()
        self._check = check
        self._left = n_runs
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def run_done(self, run: _Run, data: np.ndarray, read: cf.Future) -> None:
        """A run's read finished (I/O thread): check its tensors, complete the layer after its last run."""
        error = None
        try:
            read.result()
            if self._check:
                for e, at in run.tensors:
                    if zlib.crc32(memoryview(data[at : at + e.length])) != e.crc32:
                        raise ModelFormatError(f"{run.path}: checksum mismatch in tensor {e.name}; the container is "
                                               "corrupt: convert the model again with `colibri convert`")
        except BaseException as exc:  # handed to the waiting engine thread
            error = exc
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._left -= 1
            last = self._left == 0
        if last:
            if self._error is not None:
                self.future.set_exception(self._error)
            else:
                self.future.set_result(None)


@dataclass
class _Slot:
    """One layer buffer and what it holds (engine thread only)."""

    data: np.ndarray                 # [slot_bytes] uint8, page-aligned
    layer: int | None = None         # the layer it holds or is reading
    read: cf.Future | None = None    # that layer's read
    built: "Layer | None" = None     # the layer built over it, once read
    ahead: bool = False              # read ahead and not yet asked for


class LayerStore:
    """Decoder layers of a dense model read from a container: the first N held, the others streamed through D+1 buffers."""

    history = None   # no usage history for layers (LoadedModel.close looks for one)

    def __init__(self, container: Container, spec: ModelSpec, resident_layers: int, prefetch_depth: int, *,
                 io_threads: int = 2, telemetry: Telemetry = NULL, direct: bool | None = None, io: str = "pread"):
        n = spec.n_layers
        if not 0 <= resident_layers <= n:
            raise ColibriError(f"--resident-layers {resident_layers}: use 0 to {n} (the model has {n} layers)")
        if prefetch_depth < 0:
            raise ColibriError(f"--prefetch-depth {prefetch_depth}: use 0 or more layers read ahead")
        if io not in IO_MODES:
            raise ColibriError(f"--io {io!r}: choose one of {', '.join(IO_MODES)}")
        if any(isinstance(layer.ffn, MoESpec) for layer in spec.layers):
            raise ColibriError(f"{container.path}: the model has routed experts: stream the experts instead (the expert "
                               "store, sized by --max-memory); --resident-layers streams whole layers of dense models")
        self.container, self.spec, self.telemetry = container, spec, telemetry
        self.resident_layers, self.prefetch_depth, self.io = resident_layers, prefetch_depth, io
        self.streamed = list(range(resident_layers, n))                 # in forward order
        self._order = {layer: k for k, layer in enumerate(self.streamed)}
        self._plans = {i: _plan_layer(container, i) for i in self.streamed}
        self.slot_bytes = max((p.nbytes for p in self._plans.values()), default=0)   # a multiple of PAGE
        self._widened = max((p.widened for p in self._plans.values()), default=0)
        # more slots than streamed layers would never fill: with that many, every layer stays after its first read
        self.n_slots = 0 if io == "mmap" or not self.streamed else min(prefetch_depth + 1, len(self.streamed))
        self._build: Callable[[int, TensorSource], Layer] | None = None
        self._verified: set[int] = set()
        self._reads = self._bytes = self._hits = self._waits = 0
        self._wait_seconds = 0.0
        self._mapped: int | None = None                                 # mmap: the layer in use
        self._closed = False
        self._pool: IOPool | None = None
        self._slots: list[_Slot] = []
        if self.n_slots:
            arena = aligned_empty(self.n_slots * self.slot_bytes)       # untouched pages cost nothing
            self._slots = [_Slot(arena[k * self.slot_bytes : (k + 1) * self.slot_bytes]) for k in range(self.n_slots)]
            self._pool = IOPool(io_threads, direct)

    # --- the LayerSource protocol ---

    def streams(self, i: int) -> bool:
        """Whether layer i is streamed rather than held."""
        return i >= self.resident_layers

    def bind(self, build: Callable[[int, TensorSource], "Layer"]) -> None:
        """The model's layer builder; starts reading the first streamed layers (they overlap the held ones)."""
        self._build = build
        for slot, j in zip(self._slots, self.streamed[: self.prefetch_depth]):   # all slots are empty yet
            self._start(slot, j, ahead=True)

    def layer(self, i: int) -> "Layer":
        """Layer i, in memory until the next call (blocking); starts reading the next `prefetch_depth` streamed layers."""
        if self._closed:
            raise RuntimeError("LayerStore.layer after close(): load the model again")
        if self._build is None:
            raise RuntimeError("LayerStore.layer before bind(): the model has not given its layer builder")
        if i not in self._plans:
            raise ValueError(f"layer {i} is not streamed (streamed: {self.resident_layers} to {self.spec.n_layers - 1})")
        if self.io == "mmap":
            return self._mapped_layer(i)
        slot = self._find(i)
        if slot is None:
            slot = self._victim(i, {i})
            self._start(slot, i, ahead=False)
        else:
            self._hits += 1
            if slot.ahead:
                slot.ahead = False
                self.telemetry.prefetch(used=1)
        self._read_ahead(i)                          # before waiting: the reads queue behind this one
        if not slot.read.done():
            self._waits += 1
            t0 = time.perf_counter()
            with self.telemetry.phase("io_wait"):
                cf.wait([slot.read])
            self._wait_seconds += time.perf_counter() - t0
        try:
            slot.read.result()
        except BaseException:
            self._empty(slot)                        # asked again, it is read again (and fails again)
            raise
        self._verified.add(i)
        if slot.built is None:
            slot.built = self._build(i, _SlotSource(self.container.path, self._plans[i], slot.data))
        return slot.built

    # --- the rest ---

    @property
    def buffer_bytes(self) -> int:
        """Memory the streamed layers take at most: the slots (with f16/bf16 widened copies); mmap: one layer's pages."""
        if self.io == "mmap":
            return self.slot_bytes + self._widened if self.streamed else 0
        return self.n_slots * (self.slot_bytes + self._widened)

    def stats(self) -> LayerStats:
        """Counters now."""
        return LayerStats(self._reads, self._bytes, self._hits, self._waits, self._wait_seconds)

    def close(self) -> None:
        """Wait for reads in flight, stop the readers and drop the buffers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        # a plain wait: close may run off the engine thread, where telemetry must not be touched
        cf.wait([slot.read for slot in self._slots if slot.read is not None])
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._mapped is not None:
            self._drop_mapped(self._mapped)
            self._mapped = None
        self._slots = []

    def __enter__(self) -> "LayerStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- slots ---

    def _find(self, i: int) -> _Slot | None:
        for slot in self._slots:
            if slot.layer == i:
                return slot
        return None

    def _read_ahead(self, i: int) -> None:
        """Start reading the next `prefetch_depth` streamed layers after i (wrapping to the next token)."""
        pos, n = self._order[i], len(self.streamed)
        window = {self.streamed[(pos + k) % n] for k in range(min(self.prefetch_depth, n - 1) + 1)}
        for k in range(1, min(self.prefetch_depth, n - 1) + 1):
            j = self.streamed[(pos + k) % n]
            if self._find(j) is None:
                self._start(self._victim(i, window), j, ahead=True)

    def _victim(self, i: int, keep: set[int]) -> _Slot:
        """A slot to read into: an empty one, else the one needed furthest from now (never one holding `keep`)."""
        pos, n = self._order[i], len(self.streamed)
        best, best_rank = None, -1
        for slot in self._slots:
            if slot.layer in keep:
                continue
            rank = n + 1 if slot.layer is None else (self._order[slot.layer] - pos) % n
            if rank > best_rank:
                best, best_rank = slot, rank
        if best is None:   # keep is never larger than the slots; this would be a bookkeeping bug
            raise RuntimeError(f"LayerStore: no slot free for a read (slots {self.n_slots}, keep {sorted(keep)})")
        if best.ahead:
            self.telemetry.prefetch(wasted=1)
        self._settle(best)
        self._empty(best)
        return best

    def _start(self, slot: _Slot, i: int, ahead: bool) -> None:
        """Read layer i into the slot (its checksums too on the first read)."""
        plan = self._plans[i]
        pending = _LayerRead(len(plan.runs), check=i not in self._verified)
        slot.layer, slot.read, slot.built, slot.ahead = i, pending.future, None, ahead
        data = slot.data
        for run in plan.runs:
            dest = data[run.at : run.at + round_up(run.length, PAGE)]
            fut = self._pool.submit(run.path, run.offset, run.length, dest)
            fut.add_done_callback(lambda read, run=run: pending.run_done(run, data, read))
            self._bytes += run.length
            self.telemetry.bytes_read(run.length)
        self._reads += 1
        if ahead:
            self.telemetry.prefetch(issued=1)

    def _settle(self, slot: _Slot) -> None:
        """Wait for the slot's read in flight, if any, before its buffer is reused or freed."""
        if slot.read is not None and not slot.read.done():
            with self.telemetry.phase("io_wait"):
                cf.wait([slot.read])

    @staticmethod
    def _empty(slot: _Slot) -> None:
        slot.layer, slot.read, slot.built, slot.ahead = None, None, None, False

    # --- mmap baseline ---

    def _mapped_layer(self, i: int) -> "Layer":
        """Layer i over the container's maps; the previous one's pages are dropped first."""
        if self._mapped is not None:
            self._drop_mapped(self._mapped)
        self._mapped = i
        plan = self._plans[i]
        if i not in self._verified:
            for e, _ in plan.tensors():
                if zlib.crc32(memoryview(self.container.maps[e.file][e.offset : e.offset + e.length])) != e.crc32:
                    raise ModelFormatError(f"{Path(self.container.path) / e.file}: checksum mismatch in tensor {e.name}; "
                                           "the container is corrupt: convert the model again with `colibri convert`")
            self._verified.add(i)
        nbytes = sum(run.length for run in plan.runs)
        self._reads += 1
        self._bytes += nbytes
        self.telemetry.bytes_read(nbytes)
        return self._build(i, self.container)

    def _drop_mapped(self, i: int) -> None:
        """Drop layer i's pages from this process (the page cache may keep them; RSS does not)."""
        for run in self._plans[i].runs:
            m = self.container.maps[run.file]
            end = min(round_up(run.offset + run.length, PAGE), len(m))
            try:
                m._mmap.madvise(mmap.MADV_DONTNEED, run.offset, end - run.offset)
            except (AttributeError, OSError, ValueError):
                pass   # no madvise here: the pages stay until the kernel reclaims them
