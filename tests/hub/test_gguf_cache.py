"""A GGUF given a memory budget is converted once, as published, into the data dir's converted/ folder, then
streamed: later runs reuse the container, a disk without room is refused before anything is written, an
interrupted conversion never leaves a container that loads and resumes on the next run, and the streamed answer is
the GGUF's own."""

from __future__ import annotations

import os
import shutil
from collections import namedtuple

import numpy as np
import pytest

from app.config.sizes import format_size
from app.hub import gguf_cache
from app.hub.convert import published_bytes
from app.hub.gguf_cache import cached_container, container_for
from app.hub.progress import Note, Progress
from app.service.messages import LoadOptions
from engine.errors import DiskFullError
from engine.formats.container import is_container
from engine.loader import load_model, open_checkpoint
from support.gguf_writer import kquant_moe_gguf
from support.offload import greedy_logits

PROMPT = [3, 17, 5, 99, 42, 8, 23, 61]
STEPS = 6


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return kquant_moe_gguf(tmp_path_factory.mktemp("gguf"))


def _events():
    seen: list = []
    return seen, seen.append


def test_converted_once_then_reused(gguf_file, tmp_path):
    seen, report = _events()
    out = container_for(gguf_file, report, tmp_path)
    assert out == cached_container(gguf_file, tmp_path) and is_container(out)
    assert out.name.startswith("model-") and out.parent == tmp_path
    writes = [e for e in seen if isinstance(e, Progress)]
    assert writes and writes[-1].done == writes[-1].total                 # progress up to the last tensor
    assert any(isinstance(e, Note) and "converting once" in e.message for e in seen)
    manifest = (out / "manifest.json").stat().st_mtime_ns
    again, report = _events()
    assert container_for(gguf_file, report, tmp_path) == out and again == []   # found: nothing converted
    assert (out / "manifest.json").stat().st_mtime_ns == manifest
    st = gguf_file.stat()
    os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # the file changed: another container
    try:
        assert cached_container(gguf_file, tmp_path) != out
    finally:
        os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_disk_without_room_is_refused_before_writing(gguf_file, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(gguf_cache.shutil, "disk_usage", lambda p: usage(1 << 30, (1 << 30) - 100_000, 100_000))
    with pytest.raises(DiskFullError) as err:
        container_for(gguf_file, lambda e: None, tmp_path)
    message = str(err.value)
    assert f"a container of {format_size(published_bytes(gguf_file))}" in message      # the room needed
    assert "100.00 kB free" in message
    assert "free " in message and f"colibri convert {gguf_file} OUT" in message       # and the fixes
    assert list(tmp_path.iterdir()) == []                                 # nothing written


def test_an_interrupted_conversion_never_loads_and_resumes(gguf_file, tmp_path):
    class Stop(Exception):
        pass

    def stop_at_first_write(event) -> None:
        if isinstance(event, Progress):
            raise Stop

    with pytest.raises(Stop):
        container_for(gguf_file, stop_at_first_write, tmp_path)
    out = cached_container(gguf_file, tmp_path)
    assert not out.exists() and out.with_name(out.name + ".partial").is_dir()   # only the resumable partial
    seen, report = _events()
    assert container_for(gguf_file, report, tmp_path) == out and is_container(out)
    assert any(isinstance(e, Note) and "resuming" in e.message for e in seen)
    open_checkpoint(out)                                                  # whole: every checksum holds


def _budget(container, ctx: int) -> int:
    """A budget between the least that streams and all the experts in memory."""
    from app.service.model import ALL, full_budget
    from engine.offload.budget import plan_memory

    ckpt = open_checkpoint(container, verify=False)
    full = full_budget(plan_memory(ckpt.source, ckpt.spec, ALL, ctx, 1))
    least = plan_memory(ckpt.source, ckpt.spec, full, ctx, 1).minimum
    assert least < full
    return (least + full) // 2


def test_run_with_a_budget_streams_the_gguf_answer(gguf_file, tmp_path, monkeypatch):
    """What `colibri run FILE.gguf --max-memory SIZE` loads: the cached container, streamed, giving the GGUF's bits."""
    from app.commands._common import load

    monkeypatch.setenv("COLIBRI_MODELS_DIR", str(tmp_path / "models"))
    direct = load_model(gguf_file)
    try:
        want, want_tokens = greedy_logits(direct, PROMPT, STEPS)
    finally:
        direct.close()
    probe = container_for(gguf_file, lambda e: None, tmp_path / "probe")
    options = LoadOptions(max_memory=_budget(probe, 64), context_length=64, history=False)
    shutil.rmtree(probe)
    loaded = load(str(gguf_file), quiet=True, options=options)
    try:
        assert loaded.path.parent == tmp_path / "converted" and is_container(loaded.path)
        got, tokens = greedy_logits(loaded, PROMPT, STEPS)
        stats = loaded.store.stats()
    finally:
        loaded.close()
    assert stats.hits["disk"] > 0 and stats.slots < 2 * 8                # streamed, not all held
    assert tokens == want_tokens
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_the_service_converts_a_gguf_to_stream_it(gguf_file, tmp_path, monkeypatch):
    """What `serve` and `gui` do with a GGUF and a budget: the load converts it (its progress in LoadProgress events),
    then streams the container's experts."""
    import threading

    from app.service.local import EngineService, LoadFailed, LoadProgress, ModelLoaded

    monkeypatch.setenv("COLIBRI_MODELS_DIR", str(tmp_path / "models"))
    probe = container_for(gguf_file, lambda e: None, tmp_path / "probe")
    budget = _budget(probe, 64)
    events: list = []
    cond = threading.Condition()

    def listen(event) -> None:
        with cond:
            events.append(event)
            cond.notify_all()

    service = EngineService(listen)
    try:
        i = service.load(str(gguf_file), LoadOptions(max_memory=budget, context_length=64, history=False))
        with cond:
            assert cond.wait_for(lambda: any(isinstance(e, (ModelLoaded, LoadFailed)) and e.request == i
                                             for e in events), timeout=600)
        done = next(e for e in events if isinstance(e, (ModelLoaded, LoadFailed)))
        assert isinstance(done, ModelLoaded), done
        assert done.info.streaming == "experts"
        assert any(isinstance(e, LoadProgress) and "written" in e.message for e in events)
        assert is_container(cached_container(gguf_file, tmp_path / "converted"))
    finally:
        service.close()
