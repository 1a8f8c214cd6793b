"""Saved sessions under faults: a second writer, a kill mid-save, a damaged last save, a full disk.

The full disk is real: a small tmpfs (tests/support/disk.py) whose writes fail with ENOSPC. The model
is the tiny chat MoE in float32; only its KV cache matters here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.errors import ColibriError, FileInUseError
from engine.generation.session import (
    KVSettings,
    SessionError,
    SessionFile,
    SessionSaveError,
    SessionState,
    session_lock,
)
from engine.kv import KVCache, KVPool
from engine.loader import load_model
from support.disk import fill, small_disk

REPO = Path(__file__).resolve().parents[2]
PROMPT = [3, 17, 5, 99, 42, 8, 23, 61, 7]
BLOCK = 4


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from support.tiny_chat import tiny_moe

    model = load_model(tiny_moe(tmp_path_factory.mktemp("tiny")))
    yield model
    model.close()


def _grow(loaded, cache: KVCache, n: int, save: int) -> SessionState:
    """Run n more tokens (after the prompt, on an empty cache) through the model; the state names its save."""
    if not cache.tokens:
        loaded.model.forward(PROMPT, cache)
    for _ in range(n):
        loaded.model.forward([len(cache.tokens) * 7 % 150 + 1], cache)
    return SessionState(tuple(cache.tokens), len(PROMPT), 11, extra={"save": save})


def _cache(loaded) -> KVCache:
    return KVCache(loaded.spec, 256, pool=KVPool(loaded.spec, 80, block_size=BLOCK))


def _load(path: Path, settings: KVSettings, loaded) -> tuple[SessionFile, KVCache, SessionState]:
    session = SessionFile(path, "tiny", settings)
    cache, state = session.load(KVPool(loaded.spec, 80, block_size=BLOCK))
    return session, cache, state


def _spawn(code: str, *args: str) -> subprocess.Popen:
    """A Python child running code; it says 'ready' on stdout, then waits for its stdin to close."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    line = child.stdout.readline()
    assert line.strip() == "ready", child.stderr.read()
    return child


def _end(child: subprocess.Popen, kill: bool = False) -> None:
    if kill:
        child.send_signal(signal.SIGKILL)
    child.stdin.close()
    child.wait(timeout=60)
    child.stdout.close()
    child.stderr.close()


HOLD = """
    import sys
    from engine.generation.session import session_lock
    lock = session_lock(sys.argv[1])
    print("ready", flush=True)
    sys.stdin.read()
    """


# --- one writer per session ---

def test_a_second_opener_in_another_process_is_refused_naming_the_holder(tmp_path):
    path = tmp_path / "chat.session"
    holder = _spawn(HOLD, str(path))
    try:
        with pytest.raises(FileInUseError) as err:
            session_lock(path)
        text = str(err.value)
        assert isinstance(err.value, ColibriError) and err.value.pid == holder.pid
        assert str(path) in text and f"process {holder.pid}" in text and "session_lock" in text, text
        assert "close that chat first, or use another session file" in text
    finally:
        _end(holder)
    session_lock(path).release()                        # free again once the holder left


def test_a_killed_holder_frees_the_session(tmp_path):
    path = tmp_path / "chat.session"
    _end(_spawn(HOLD, str(path)), kill=True)
    lock = session_lock(path)
    try:
        with pytest.raises(FileInUseError, match="this process"):  # a second hold, even here, is refused
            session_lock(path)
    finally:
        lock.release()


def test_a_folder_is_refused_with_a_clear_error(tmp_path, loaded):
    with pytest.raises(SessionError, match="is a folder; name a file"):
        session_lock(tmp_path)
    cache = _cache(loaded)
    state = _grow(loaded, cache, 1, 1)
    with pytest.raises(SessionError, match="is a folder"):
        SessionFile(tmp_path, "tiny", KVSettings.of(cache)).save(cache, state)
    with pytest.raises(SessionError, match="is a folder"):
        SessionFile(tmp_path, "tiny", KVSettings.of(cache)).load(cache.pool)


# --- temporaries a killed save left ---

KILLED_MID_SAVE = """
    import sys
    from engine.atomic import atomic_file
    with atomic_file(sys.argv[1], "wb") as f:     # a first save, killed before its rename
        f.write(b"COLSESS" * 1000)
        f.flush()
        print("ready", flush=True)
        sys.stdin.read()
    """


LIVE_SAVE = """
    import sys
    from engine.atomic import atomic_file
    from engine.generation.session import session_lock
    lock = session_lock(sys.argv[1])
    with atomic_file(sys.argv[1], "wb") as f:     # a save under way
        f.write(b"COLSESS" * 1000)
        f.flush()
        print("ready", flush=True)
        sys.stdin.read()
    """


