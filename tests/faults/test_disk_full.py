"""A full disk under every writer: a clear error (CLI: one `colibri: error:` line, exit 2; engine: a ColibriError),
and never a half-written file in place of a good one.

The disks are real: size-limited tmpfs mounts in a user namespace (tests/support/disk.py), whose writes fail
with ENOSPC. Colibri writes no settings file (colibri.toml is only read), so settings have no case here.
"""

from __future__ import annotations

import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

from app import cli
from app.hub.convert import ConvertSettings, convert
from engine.errors import ColibriError, DiskFullError
from support.disk import fill, run_on_small_disk, small_disk
from support.faults import REPO, tree_bytes
from support.reference import build_checkpoint

KIB = 1 << 10


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("src"), "mixtral", num_local_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def reference(src, tmp_path_factory) -> dict[str, bytes]:
    out = convert(src, tmp_path_factory.mktemp("ref") / "out", ConvertSettings(bits=4), log=lambda m: None)
    return tree_bytes(out)


def _error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("colibri: error:")]


def _no_temps(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob("*") if p.name.endswith(".tmp")]


@pytest.fixture
def plenty_of_space(monkeypatch):
    """shutil.disk_usage in convert reports a huge disk: the space check passes and the writes meet ENOSPC."""
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("app.hub.convert.shutil.disk_usage", lambda path: usage(1 << 50, 0, 1 << 50))


# --- convert ---

def test_convert_refuses_a_disk_too_small_before_writing_the_weights(src, tmp_path):
    proc = run_on_small_disk([sys.executable, "-m", "app.cli", "convert", str(src), str(tmp_path / "disk" / "out"),
                              "--bits", "4"], 256 * KIB, tmp_path / "disk", cwd=REPO, text=True)
    assert proc.returncode == 2
    [line] = _error_lines(proc.stderr)
    assert f"{tmp_path / 'disk' / 'out'} needs " in line
    assert "free: free space or choose another OUT" in line


def test_convert_on_a_disk_filling_up_says_where_it_stopped_and_resumes_byte_identical(src, reference, tmp_path,
                                                                                      plenty_of_space, capsys):
    with small_disk(1 << 20, tmp_path / "disk") as disk:
        filler = fill(disk, leave=sum(map(len, reference.values())) // 2)
        out = disk / "out"
        assert cli.main(["convert", str(src), str(out), "--bits", "4"]) == 2
        [line] = _error_lines(capsys.readouterr().err)
        assert line.startswith("colibri: error: disk full at ")
        assert line.endswith(f"bytes: free space and run again to resume (the work so far is kept in {out}.partial)")
        written, total = (int(n) for n in line.split("disk full at ")[1].split(" bytes")[0].split(" of "))
        assert 0 < written < total
        assert not out.exists() and (out.parent / "out.partial").is_dir()
        filler.unlink()                                 # space is freed: the rerun resumes
        assert cli.main(["convert", str(src), str(out), "--bits", "4"]) == 0
        assert "resuming:" in capsys.readouterr().err
        assert tree_bytes(out) == reference


def test_convert_with_no_room_for_its_plan_keeps_no_half_file_and_resumes(src, reference, tmp_path, plenty_of_space):
    with small_disk(1 << 20, tmp_path / "disk") as disk:
        filler = fill(disk, leave=4 * KIB)              # the resume key fits; the plan does not
        out = disk / "out"
        with pytest.raises(DiskFullError, match=r"^disk full at 0 bytes: free space and run again to resume"):
            convert(src, out, ConvertSettings(bits=4), log=lambda m: None)
        assert sorted(p.name for p in (disk / "out.partial").iterdir()) == ["journal.jsonl", "resume_key.json"]
        filler.unlink()
        convert(src, out, ConvertSettings(bits=4), log=lambda m: None)
        assert tree_bytes(out) == reference


def test_convert_with_no_room_to_start_leaves_nothing(src, tmp_path, plenty_of_space):
    with small_disk(256 * KIB, tmp_path / "disk") as disk:
        fill(disk, leave=0)
        with pytest.raises(DiskFullError, match="has no room to start"):
            convert(src, disk / "out", ConvertSettings(bits=4), log=lambda m: None)
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]


# --- session save (engine/generation/session.py) ---

