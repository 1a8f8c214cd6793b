"""engine.offload.io: bytes read equal the file's bytes (buffered and O_DIRECT, aligned or not), from
several threads at once; a truncated file names itself; O_DIRECT refusals degrade to buffered reads."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from engine.errors import ModelFormatError
from engine.offload import io as sio
from engine.offload.io import (
    PAGE,
    DirectIOUnavailable,
    IOPool,
    ReadDone,
    aligned_empty,
    drop_file_cache,
    measure_read_bandwidth,
)

SIZE = 5 * PAGE * 16 + 1234  # not a whole number of pages: the last O_DIRECT read comes back short


def io_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("colibri-io-")}


@pytest.fixture(autouse=True)
def no_leftover_threads():
    """Every test closes its pools: no reader thread outlives it."""
    before = io_threads()
    yield
    assert io_threads() <= before, "an IOPool was left open"


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[str, np.ndarray]:
    """A file of SIZE random bytes and those bytes."""
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    path = tmp_path / "experts-00000.bin"
    path.write_bytes(data.tobytes())
    return str(path), data


def direct_refused(path: str) -> str | None:
    """Why O_DIRECT is impossible for path, or None when the file system allows it."""
    try:
        with IOPool(1, direct=True) as pool:
            pool.read(path, 0, PAGE, aligned_empty(PAGE))
    except DirectIOUnavailable as e:
        return f"the file system of {path} refuses O_DIRECT: {e}"
    return None


@pytest.fixture(params=[False, None, True], ids=["buffered", "auto", "direct"])
def pool_mode(request, data_file) -> bool | None:
    if request.param is True and (why := direct_refused(data_file[0])):
        pytest.skip(why)
    return request.param


# (offset, length) pairs: aligned, unaligned offset, unaligned length, at the end, empty
RANGES = [(0, PAGE), (0, 3 * PAGE), (PAGE, 2 * PAGE + 7), (123, 4567), (8 * PAGE, 1), (SIZE - 1234, 1234),
          (SIZE - 1, 1), (SIZE - 5000, 5000), (2 * PAGE, 0)]


@pytest.mark.parametrize("offset,length", RANGES)
def test_read_equals_file_bytes(data_file, pool_mode, offset, length):
    path, data = data_file
    direct_ok = pool_mode is not False and direct_refused(path) is None
    with IOPool(2, direct=pool_mode) as pool:
        for dest in (aligned_empty(length + PAGE), np.zeros(length + PAGE + 1, np.uint8)[1:]):  # aligned, unaligned
            dest[:] = 0xEE
            done = pool.read(path, offset, length, dest)
            assert isinstance(done, ReadDone) and done.nbytes == length and done.seconds >= 0
            np.testing.assert_array_equal(dest[:length], data[offset : offset + length])
            aligned = offset % PAGE == 0 and sio._address(dest) % PAGE == 0
            assert done.direct == (direct_ok and aligned and length > 0)


def test_direct_without_room_for_a_whole_page_reads_buffered(data_file):
    path, data = data_file
    if why := direct_refused(path):
        pytest.skip(why)
    dest = aligned_empty(2 * PAGE)[: PAGE + 10]  # aligned, but no room to round 100 + PAGE up to 2 pages
    with IOPool(1, direct=True) as pool:
        done = pool.read(path, 0, PAGE + 10, dest)
    assert not done.direct
    np.testing.assert_array_equal(dest, data[: PAGE + 10])


def test_concurrent_submits_from_several_threads(data_file, pool_mode):
    path, data = data_file
    errors: list[BaseException] = []

    def caller(seed: int, pool: IOPool) -> None:
        rng = np.random.default_rng(seed)
        jobs = []
        for _ in range(40):
            offset = int(rng.integers(0, SIZE)) if rng.random() < 0.5 else int(rng.integers(0, SIZE // PAGE)) * PAGE
            length = int(rng.integers(0, SIZE - offset + 1))
            dest = aligned_empty(length)
            jobs.append((offset, length, dest, pool.submit(path, offset, length, dest)))
        try:
            for offset, length, dest, fut in jobs:
                assert fut.result().nbytes == length
                np.testing.assert_array_equal(dest[:length], data[offset : offset + length])
        except BaseException as e:  # reported on the test's thread
            errors.append(e)

    with IOPool(3, direct=pool_mode) as pool:
        callers = [threading.Thread(target=caller, args=(seed, pool)) for seed in range(4)]
        for t in callers:
            t.start()
        for t in callers:
            t.join()
        assert pool.stats.reads == 4 * 40
    assert not errors, errors[0]


@pytest.mark.parametrize("offset,length", [(78 * PAGE, 3 * PAGE), (SIZE - 100, 101), (SIZE + PAGE, 10)])
def test_truncated_file_names_file_and_offset(data_file, pool_mode, offset, length):
    path, _ = data_file
    with IOPool(2, direct=pool_mode) as pool:
        fut = pool.submit(path, offset, length, aligned_empty(length))
        with pytest.raises(ModelFormatError) as err:
            fut.result()
        assert pool.stats.reads == 0  # a failed read is not counted
    message = str(err.value)
    assert path in message and f"offset {offset}" in message
    assert "truncated" in message and "re-convert" in message


def test_read_here_reads_on_the_calling_thread_into_a_done_future(data_file, pool_mode, tmp_path):
    """`read_here` reads as a reader thread would, on the caller's thread: the future is done when it returns, with
    the bytes in or the read's error; after close it refuses, as submit does."""
    path, data = data_file
    threads = []
    real = IOPool._read

    def reading(pool, *args):
        threads.append(threading.current_thread())
        return real(pool, *args)
    pool = IOPool(2, direct=pool_mode)
    try:
        pool._read = reading.__get__(pool)
        dest = aligned_empty(3 * PAGE)
        fut = pool.read_here(path, PAGE, 2 * PAGE + 7, dest)
        assert fut.done() and fut.result().nbytes == 2 * PAGE + 7
        np.testing.assert_array_equal(dest[: 2 * PAGE + 7], data[PAGE : 3 * PAGE + 7])
        missing = pool.read_here(str(tmp_path / "nope.bin"), 0, 10, aligned_empty(10))
        assert missing.done() and isinstance(missing.exception(), FileNotFoundError)
        assert threads == [threading.current_thread()] * 2
        with pytest.raises(ValueError, match="holds 10 bytes"):
            pool.read_here(path, 0, 11, np.empty(10, np.uint8))
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="after close"):
        pool.read_here(path, 0, 8, aligned_empty(8))


