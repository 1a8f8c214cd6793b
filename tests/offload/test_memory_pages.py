"""Readers give back the mapped pages of tensors read once: the map's resident bytes (from /proc/self/smaps) fall,
and the tensor's values read again after the release are the same."""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.formats.gguf_model import GGUFModel
from engine.formats.hf import SafetensorsFolder
from support.gguf_writer import write_gguf
from support.rss import mixtral_config, write_bf16_checkpoint
from support.tiny_checkpoint import tiny_container, write_tiny

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def mapped_kib(path: Path) -> int:
    """KiB of `path`'s maps resident in this process."""
    total, inside, name = 0, False, str(Path(path).resolve())
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                inside = head[-1] == name
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


def test_safetensors_drop_pages_releases_and_keeps_values(tmp_path):
    write_bf16_checkpoint(tmp_path, mixtral_config(2, 8, ffn=1024))
    src = SafetensorsFolder(tmp_path)
    path = tmp_path / "model.safetensors"
    names = [n for n in src.names() if ".experts." in n]
    before = {n: src.raw(n).copy() for n in names}            # touches every expert page
    touched = mapped_kib(path)
    assert touched > 8_000
    for n in names:
        src.drop_pages(n)
    assert mapped_kib(path) < touched - 8_000
    for n in names:
        np.testing.assert_array_equal(src.raw(n), before[n])


def test_gguf_expert_stack_released_after_its_last_expert(tmp_path):
    cfg = mixtral_config(1, 8, hidden=128, ffn=1024) | {"rope_parameters": {"rope_theta": 1e6}}
    write_tiny(tmp_path / "hf", cfg)
    from safetensors.numpy import load_file

    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", cfg, load_file(tmp_path / "hf" / "model.safetensors"),
               {"ffn_": gguf.GGMLQuantizationType.Q8_0})
    model = GGUFModel(path, quantized=False)
    names = [f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight" for e in range(8)]
    first = [model.load(n).copy() for n in names]
    stack = "blk.0.ffn_gate_exps.weight"
    assert stack in model._cache                              # kept for slicing while experts are left
    int(np.asarray(model._tensors[stack].data).sum())         # a reader touching the stored stack
    touched = mapped_kib(path)
    for n in names[:-1]:
        model.drop_pages(n)
    assert stack in model._cache and mapped_kib(path) == touched
    model.drop_pages(names[-1])
    assert stack not in model._cache
    assert mapped_kib(path) < touched - 1_000
    for n, w in zip(names, first):
        np.testing.assert_array_equal(model.load(n), w)


def test_container_verify_extents_leaves_experts_unmapped(tmp_path):
    write_bf16_checkpoint(tmp_path / "hf", mixtral_config(2, 8, ffn=1024))
    from engine.formats.container import Container

    out = tiny_container(tmp_path / "hf", tmp_path / "q4")
    c = Container.open(out, verify_experts=False)
    files = {Path(out) / f for f in c.expert_files}
    size = sum(f.stat().st_size for f in files)
    assert size > 4_000_000
    for m in (c.maps[f.name] for f in files):                 # the measure sees pages read through the map
        zlib.crc32(memoryview(m))
    assert sum(mapped_kib(f) for f in files) * 1024 > size / 2
    c.verify_extents()                                        # reads every extent through the map, then releases
    assert sum(mapped_kib(f) for f in files) * 1024 < size / 4


def test_widened_copies_leave_the_stored_pages_unmapped(tmp_path):
    size = write_bf16_checkpoint(tmp_path, mixtral_config(2, 8, ffn=1024))
    src = SafetensorsFolder(tmp_path)
    path = tmp_path / "model.safetensors"
    raw = [src.raw(n).copy() for n in src.names()]             # the measure sees the pages a read maps
    assert mapped_kib(path) * 1024 > size / 2
    widened = {n: src.load(n) for n in src.names()}           # bf16 -> float32 copies
    assert mapped_kib(path) * 1024 < size / 10
    for r, w in zip(raw, widened.values()):
        np.testing.assert_array_equal((r.astype(np.uint32) << 16).view(np.float32), w)
