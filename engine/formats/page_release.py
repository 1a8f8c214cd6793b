"""Giving back the pages of a memory-mapped weight file once its bytes have been used.

A read-only map of a checkpoint is cheap to open, but every page a reader touches stays mapped
into the process (its RSS, as RssFile) and in the page cache until the map is closed: converting
a 14 GB checkpoint tensor by tensor would end with 14 GB of RSS although the work needs a few
hundred MB. `release_range` undoes that for one byte range: MADV_DONTNEED unmaps the pages from
this process (a later read of a private read-only file map faults them in again from the file, so
it changes speed, never bytes) and POSIX_FADV_DONTNEED asks the kernel to evict them from the
page cache (pages another process still maps stay).
"""

from __future__ import annotations

import mmap
import os
from typing import Protocol, runtime_checkable

PAGE = mmap.PAGESIZE


@runtime_checkable
class PageReleasing(Protocol):
    """A tensor source that can give back the mapped pages of a tensor a reader has used up."""

    def drop_pages(self, name: str) -> None:
        """Release the pages under tensor `name`; views of it stay valid."""


def release_range(m: mmap.mmap | None, path: str | os.PathLike | None, offset: int, length: int) -> None:
    """Release bytes [offset, offset + length) of the map `m` of the file `path` (either may be None).

    The pages covering the range go, its first and last included (a neighbour still reading a shared
    page faults it in again: a page of extra I/O, never other bytes). Failures are ignored: where the OS
    offers neither call, memory stays as it would without this.
    """
    start = offset // PAGE * PAGE
    end = -(-(offset + length) // PAGE) * PAGE
    if m is not None:
        end_map = min(end, len(m))
        if end_map > start:
            try:
                m.madvise(mmap.MADV_DONTNEED, start, end_map - start)
            except (AttributeError, OSError, ValueError):   # no madvise (not Linux), or a closed map
                pass
    if path is not None and end > start and hasattr(os, "posix_fadvise"):
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return
        try:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def np_map(a) -> mmap.mmap | None:
    """The mmap object under a numpy.memmap opened at offset 0 (None for an in-memory array)."""
    m = getattr(a, "_mmap", None)
    return m if isinstance(m, mmap.mmap) else None
