"""Reading byte ranges of model files into memory buffers on a pool of reader threads.

Expert weights are read once per use and must not stay in the page cache as a second copy of
what the engine already holds, so reads go through O_DIRECT when the OS and file system allow it,
and otherwise through buffered pread followed by POSIX_FADV_DONTNEED over the range just read.
O_DIRECT wants the file offset, the length and the buffer address aligned to PAGE; `aligned_empty`
makes such buffers, and a read that cannot be aligned falls back to buffered for that one read.
"""

from __future__ import annotations

import concurrent.futures
import errno
import itertools
import mmap
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from engine.errors import ModelFormatError

PAGE = 4096

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the OS has no O_DIRECT (macOS, Windows)
_FADV_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)


READER_NICENESS = 10   # readers yield the cores to compute threads (see _reader_thread)


def _reader_thread(name: str) -> None:
    """Name a reader thread and lower its scheduling priority.

    Readers mostly wait for the disk, but a woken reader that takes a core from a numba worker
    stalls a whole parallel region, and on two cores readers at normal priority slowed streamed
    decode many times over. Lower priority lets the kernels finish their regions first (Linux:
    per-thread nice; elsewhere nothing changes).
    """
    threading.current_thread().name = name
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), READER_NICENESS)
    except (AttributeError, OSError):
        pass


