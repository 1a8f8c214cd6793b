"""The engine's numba cache entries are stamped with all the engine's sources (engine/jit_cache.py): a kernel
is never loaded from the disk cache with stale code linked from another file."""

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


def test_the_digest_changes_with_any_engine_file(tmp_path):
    tree = tmp_path / "engine"
    shutil.copytree(jit_cache.ROOT, tree, ignore=shutil.ignore_patterns("__pycache__"))
    before = jit_cache.sources_digest(tree)
    assert before == jit_cache.sources_digest(jit_cache.ROOT)
    simd = tree / "kernels" / "simd.py"                # linked by every kernel, cached in none of its own
    simd.write_text(simd.read_text() + "\n# an edit\n")
    assert jit_cache.sources_digest(tree) != before


@njit(cache=True)
def _outside(x):
    return x + 1


def test_functions_outside_the_engine_keep_numbas_locators():
    assert _outside(1) == 2
    assert not isinstance(_outside._cache._impl.locator, jit_cache.LOCATORS)
