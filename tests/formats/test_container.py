"""The Colibri container: layout, checksums, refusal of damaged or newer files, resumable writing."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from engine.errors import ModelFormatError
from engine.formats.container import EXTENT_ALIGN, MANIFEST, Container, ContainerWriter


def _write(out, interrupt_after=None, key=None, sync_bytes=0, close=False):
    rng = np.random.default_rng(0)
    dense = {f"d{i}": rng.standard_normal((8, 16)).astype(np.float32) for i in range(3)}
    experts = {(layer, e): {f"l{layer}.e{e}.{p}": rng.standard_normal((4, 16)).astype(np.float32) for p in "gud"}
               for layer in range(2) for e in range(3)}
    w = ContainerWriter(out, key or {"source": "test"})
    w.sync_bytes = sync_bytes
    written = 0
    for name, t in dense.items():
        if not w.has(name):
            if interrupt_after is not None and written == interrupt_after:
                if close:
                    w.close()
                raise KeyboardInterrupt
            w.add_dense(name, t, "bf16" if name == "d2" else "f32")
            written += 1
    for (layer, e), ts in experts.items():
        if not w.has_expert(layer, e):
            if interrupt_after is not None and written == interrupt_after:
                if close:
                    w.close()
                raise KeyboardInterrupt
            w.add_expert(layer, e, ts, {n: "f16" for n in ts})
            written += 1
    return w.finish({"config": {"architectures": ["X"]}}), dense, experts, w


def test_roundtrip_layout_and_views(tmp_path):
    out, dense, experts, _ = _write(tmp_path / "m")
    c = Container.open(out)
    assert np.array_equal(c.load("d0"), dense["d0"])
    assert not c.load("d0").flags.writeable and np.shares_memory(c.load("d0"), c.maps["dense.bin"])
    assert np.abs(c.load("d2") - dense["d2"]).max() <= np.abs(dense["d2"]).max() * 2**-8  # bf16 rounding
    assert np.array_equal(c.load("l1.e2.u"), experts[(1, 2)]["l1.e2.u"].astype(np.float16).astype(np.float32))
    for (layer, e), x in c.extents.items():
        assert x.offset % EXTENT_ALIGN == 0 and x.length % EXTENT_ALIGN == 0
        for name in x.tensors:  # each expert's tensors lie inside its one extent
            t = c.entries[name]
            assert x.offset <= t.offset and t.offset + t.length <= x.offset + x.length
    assert len(c.model_hash) == 64 and not (tmp_path / "m.partial").exists()


def test_interrupted_write_resumes_to_the_same_container(tmp_path):
    whole, *_ = _write(tmp_path / "whole")
    for stop in (1, 4, 7):
        out = tmp_path / f"resumed{stop}"
        with pytest.raises(KeyboardInterrupt):
            _write(out, interrupt_after=stop)
        assert not out.exists() and (tmp_path / f"resumed{stop}.partial").is_dir()
        # garbage after the last journaled tensor (a write cut short) is discarded on resume
        with open(tmp_path / f"resumed{stop}.partial" / "dense.bin", "ab") as f:
            f.write(b"\xff" * 100)
        done, *_, writer = _write(out)
        assert writer.resumed == stop
        a, b = Container.open(whole), Container.open(done)
        assert a.model_hash == b.model_hash
        for name in a.entries:
            assert np.array_equal(a.load(name), b.load(name))


def test_extent_checksums_match_the_bytes_on_disk(tmp_path):
    out, *_ = _write(tmp_path / "m")
    c = Container.open(out)
    for x in c.extents.values():       # computed while writing: must equal a read-back of the extent
        data = (out / x.file).read_bytes()[x.offset : x.offset + x.length]
        assert zlib.crc32(data) == x.crc32


@pytest.mark.parametrize("close", [False, True])
def test_batched_syncs_journal_only_synced_tensors_and_resume_the_same(tmp_path, close):
    whole, *_ = _write(tmp_path / "whole")
    out = tmp_path / "batched"
    with pytest.raises(KeyboardInterrupt):
        _write(out, interrupt_after=5, sync_bytes=1 << 30, close=close)
    journal = (tmp_path / "batched.partial" / "journal.jsonl").read_text()
    # killed (no close): nothing reached the sync size, nothing is journaled; closed: the 5 finished tensors are
    assert len(journal.splitlines()) == (5 if close else 0)
    done, *_, writer = _write(out, sync_bytes=1 << 30)
    assert writer.resumed == (5 if close else 0)
    for f in ("manifest.json", "dense.bin", "experts-00000.bin"):
        assert (done / f).read_bytes() == (whole / f).read_bytes()


def test_partial_with_other_settings_is_refused(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        _write(tmp_path / "m", interrupt_after=2)
    with pytest.raises(ModelFormatError, match="other settings"):
        _write(tmp_path / "m", key={"source": "another"})


def test_existing_output_is_refused(tmp_path):
    _write(tmp_path / "m")
    with pytest.raises(ModelFormatError, match="already exists"):
        _write(tmp_path / "m")


def test_corruption_is_detected_with_the_file_named(tmp_path):
    out, *_ = _write(tmp_path / "m")
    c = Container.open(out)
    e = c.entries["l0.e1.g"]
    data = bytearray((out / e.file).read_bytes())
    data[e.offset + 3] ^= 0x40
    (out / e.file).write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match=r"experts-00000\.bin: checksum mismatch in tensor l0\.e1\.g.*colibri convert"):
        Container.open(out)


def test_truncation_is_detected(tmp_path):
    out, *_ = _write(tmp_path / "m")
    data = (out / "dense.bin").read_bytes()
    (out / "dense.bin").write_bytes(data[:-10])
    with pytest.raises(ModelFormatError, match=r"dense\.bin: is \d+ bytes but the manifest needs \d+; the container is truncated"):
        Container.open(out)


def test_newer_format_version_is_refused(tmp_path):
    out, *_ = _write(tmp_path / "m")
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["version"] = 99
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ModelFormatError, match="version 99 is newer than this Colibri reads.*upgrade Colibri"):
        Container.open(out)


def test_not_a_container(tmp_path):
    (tmp_path / MANIFEST).write_text("{}")
    with pytest.raises(ModelFormatError, match="not a Colibri container"):
        Container.open(tmp_path)
