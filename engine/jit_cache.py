"""numba's on-disk cache for the engine's kernels, stamped with every engine source, not one file.

numba keys a cached function on the content of its own file. The engine's kernels link functions
from other files (every one links engine/kernels/simd.py; the fused decode step links the matmul
kernels), so after an edit or an upgrade that changed only a linked file numba would load the old
machine code and run it: wrong answers, silently (it happened: the fused step kept decoding a
new 4-bit layout with the old 2-bit loop). `install()` puts locators first in numba's list that
take the engine's functions only, keep numba's choice of directory, and stamp each function with a
digest of all the engine's Python sources: any change recompiles every engine kernel once.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from numba.core import caching

ROOT = Path(__file__).resolve().parent


def sources_digest(root: Path = ROOT) -> str:
    """sha256 over the relative path and bytes of every .py file under root, in sorted order."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def _digest() -> str:
    from engine import __version__
    return f"{__version__}:{sources_digest()}"


def _inside(py_file: str) -> bool:
    try:
        return Path(py_file).resolve().is_relative_to(ROOT)
    except (OSError, ValueError):
        return False


class _EngineStamp:
    """Mixed in before a numba locator: engine functions only, stamped with the engine's digest."""

    def get_source_stamp(self):
        return ("colibri-engine", _digest())

    @classmethod
    def from_function(cls, py_func, py_file):
        if not _inside(py_file):
            return None
        return super().from_function(py_func, py_file)


_BASES = (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator)
LOCATORS = tuple(type(f"Engine{base.__name__}", (_EngineStamp, base), {}) for base in _BASES)


def install() -> None:
    """Put the engine locators first in numba's list (once; other packages' functions are left to numba's)."""
    classes = caching.CacheImpl._locator_classes
    if classes[:len(LOCATORS)] != list(LOCATORS):
        classes[:0] = LOCATORS