def test_session_save_on_a_full_disk_keeps_the_previous_save(src, tmp_path):
    from engine.generation.session import KVSettings, SessionFile, SessionState
    from engine.kv import KVCache, KVPool
    from engine.loader import load_model

    loaded = load_model(src)
    cache = KVCache(loaded.spec, 256, pool=KVPool(loaded.spec, 80, block_size=4))
    loaded.model.forward(list(range(3, 12)), cache)
    with small_disk(512 * KIB, tmp_path / "disk") as disk:
        path = disk / "chat.session"
        SessionFile(path, "tiny", KVSettings.of(cache)).save(cache, SessionState(tuple(cache.tokens), 9, None))
        before = path.read_bytes()
        fill(disk, leave=0)
        loaded.model.forward(list(range(20, 60)), cache)
        with pytest.raises(ColibriError, match="disk full"):
            SessionFile(path, "tiny", KVSettings.of(cache)).save(cache, SessionState(tuple(cache.tokens), 9, None))
        assert path.read_bytes() == before
        assert not _no_temps(disk)


# --- sidecars: the usage history and the atlas ---

def test_usage_history_on_a_full_disk_keeps_the_previous_file(tmp_path):
    from engine.offload.history import UsageHistory

    history = UsageHistory(4, 64, "hash")
    with small_disk(256 * KIB, tmp_path / "disk") as disk:
        path = disk / "model.usage.npz"
        history.save(path)
        before = path.read_bytes()
        fill(disk, leave=0)
        history.record(0, np.arange(64))
        with pytest.raises(DiskFullError, match=f"the usage history {path} was not saved"):
            history.save(path)
        assert path.read_bytes() == before
        assert not _no_temps(disk)


def test_atlas_on_a_full_disk_keeps_the_previous_file(tmp_path):
    from app.atlas.build import write_atomic

    with small_disk(256 * KIB, tmp_path / "disk") as disk:
        path = disk / "model.atlas.json"
        write_atomic(path, {"format": "colibri-atlas", "layers": []})
        before = path.read_bytes()
        fill(disk, leave=0)
        with pytest.raises(DiskFullError, match=f"the atlas {path} was not written"):
            write_atomic(path, {"format": "colibri-atlas", "layers": [list(range(20000))]})
        assert path.read_bytes() == before
        assert not _no_temps(disk)


# --- moefy's and synth's outputs ---

def test_moefy_weights_on_a_full_disk_raise_disk_full(tmp_path):
    from app.moefy.write import write_json, write_weights
    from engine.loader import open_checkpoint

    dense = open_checkpoint(build_checkpoint(tmp_path / "dense", "llama"))
    routers = {i: np.zeros((4, dense.spec.hidden_size), np.float32) for i in range(dense.spec.n_layers)}
    with small_disk(256 * KIB, tmp_path / "disk") as disk:
        tmp = disk / ".out.partial"                    # moefy writes into a temporary folder beside OUT
        tmp.mkdir()
        with pytest.raises(DiskFullError, match="while writing the MoE's model.safetensors"):
            write_weights(tmp / "model.safetensors", dense.spec, dense.source, routers, 0.01, 0, "float32", {})
        (tmp / "model.safetensors").unlink()
        fill(disk, leave=0)
        with pytest.raises(DiskFullError, match="while writing the MoE's config.json"):
            write_json(tmp / "config.json", {"layers": list(range(20000))})


def test_synth_on_a_full_disk_raises_disk_full_and_keeps_nothing(tmp_path, monkeypatch):
    from app.bench.synth import corpus_lines, write_checkpoint

    usage = namedtuple("usage", "total used free")
    with small_disk(1 << 20, tmp_path / "disk") as disk:
        with pytest.raises(ColibriError, match="free but the checkpoint needs"):   # the check before writing
            write_checkpoint("mixtral-tiny", disk / "tiny", corpus=corpus_lines(2000))
        monkeypatch.setattr("app.bench.synth.checkpoint.shutil.disk_usage", lambda path: usage(1 << 50, 0, 1 << 50))
        with pytest.raises(DiskFullError, match=f"disk full in {disk} while writing the checkpoint"):
            write_checkpoint("mixtral-tiny", disk / "tiny", corpus=corpus_lines(2000))
        assert list(disk.iterdir()) == []

