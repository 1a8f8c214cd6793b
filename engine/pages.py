"""Transparent huge pages for the big mappings the kernels read weights through.

A decode step streams every weight it uses once, from memory too large for any cache. On 4 KB pages
that is one page-table walk per 4 KB (two levels of them in a virtual machine); on 2 MB pages, one
per 2 MB. Linux hands out 2 MB pages where a mapping asks for them (MADV_HUGEPAGE), the page cache
included on file systems with large folios (ext4 and xfs on recent kernels). Without the advice,
decode speed varies with what the page cache happened to hold.

The advice changes where bytes sit, never which bytes: answers are the same.
"""

from __future__ import annotations

import mmap
import sys

# Linux's flag (Python exposes it only from 3.13 on): without it the kernel's overcommit check refuses a
# reservation larger than RAM plus swap (ENOMEM), though only what is written is ever committed
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)   # Linux only


def advise_huge_pages(m: mmap.mmap) -> bool:
    """Ask for 2 MB pages over the whole of `m` before its pages are touched; whether the OS took the advice
    (False where it has no such pages, or they are switched off: 4 KB pages then, as without it)."""
    if _MADV_HUGEPAGE is None:
        return False
    try:
        m.madvise(_MADV_HUGEPAGE)
    except OSError:        # EINVAL: a kernel without transparent huge pages
        return False
    return True
