"""Memory pressure: the expert cache shrinks when other programs take memory, says so, and grows back; the answer
never changes."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.kv import KVCache
from engine.loader import OffloadOptions, load_model
from engine.offload.pressure import MemoryGuard, cgroup_headroom, read_meminfo
from engine.offload.store import StoreSettings
from engine.telemetry import Telemetry
from support.offload import greedy_logits
from support.reference import build_checkpoint
from support.rss import memory_hog, rss_of

PROMPT = [3, 17, 5, 99, 42, 8, 23, 61, 7, 150, 12, 33]
N_EXPERTS, TOP_K, LAYERS = 8, 2, 3
MB = 1 << 20


class FakeCache:
    """A cache budget in bytes, as the store exposes it."""

    def __init__(self, capacity: int, minimum: int):
        self.capacity, self.min_capacity = capacity, minimum

    def set_capacity(self, capacity: int) -> None:
        self.capacity = capacity


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_guard_shrinks_by_the_shortfall_floors_and_grows_back(caplog):
    cache, avail, clock, tel = FakeCache(100 * MB, 10 * MB), [500 * MB], Clock(), Telemetry()
    guard = MemoryGuard(cache, reserve=50 * MB, telemetry=tel, available=lambda: avail[0], clock=clock, every=1.0)
    assert guard.check() is None and cache.capacity == 100 * MB            # plenty: nothing to do
    avail[0] = 30 * MB
    assert guard.check() is None                                           # read at most once a second
    clock.now = 1.0
    with caplog.at_level(logging.WARNING, logger="engine.offload.pressure"):
        change = guard.check()
    assert (change.before, change.after) == (100 * MB, 80 * MB)            # 20 MB short of the reserve
    assert "expert cache shrunk" in caplog.text
    avail[0] = 0
    guard.check(force=True)
    assert cache.capacity == 30 * MB
    guard.check(force=True)
    assert cache.capacity == 10 * MB                                       # never below what a token needs
    tel.flush()                                                            # gauges publish at token boundaries
    gauges = tel.snapshot().gauges
    assert gauges["pressure_shrinks"] == 3 and gauges["expert_cache"] == 10 * MB and gauges["mem_available"] == 0
    avail[0] = 90 * MB                                                     # between reserve and twice it: hold
    assert guard.check(force=True) is None
    avail[0] = 1000 * MB
    guard.check(force=True)
    assert cache.capacity == 100 * MB                                      # back to what the user asked, no more
    cache.capacity = 60 * MB                                               # the user lowers the budget
    avail[0] = 40 * MB
    guard.check(force=True)
    assert guard.ceiling == 60 * MB and cache.capacity == 50 * MB
    avail[0] = 1000 * MB
    guard.check(force=True)
    assert cache.capacity == 60 * MB


def test_guard_does_nothing_when_memory_is_unknown():
    cache = FakeCache(100 * MB, 10 * MB)
    assert MemoryGuard(cache, reserve=50 * MB, available=lambda: None).check() is None
    assert cache.capacity == 100 * MB


def test_meminfo_and_cgroup_readers(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:       24000 kB\nMemAvailable:    1000 kB\nHugePages_Total:   0\n")
    assert read_meminfo(tmp_path / "meminfo") == {"MemTotal": 24000 * 1024, "MemAvailable": 1024000,
                                                  "HugePages_Total": 0}
    assert read_meminfo(tmp_path / "none") == {}
    (tmp_path / "cgroup").write_text("0::/box\n")
    (tmp_path / "box").mkdir()
    (tmp_path / "box" / "memory.max").write_text("1000000\n")
    (tmp_path / "box" / "memory.current").write_text("400000\n")
    assert cgroup_headroom(tmp_path / "cgroup", tmp_path) == 600000
    (tmp_path / "box" / "memory.max").write_text("max\n")
    assert cgroup_headroom(tmp_path / "cgroup", tmp_path) is None
    assert cgroup_headroom(tmp_path / "missing", tmp_path) is None


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    src = build_checkpoint(tmp_path_factory.mktemp("src"), "mixtral", num_local_experts=N_EXPERTS,
                           num_experts_per_tok=TOP_K, num_hidden_layers=LAYERS)
    return convert(src, tmp_path_factory.mktemp("c") / "moe", ConvertSettings(bits=4), log=lambda m: None)


def test_a_memory_hog_shrinks_the_cache_while_decoding_and_the_answer_holds(container, caplog):
    resident = greedy_logits(load_model(container), PROMPT, 10)
    probe = load_model(container, offload=OffloadOptions(StoreSettings(capacity=1 << 30)))
    slot = probe.store.slot_bytes
    probe.close()
    tel = Telemetry(LAYERS, N_EXPERTS)
    loaded = load_model(container, offload=OffloadOptions(StoreSettings(capacity=24 * slot, pressure=False)),
                        telemetry=tel)
    store, model = loaded.store, loaded.model
    hog: dict[str, int] = {}
    reserve = 50 * MB
    # what the system could hand out, were the machine to hold only this test and the hog: deterministic
    store.guard = MemoryGuard(store, reserve=reserve, telemetry=tel, every=0.0,
                              available=lambda: reserve + 150 * MB - rss_of(hog.get("pid", 0)))
    try:
        cache = KVCache(loaded.spec, len(PROMPT) + 12)
        logits = [model.forward(PROMPT, cache, all_logits=True)]
        tokens, sizes = [], []
        with caplog.at_level(logging.WARNING, logger="engine.offload.pressure"):
            for step in range(10):
                if step == 3:
                    hog_cm = memory_hog(300 * MB)
                    hog["pid"] = hog_cm.__enter__()
                if step == 6:
                    hog_cm.__exit__(None, None, None)
                tokens.append(int(np.argmax(logits[-1][-1])))
                logits.append(model.forward([tokens[-1]], cache))
                sizes.append(store.capacity)
    finally:
        loaded.close()
    assert sizes[:3] == [24 * slot] * 3
    assert sizes[3:6] == [TOP_K * slot] * 3                   # the hog's 300 MB leave the reserve 150 MB short
    assert sizes[6:] == [24 * slot] * 4                       # it exits: the cache comes back
    assert "expert cache shrunk" in caplog.text
    assert tel.snapshot().gauges["pressure_shrinks"] == 1
    assert tokens == resident[1]
    assert np.array_equal(np.concatenate(logits), resident[0])


def test_plan_and_doctor_count_what_other_programs_hold():
    from app import doctor
    from app.plan.budget import memory_now

    gb = 10**9
    now = memory_now({"MemTotal": 16 * gb, "MemAvailable": 6 * gb}, headroom=None, own=1 * gb)
    assert now.others == 9 * gb
    assert now.note(7 * gb) is None                       # ours plus what is available covers it
    note = now.note(12 * gb)
    assert "other programs hold 9.00 GB" in note and "lower --max-memory" in note
    assert memory_now({"MemTotal": 16 * gb, "MemAvailable": 6 * gb}, headroom=2 * gb, own=0).available == 2 * gb
    assert memory_now({}, own=0) is None
    check = doctor.check_memory({"MemTotal": 16 * gb, "MemAvailable": 6 * gb}, limit=None)
    assert "other programs hold" in check.value
