"""numba's on-disk cache for the engine's kernels, stamped with every source a kernel can reach, not one file.

numba keys a cached function on the content of its own file. The engine's kernels link functions
from other files (every one links engine/kernels/simd.py; the fused decode step links the matmul
kernels), so after an edit or an upgrade that changed only a linked file numba would load the old
machine code and run it: wrong answers, silently (it happened: the fused step kept decoding a
new 4-bit layout with the old 2-bit loop). `install()` puts locators first in numba's list that
take the engine's functions only, keep numba's choice of directory, and stamp each function with a
digest of the kernel sources: every engine file that compiles with numba, and every engine file
those import, at any depth. A change to any of them recompiles every engine kernel once; a change
elsewhere (the tokenizer, the loader, the formats) keeps the cache.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

from numba.core import caching

ROOT = Path(__file__).resolve().parent


# names whose import makes a file a kernel source: numba's compilers and its extension points
_COMPILING = {"njit", "jit", "vectorize", "guvectorize", "cfunc", "intrinsic", "overload", "register_jitable",
              "register_model", "generated_jit"}


def _module_file(root: Path, module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != root.name:
        return None
    base = root.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _scan(root: Path, path: Path) -> tuple[bool, set[Path]]:
    """Whether `path` compiles with numba, and the engine files it imports (anywhere in it, functions too)."""
    tree = ast.parse(path.read_bytes())
    compiles, imports = False, set()
    package = path.relative_to(root.parent).with_suffix("").parts[:-1]     # __init__.py: its own package
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                module = ".".join(package[:len(package) - node.level + 1] + ((node.module,) if node.module else ()))
            else:
                module = node.module or ""
            if module.split(".")[0] == "numba" and any(a.name in _COMPILING for a in node.names):
                compiles = True
            for candidate in [module] + [f"{module}.{a.name}" for a in node.names]:
                found = _module_file(root, candidate)
                if found is not None:
                    imports.add(found)
        elif isinstance(node, ast.Import):
            for a in node.names:
                found = _module_file(root, a.name)
                if found is not None:
                    imports.add(found)
        elif isinstance(node, ast.Attribute) and node.attr in _COMPILING and \
                isinstance(node.value, ast.Name) and node.value.id == "numba":
            compiles = True
    return compiles, imports


def kernel_sources(root: Path = ROOT) -> list[Path]:
    """The files a cached kernel can depend on: those that compile with numba and, at any depth, the
    engine files they import; this module and the package's version come along."""
    files = set(root.rglob("*.py"))
    scanned: dict[Path, tuple[bool, set[Path]]] = {}

    def scan(path: Path) -> tuple[bool, set[Path]]:
        if path not in scanned:
            scanned[path] = _scan(root, path)
        return scanned[path]
    # parsing is most of the cost (about 1 s for every engine file at each start): only a file that names numba
    # can compile with it, and the others are parsed only when a kernel source imports them
    todo = [path for path in files if b"numba" in path.read_bytes() and scan(path)[0]]
    todo += [root / "__init__.py", root / "jit_cache.py"]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen or path not in files:
            continue
        seen.add(path)
        todo.extend(scan(path)[1])
    return sorted(seen)


def sources_digest(root: Path = ROOT) -> str:
    """sha256 over the relative path and bytes of every kernel source under root (`kernel_sources`), in order."""
    h = hashlib.sha256()
    for path in kernel_sources(root):
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
