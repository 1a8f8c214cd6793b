"""2 MB pages where the kernels read weights: a resident model's files, a streamed model's dense file and its
expert slots; not the expert files a streamed model reads by other means (the `--io mmap` baseline's 4 KB faults)."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.kv import KVCache
from engine.loader import OffloadOptions, load_model
from engine.offload.store import StoreSettings
from engine.pages import advise_huge_pages
from support.offload import load_streamed
from support.reference import build_checkpoint


def _huge_pages_work() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    probe = mmap.mmap(-1, 1 << 21)
    try:
        return advise_huge_pages(probe)
    finally:
        probe.close()


pytestmark = pytest.mark.skipif(not _huge_pages_work(), reason="this kernel has no transparent huge pages")


def _mappings() -> list[tuple[int, int, str, int, set[str]]]:
    """This process's mappings from /proc/self/smaps: (start, end, path, bytes in memory (Rss), VmFlags)."""
    out, head, rss = [], None, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(None, 5)
        if "-" in first[0] and len(first) >= 5 and not first[0].endswith(":"):
            lo, hi = (int(v, 16) for v in first[0].split("-"))
            head = (lo, hi, first[5] if len(first) > 5 else "")
        elif line.startswith("Rss:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("VmFlags:") and head is not None:
            out.append((*head, rss, set(line.split()[1:])))
    return out


def _file_flags(path: Path) -> set[str]:
    found = [flags for lo, hi, p, rss, flags in _mappings() if p == str(path.resolve())]
    assert found, f"{path} is not mapped"
    return set.union(*found)


def _at(address: int) -> tuple[int, int, str, int, set[str]]:
    found = [m for m in _mappings() if m[0] <= address < m[1]]
    assert found, f"nothing mapped at {address:#x}"
    return found[0]


def _rss_at(address: int) -> int:
    """Bytes of the mapping holding `address` that are in memory."""
    return _at(address)[3]


def _flags_at(address: int) -> set[str]:
    return _at(address)[4]


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    src = build_checkpoint(tmp_path_factory.mktemp("src"), "mixtral", num_local_experts=4, num_experts_per_tok=2,
                           num_hidden_layers=2)
    return Path(convert(src, tmp_path_factory.mktemp("c") / "moe", ConvertSettings(bits=4), log=lambda m: None))


def test_a_resident_model_maps_every_file_on_huge_pages(container):
    loaded = load_model(container)
    try:
        assert "hg" in _file_flags(container / "dense.bin")
        assert "hg" in _file_flags(container / "experts-00000.bin")
    finally:
        loaded.close()


def test_a_streamed_model_holds_its_dense_file_and_expert_slots_on_huge_pages(container):
    loaded = load_model(container, offload=OffloadOptions(StoreSettings(capacity=1 << 22)))
    try:
        assert "hg" in _file_flags(container / "dense.bin")
        assert "hg" not in _file_flags(container / "experts-00000.bin")   # read into slots, never through the map
        arena = loaded.store.slots.arena
        assert "hg" in _flags_at(arena.__array_interface__["data"][0])
        logits = loaded.model.forward([3, 5, 7], KVCache(loaded.spec, 8))
        assert np.isfinite(logits).all()
    finally:
        loaded.close()


def test_the_mmap_baseline_reads_experts_on_small_pages(container):
    loaded = load_model(container, offload=OffloadOptions(StoreSettings(capacity=1 << 22, io="mmap")))
    try:
        assert "hg" in _file_flags(container / "dense.bin")
        assert "hg" not in _file_flags(container / "experts-00000.bin")
    finally:
        loaded.close()



def test_the_expert_cache_takes_its_pages_at_load_and_when_it_grows(container):
    loaded = load_streamed(container, 3)
    try:
        store = loaded.store
        slot = store.slot_bytes
        address = store.slots.arena.__array_interface__["data"][0]
        assert not store.built                                   # nothing read yet
        assert _rss_at(address) >= 3 * slot                      # yet the cache's pages are in
        store.set_capacity(6 * slot)
        assert _rss_at(address) >= 6 * slot
        store.set_capacity(2 * slot)                             # a shrink hands pages back
        assert _rss_at(address) < 6 * slot
    finally:
        loaded.close()
