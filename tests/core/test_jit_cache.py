"""The engine's numba cache entries are stamped with every source a kernel can reach (engine/jit_cache.py): a
kernel is never loaded from the disk cache with stale code linked from another file, and an edit that no
kernel can see keeps the cache."""

from __future__ import annotations

import shutil

from numba import njit

from engine import jit_cache
from engine.fused import kernel as fused_kernel
from engine.kernels import matmul as kernels


def test_engine_kernels_are_stamped_with_every_engine_source():
    for kernel in (kernels.run_items, fused_kernel.decode_step):
        locator = kernel._cache._impl.locator
        assert isinstance(locator, jit_cache.LOCATORS), type(locator)
        assert locator.get_source_stamp() == ("colibri-engine", jit_cache._digest())


def test_the_digest_changes_with_any_kernel_source(tmp_path):
    tree = tmp_path / "engine"
    shutil.copytree(jit_cache.ROOT, tree, ignore=shutil.ignore_patterns("__pycache__"))
    before = jit_cache.sources_digest(tree)
    assert before == jit_cache.sources_digest(jit_cache.ROOT)
    simd = tree / "kernels" / "simd.py"                # linked by every kernel, cached in none of its own
    simd.write_text(simd.read_text() + "\n# an edit\n")
    assert jit_cache.sources_digest(tree) != before


def test_the_digest_ignores_files_no_kernel_imports(tmp_path):
    tree = tmp_path / "engine"
    shutil.copytree(jit_cache.ROOT, tree, ignore=shutil.ignore_patterns("__pycache__"))
    before = jit_cache.sources_digest(tree)
    loader = tree / "loader.py"
    loader.write_text(loader.read_text() + "\n# an edit\n")
    assert jit_cache.sources_digest(tree) == before
    # ... until a kernel source imports it, however indirectly (here: through a relative import)
    layout = tree / "kernels" / "layout.py"
    layout.write_text(layout.read_text() + "\n\ndef _late():\n    from .. import loader  # noqa: F401\n")
    assert (tree / "loader.py") in jit_cache.kernel_sources(tree)


def test_every_file_that_compiles_with_numba_is_a_kernel_source():
    sources = set(jit_cache.kernel_sources())
    for path in jit_cache.ROOT.rglob("*.py"):
        text = path.read_text()
        if "@njit" in text or "@numba.njit" in text or "@intrinsic" in text or "@register_model" in text:
            assert path in sources, path
    for needed in ("kernels/simd.py", "kernels/matmul.py", "fused/kernel.py", "quant/search.py", "fused/post.py"):
        assert jit_cache.ROOT / needed in sources, needed


@njit(cache=True)
def _outside(x):
    return x + 1


def test_functions_outside_the_engine_keep_numbas_locators():
    assert _outside(1) == 2
    assert not isinstance(_outside._cache._impl.locator, jit_cache.LOCATORS)