def round_up(n: int, align: int) -> int:
    """n rounded up to a multiple of align."""
    return -(-n // align) * align


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def aligned_empty(nbytes: int, align: int = PAGE) -> np.ndarray:
    """A uint8 array of nbytes (rounded up to align) whose data address is a multiple of align."""
    if nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes must be >= 0, got {nbytes}")
    if align <= 0 or align & (align - 1):
        raise ValueError(f"aligned_empty: align must be a positive power of two, got {align}")
    n = round_up(nbytes, align)
    # An anonymous map is page aligned (and zero-filled, committed lazily); over-allocate only
    # for alignments coarser than a page. The returned slice's .base keeps the map alive.
    extra = align if align > mmap.PAGESIZE else 0
    raw = np.frombuffer(mmap.mmap(-1, max(n + extra, 1)), dtype=np.uint8)
    skip = -_address(raw) % align
    return raw[skip : skip + n]


@dataclass(frozen=True)
class ReadDone:
    """A finished read: how many bytes, how long it took, and whether O_DIRECT was used."""

    nbytes: int  # the length asked for (an O_DIRECT read may have transferred up to PAGE - 1 more)
    seconds: float  # wall time of the read on its reader thread
    direct: bool


@dataclass(frozen=True)
class IOStats:
    """Totals over an IOPool's finished reads."""

    reads: int
    bytes: int  # sum of the lengths asked for
    busy_seconds: float  # sum of the reads' own times (> wall time when threads overlap)
    direct_reads: int


class DirectIOUnavailable(OSError):
    """O_DIRECT was required (IOPool(direct=True)) but the OS or file system refuses it for a file."""


@dataclass
class _OpenFile:
    """The cached descriptors of one path: always a buffered fd, and an O_DIRECT fd when allowed."""

    buffered: int
    direct: int | None


class IOPool:
    """Reader threads that pread byte ranges of files into caller-given buffers."""

    def __init__(self, threads: int = 2, direct: bool | None = None):
        if threads < 1:
            raise ValueError(f"IOPool needs at least one reader thread, got threads={threads}")
        if direct is True and not _O_DIRECT:
            raise DirectIOUnavailable(errno.EINVAL, "IOPool(direct=True): this OS has no O_DIRECT; use direct=None")
        self._direct = direct  # None: when allowed; True: required; False: never
        ids = itertools.count()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads,
            initializer=lambda: _reader_thread(f"colibri-io-{next(ids)}"),
        )
        # start every reader now (the executor would spawn them on demand, mid-generation): each holds a
        # barrier, so every submit finds no idle thread and starts one
        started = threading.Barrier(threads + 1)
        for _ in range(threads):
            self._executor.submit(started.wait)
        started.wait()
        self._files: dict[str, _OpenFile] = {}
        self._retired: list[int] = []  # O_DIRECT fds given up on; closed only at close() as a reader may hold one
        self._files_lock = threading.Lock()  # guards _files, _retired and _probe
        self._probe: np.ndarray | None = None  # one aligned page for O_DIRECT probe reads
        self._stats_lock = threading.Lock()
        self._reads = self._bytes = self._direct_reads = 0
        self._busy = 0.0
        self._closed = False

    # -- public -------------------------------------------------------------------------------

    def submit(self, path: str, offset: int, length: int, dest: np.ndarray) -> concurrent.futures.Future[ReadDone]:
        """Read file bytes [offset, offset+length) into dest[:length] on a reader thread."""
        flat = self._check("submit", path, offset, length, dest)
        return self._executor.submit(self._read, os.fspath(path), offset, length, flat)

    def read_here(self, path: str, offset: int, length: int, dest: np.ndarray) -> concurrent.futures.Future[ReadDone]:
        """The same read on the calling thread, as a future that is done (with the read's error, if any) when this
        returns: for a thread that would only wait for it, it saves a reader thread's wake-up (slow on busy
        cores)."""
        flat = self._check("read_here", path, offset, length, dest)
        fut: concurrent.futures.Future[ReadDone] = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()
        try:
            fut.set_result(self._read(os.fspath(path), offset, length, flat))
        except BaseException as exc:  # handed over in the future, as a reader thread's would be
            fut.set_exception(exc)
        return fut

    def _check(self, name: str, path: str, offset: int, length: int, dest: np.ndarray) -> np.ndarray:
        """dest as a flat view, once the read's arguments hold (else ValueError, RuntimeError after close)."""
        if self._closed:
            raise RuntimeError(f"IOPool.{name} after close(): open a new IOPool")
        if offset < 0 or length < 0:
            raise ValueError(f"{path}: offset and length must be >= 0, got offset={offset} length={length}")
        if not isinstance(dest, np.ndarray) or dest.dtype != np.uint8 or not dest.flags.c_contiguous:
            raise ValueError("IOPool: dest must be a C-contiguous uint8 numpy array")
        if not dest.flags.writeable:
            raise ValueError("IOPool: dest is read-only")
        flat = dest.reshape(-1)  # [dest.size] view, no copy (contiguous)
        if flat.size < length:
            raise ValueError(f"{path}: dest holds {flat.size} bytes, the read needs {length}")
        return flat

    def read(self, path: str, offset: int, length: int, dest: np.ndarray) -> ReadDone:
        """submit(...).result(): read on a reader thread and wait for it."""
        return self.submit(path, offset, length, dest).result()

    @property
    def stats(self) -> IOStats:
        """A snapshot of the totals so far."""
        with self._stats_lock:
            return IOStats(self._reads, self._bytes, self._busy, self._direct_reads)

    def close(self) -> None:
        """Finish queued reads, join the threads and close every cached fd (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        with self._files_lock:
            for f in self._files.values():
                os.close(f.buffered)
                if f.direct is not None:
                    os.close(f.direct)
            self._files.clear()
            for fd in self._retired:
                os.close(fd)
            self._retired.clear()

    def __enter__(self) -> IOPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reader threads -----------------------------------------------------------------------

    def _read(self, path: str, offset: int, length: int, dest: np.ndarray) -> ReadDone:
        t0 = time.perf_counter()
        f = self._open(path)
        dfd = f.direct  # read once: another reader may give up O_DIRECT on this file meanwhile
        got, direct = 0, False
        if length:
            want = round_up(length, PAGE)
            if dfd is not None and offset % PAGE == 0 and _address(dest) % PAGE == 0 and dest.size >= want:
                try:
                    got, direct = _pread_all(dfd, dest, offset, want, direct=True), True
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self._refuse(path, f"at a read of {want} bytes at offset {offset}")
                    self._forget_direct(path)  # refused at read time after all: buffered from now on
            if not direct:
                got = _pread_all(f.buffered, dest, offset, length, direct=False)
                if self._direct is not False and _FADV_DONTNEED is not None:
                    start = offset - offset % PAGE  # whole pages: the kernel skips partial ones
                    os.posix_fadvise(f.buffered, start, round_up(offset + got, PAGE) - start, _FADV_DONTNEED)
        if got < length:
            size = os.fstat(f.buffered).st_size
            raise ModelFormatError(
                f"{path}: reading {length} bytes at offset {offset} got only {got}: the file ends at "
                f"byte {size}, so it is truncated; re-convert the model (`colibri convert`)"
            )
        seconds = time.perf_counter() - t0
        with self._stats_lock:
            self._reads += 1
            self._bytes += length
            self._busy += seconds
            self._direct_reads += direct
        return ReadDone(length, seconds, direct)

    def _open(self, path: str) -> _OpenFile:
        """The cached fds of path, opening (and probing O_DIRECT on) it the first time."""
        with self._files_lock:
            f = self._files.get(path)
            if f is None:
                buffered = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                try:
                    direct = self._open_direct(path) if self._direct is not False and _O_DIRECT else None
                except BaseException:
                    os.close(buffered)
                    raise
                f = self._files[path] = _OpenFile(buffered, direct)
            return f

    def _open_direct(self, path: str) -> int | None:
        """An O_DIRECT fd for path after one probe read, or None (raising if direct=True)."""
        # Some file systems refuse O_DIRECT at open, others only at the first read: probe both.
        try:
            fd = os.open(path, os.O_RDONLY | _O_DIRECT | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return self._refuse(path, "at open")
        try:
            if self._probe is None:
                self._probe = aligned_empty(PAGE)
            os.preadv(fd, [memoryview(self._probe)], 0)
        except OSError as e:
            os.close(fd)
            if e.errno != errno.EINVAL:
                raise
            return self._refuse(path, "at read")
        return fd

    def _refuse(self, path: str, when: str) -> None:
        """Raise DirectIOUnavailable naming path if O_DIRECT is required; else None (read buffered)."""
        if self._direct is True:
            raise DirectIOUnavailable(
                errno.EINVAL, f"the file system refuses O_DIRECT {when}; use IOPool(direct=None) to read buffered", path
            )
        return None

    def _forget_direct(self, path: str) -> None:
        with self._files_lock:
            f = self._files.get(path)
            if f is not None and f.direct is not None:
                self._retired.append(f.direct)
                f.direct = None


def _pread_all(fd: int, dest: np.ndarray, offset: int, n: int, direct: bool) -> int:
    """pread up to n bytes at offset into dest[:n], looping on short reads; the count read (< n only at EOF)."""
    view = memoryview(dest)[:n]
    got = 0
    while got < n:
        k = os.preadv(fd, [view[got:]], offset + got)  # releases the GIL
        if k == 0:
            break
        got += k
        if direct and got % PAGE:  # O_DIRECT stops short off a page only at end of file
            break
    return got


def drop_file_cache(path: str) -> None:
    """Ask the kernel to drop the page cache of one file (posix_fadvise DONTNEED over the whole file)."""
    if _FADV_DONTNEED is None:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, _FADV_DONTNEED)  # length 0: to the end of the file
    finally:
        os.close(fd)


def measure_read_bandwidth(path: str, nbytes: int = 256 << 20, block: int = 1 << 20, threads: int = 2) -> float:
    """Bytes per second of cold reads of (up to) the first nbytes of path in `block` pieces on `threads` threads,
    page cache dropped first (the disk roofline for offloaded experts)."""
    size = min(nbytes, os.path.getsize(path))
    if size <= 0 or block <= 0:
        raise ValueError(
            f"{path}: nothing to measure (file size {os.path.getsize(path)}, nbytes {nbytes}, block {block})"
        )
    window = 2 * threads  # reads in flight; each has its own buffer so no two write the same memory
    buffers = [aligned_empty(block) for _ in range(window)]
    drop_file_cache(path)
    with IOPool(threads) as pool:
        pending: list[concurrent.futures.Future[ReadDone]] = []
        t0 = time.perf_counter()
        for i, offset in enumerate(range(0, size, block)):
            if len(pending) == window:
                pending.pop(0).result()  # frees buffer i % window
            pending.append(pool.submit(path, offset, min(block, size - offset), buffers[i % window]))
        for fut in pending:
            fut.result()
        seconds = time.perf_counter() - t0
    return size / seconds