def test_the_temporaries_of_a_killed_save_are_removed_at_open(tmp_path):
    path = tmp_path / "chat.session"
    _end(_spawn(KILLED_MID_SAVE, str(path)), kill=True)
    orphans = list(tmp_path.glob(".chat.session.*.tmp"))
    assert len(orphans) == 1 and not path.exists()
    others = [tmp_path / ".chat.session.b.abcd1234.tmp", tmp_path / "chat.session.tmp", tmp_path / "notes"]
    for other in others:                                # another file's temporary, and unrelated files
        other.write_bytes(b"keep")
    session_lock(path).release()
    assert not orphans[0].exists()
    assert all(other.read_bytes() == b"keep" for other in others)


def test_a_live_writers_temporary_is_left_alone(tmp_path):
    path = tmp_path / "chat.session"
    writer = _spawn(LIVE_SAVE, str(path))
    try:
        with pytest.raises(FileInUseError):
            session_lock(path)
        assert len(list(tmp_path.glob(".chat.session.*.tmp"))) == 1
    finally:
        _end(writer)                                    # its save completes
    assert path.read_bytes() == b"COLSESS" * 1000 and not list(tmp_path.glob(".chat.session.*.tmp"))


# --- a damaged last save is dropped, and said so ---

def _two_saves(loaded, path: Path) -> tuple[int, KVSettings, SessionState]:
    cache = _cache(loaded)
    session = SessionFile(path, "tiny", KVSettings.of(cache))
    first = _grow(loaded, cache, 2, 1)
    session.save(cache, first)
    size = path.stat().st_size
    session.save(cache, _grow(loaded, cache, 9, 2))     # appended: new blocks and a tail
    return size, KVSettings.of(cache), first


@pytest.mark.parametrize("damage", ["flipped", "cut", "no tail"])
def test_a_damaged_last_save_is_dropped_with_a_warning_and_the_rest_kept(loaded, tmp_path, damage):
    path = tmp_path / "chat.session"
    size1, settings, first = _two_saves(loaded, path)
    data = bytearray(path.read_bytes())
    if damage == "flipped":
        data[-1] ^= 0xFF
    elif damage == "cut":
        del data[-100:]
    else:                                               # the append reached the disk but for its tail
        whole = _load(path, settings, loaded)[0]
        del data[whole._end - whole._tail :]
    path.write_bytes(bytes(data))
    session, cache, state = _load(path, settings, loaded)
    assert state == first and list(cache.tokens) == list(first.seen)
    dropped = session.dropped
    assert dropped is not None and dropped.offset == size1 and dropped.size == len(data) - size1
    reason = {"flipped": "fails its checksum", "cut": "cut short", "no tail": "its tail is missing"}[damage]
    assert reason in str(dropped)
    session.save(cache, state)                          # saving again clears the damaged end
    assert _load(path, settings, loaded)[0].dropped is None


def test_an_intact_file_drops_nothing(loaded, tmp_path):
    path = tmp_path / "chat.session"
    _, settings, _ = _two_saves(loaded, path)
    session, _, state = _load(path, settings, loaded)
    assert session.dropped is None and state.extra == {"save": 2}


# --- a full disk ---

def test_a_save_on_a_full_disk_fails_cleanly_and_keeps_the_previous_save(loaded, tmp_path):
    with small_disk(1 << 20, tmp_path / "disk") as disk:
        path = disk / "chat.session"
        cache = _cache(loaded)
        settings = KVSettings.of(cache)
        session = SessionFile(path, "tiny", settings)
        first = _grow(loaded, cache, 2, 1)
        session.save(cache, first)
        before = path.read_bytes()
        filler = fill(disk, leave=4096)
        second = _grow(loaded, cache, 24, 2)            # 6 more blocks: far more than one page
        with pytest.raises(SessionSaveError) as err:
            session.save(cache, second)                 # an append
        e = err.value
        assert isinstance(e, ColibriError) and e.reason == "disk full"
        assert 0 < e.written < e.total and e.total > 3 * 4096
        assert f"could not save the session to {path}: disk full ({e.written} of {e.total} bytes written)" in str(e)
        assert "the file keeps its previous save: free space and save again" in str(e)
        assert path.read_bytes() == before              # the torn append was cut off again
        assert _load(path, settings, loaded)[2] == first

        with pytest.raises(SessionSaveError, match="disk full"):
            SessionFile(path, "tiny", settings).save(cache, second)     # a rewrite: the file is never replaced
        assert path.read_bytes() == before
        assert list(disk.glob(".chat.session.*.tmp")) == []

        filler.unlink()                                 # space again: the next save goes through
        session.save(cache, second)
        reopened, restored, state = _load(path, settings, loaded)
        assert state == second and restored.tokens == cache.tokens and reopened.dropped is None


def test_a_first_save_on_a_full_disk_leaves_nothing(loaded, tmp_path):
    with small_disk(64 << 10, tmp_path / "disk") as disk:
        path = disk / "chat.session"
        cache = _cache(loaded)
        state = _grow(loaded, cache, 100, 1)           # about 75 KB of KV rows
        with pytest.raises(SessionSaveError, match="nothing was saved: free space and save again") as err:
            SessionFile(path, "tiny", KVSettings.of(cache)).save(cache, state)
        assert 0 < err.value.written <= 64 << 10 < err.value.total
        assert sorted(os.listdir(disk)) == []