def test_missing_file_fails_on_the_future(tmp_path):
    with IOPool(1) as pool:
        with pytest.raises(FileNotFoundError):
            pool.read(str(tmp_path / "nope.bin"), 0, 10, aligned_empty(10))


def test_dest_is_checked_on_submit(data_file):
    path, _ = data_file
    with IOPool(1) as pool:
        with pytest.raises(ValueError, match="holds 10 bytes"):
            pool.submit(path, 0, 11, np.empty(10, np.uint8))
        with pytest.raises(ValueError, match="uint8"):
            pool.submit(path, 0, 8, np.empty(2, np.float32))
        with pytest.raises(ValueError, match="uint8"):
            pool.submit(path, 0, 8, np.empty(20, np.uint8)[::2])


@pytest.mark.parametrize("nbytes", [0, 1, PAGE, PAGE + 1, 3 << 20])
@pytest.mark.parametrize("align", [64, PAGE, 1 << 16])
def test_aligned_empty(nbytes, align):
    a = aligned_empty(nbytes, align)
    assert a.dtype == np.uint8 and a.flags.c_contiguous and a.flags.writeable
    assert a.size == -(-nbytes // align) * align
    assert a.size == 0 or sio._address(a) % align == 0  # an empty array has no data to align
    a[:] = 7  # the backing is alive and writable
    assert int(a.sum()) == 7 * a.size


def test_aligned_empty_keeps_its_backing_alive():
    a = aligned_empty(PAGE)[:10]
    import gc

    gc.collect()
    a[:] = np.arange(10, dtype=np.uint8)
    assert a.tolist() == list(range(10))


def test_stats_count_reads(data_file, pool_mode):
    path, _ = data_file
    with IOPool(2, direct=pool_mode) as pool:
        assert pool.stats == sio.IOStats(0, 0, 0.0, 0)
        dones = [pool.submit(path, off, ln, aligned_empty(ln)) for off, ln in RANGES]
        dones = [f.result() for f in dones]
        stats = pool.stats
    assert stats.reads == len(RANGES)
    assert stats.bytes == sum(ln for _, ln in RANGES)
    assert stats.direct_reads == sum(d.direct for d in dones)
    assert stats.busy_seconds == pytest.approx(sum(d.seconds for d in dones))
    assert (stats.direct_reads > 0) == (pool_mode is not False)


def test_close_is_idempotent_joins_threads_and_closes_fds(data_file):
    path, _ = data_file
    pool = IOPool(2)
    before = io_threads()
    pool.read(path, 0, 10, aligned_empty(10))
    assert {t.name for t in io_threads() - before} <= {"colibri-io-0", "colibri-io-1"}
    fds = [fd for f in pool._files.values() for fd in (f.buffered, f.direct) if fd is not None]
    pool.close()
    pool.close()
    assert not (io_threads() - before)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    with pytest.raises(RuntimeError, match="after close"):
        pool.submit(path, 0, 10, aligned_empty(10))


def _refuse_direct_at_open(monkeypatch):
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if flags & sio._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


def _refuse_direct_at_read(monkeypatch):
    import fcntl

    real_preadv = os.preadv

    def fake_preadv(fd, buffers, offset, *args):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & sio._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", fake_preadv)


@pytest.mark.skipif(not sio._O_DIRECT, reason="this OS has no O_DIRECT")
@pytest.mark.parametrize("refuse", [_refuse_direct_at_open, _refuse_direct_at_read], ids=["at-open", "at-read"])
def test_refused_direct_degrades_or_raises(data_file, monkeypatch, refuse):
    """A file system refusing O_DIRECT (overlayfs, tmpfs before Linux 6.6) is read buffered, or named if required."""
    path, data = data_file
    refuse(monkeypatch)
    dest = aligned_empty(2 * PAGE)
    with IOPool(1, direct=None) as pool:
        done = pool.read(path, 0, 2 * PAGE, dest)
    assert not done.direct
    np.testing.assert_array_equal(dest, data[: 2 * PAGE])
    with IOPool(1, direct=True) as pool:
        with pytest.raises(DirectIOUnavailable, match="refuses O_DIRECT") as err:
            pool.read(path, 0, PAGE, dest)
    assert isinstance(err.value, OSError) and err.value.filename == path and path in str(err.value)


@pytest.mark.skipif(not sio._O_DIRECT, reason="this OS has no O_DIRECT")
def test_direct_refused_mid_stream_falls_back_for_good(data_file, monkeypatch):
    path, data = data_file
    if why := direct_refused(path):
        pytest.skip(why)
    dest = aligned_empty(2 * PAGE)
    with IOPool(1, direct=None) as pool:
        assert pool.read(path, 0, PAGE, dest).direct
        _refuse_direct_at_read(monkeypatch)
        assert not pool.read(path, PAGE, 2 * PAGE, dest).direct
        np.testing.assert_array_equal(dest, data[PAGE : 3 * PAGE])
        assert pool._files[path].direct is None and len(pool._retired) == 1
    monkeypatch.undo()
    with IOPool(1, direct=True) as pool:  # required: the same refusal is an error naming the file
        assert pool.read(path, 0, PAGE, dest).direct
        _refuse_direct_at_read(monkeypatch)
        with pytest.raises(DirectIOUnavailable, match="at a read of") as err:
            pool.read(path, 0, PAGE, dest)
    assert err.value.filename == path


def test_drop_file_cache_and_bandwidth(tmp_path, data_file):
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(4 << 20))
    drop_file_cache(str(path))  # no error on a file just written
    assert measure_read_bandwidth(str(path), nbytes=4 << 20, block=256 << 10, threads=2) > 0
    assert measure_read_bandwidth(data_file[0], nbytes=4 << 20) > 0  # file shorter than nbytes and than one block
    with pytest.raises(ValueError, match="nothing to measure"):
        measure_read_bandwidth(path, nbytes=0)


def test_every_reader_thread_starts_with_the_pool():
    import threading

    before = {t for t in threading.enumerate()}
    pool = IOPool(3)
    try:
        started = [t.name for t in threading.enumerate() if t not in before]
        assert sorted(started) == ["colibri-io-0", "colibri-io-1", "colibri-io-2"]
    finally:
        pool.close()
