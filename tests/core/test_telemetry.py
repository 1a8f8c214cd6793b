"""Telemetry: phase accounting with nesting, rates, counters, expert heat, snapshots, subscriptions, threads."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from types import MappingProxyType

import numpy as np
import pytest

from engine.telemetry import NULL, PHASES, TIERS, Snapshot, Telemetry, TokenTimes
from support.clock import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_nested_phases_count_to_the_innermost_and_other_is_the_rest(clock):
    tel = Telemetry(clock=clock)
    tel.begin()
    with tel.phase("attention"):
        clock.advance(1)
    with tel.phase("experts"):
        clock.advance(2)
        with tel.phase("io_wait"):
            clock.advance(3)
        clock.advance(1)
    clock.advance(0.5)  # outside any phase: "other"
    with tel.phase("sampling"):
        clock.advance(0.25)
    tel.end_token()
    (rec,) = tel.snapshot().recent
    assert rec == TokenTimes(n=1, prefill=False, wall=7.75e-3, attention=1e-3, dense=0.0, experts=3e-3,
                             io_wait=3e-3, sampling=0.25e-3, other=0.5e-3)
    assert sum(getattr(rec, p) for p in PHASES) == pytest.approx(rec.wall)


def test_add_time_inside_a_phase_moves_time_out_of_it(clock):
    tel = Telemetry(clock=clock)
    tel.begin()
    with tel.phase("experts"):
        clock.advance(5)
        tel.add_time("io_wait", 2e-3)  # measured by the caller while inside "experts"
    tel.add_time("dense", 1e-3)        # outside a phase: "other" gives it up
    clock.advance(3)
    tel.end_token()
    rec = tel.snapshot().recent[-1]
    assert (rec.experts, rec.io_wait, rec.dense, rec.other, rec.wall) == pytest.approx((3e-3, 2e-3, 1e-3, 2e-3, 8e-3))


def test_a_phase_open_across_end_token_is_split_between_tokens(clock):
    tel = Telemetry(clock=clock)
    tel.begin()
    with tel.phase("sampling"):
        clock.advance(2)
        tel.end_token()
        clock.advance(3)
    tel.end_token()
    first, second = tel.snapshot().recent
    assert (first.sampling, second.sampling, second.wall) == pytest.approx((2e-3, 3e-3, 3e-3))


def test_begin_drops_idle_time(clock):
    tel = Telemetry(clock=clock)
    clock.advance(1000)
    with tel.phase("dense"):  # timed while idle, before the generation starts: dropped
        clock.advance(1)
    tel.begin()
    clock.advance(4)
    tel.end_token()
    rec = tel.snapshot().recent[-1]
    assert (rec.wall, rec.dense, rec.other) == pytest.approx((4e-3, 0.0, 4e-3))


def test_averages_and_rate_cover_recent_decode_records_only(clock):
    tel = Telemetry(history=3, clock=clock)
    tel.begin()
    clock.advance(100)
    tel.end_token(n=8, prefill=True)
    for wall_ms in (10, 20, 30, 40):
        with tel.phase("attention"):
            clock.advance(5)
        clock.advance(wall_ms - 5)
        tel.end_token()
    snap = tel.snapshot()
    assert (snap.tokens, snap.prefill_tokens) == (4, 8)
    assert [r.wall for r in snap.recent] == pytest.approx([20e-3, 30e-3, 40e-3])  # the prefill chunk left the window
    assert snap.averages["wall"] == pytest.approx(30e-3)
    assert snap.averages["attention"] == pytest.approx(5e-3)
    assert snap.averages["other"] == pytest.approx(25e-3)
    assert snap.averages["dense"] == 0.0
    assert snap.tok_per_s == pytest.approx(1 / 30e-3)
    assert set(snap.averages) == {*PHASES, "wall"}


def test_prefill_records_are_kept_apart_from_decode_rates(clock):
    tel = Telemetry(clock=clock)
    tel.begin()
    clock.advance(50)
    tel.end_token(n=16, prefill=True)
    snap = tel.snapshot()
    assert (snap.tokens, snap.prefill_tokens, snap.tok_per_s, snap.averages["wall"]) == (0, 16, 0.0, 0.0)
    assert snap.recent[-1].prefill and snap.recent[-1].n == 16


def test_counters_hit_rate_occupancy_and_gauges(clock):
    tel = Telemetry(clock=clock)
    assert tel.snapshot().hit_rate == 0.0
    tel.hit("pinned", 5)
    tel.hit("cached", 3)
    tel.hit("disk", 2)
    tel.bytes_read(4096)
    tel.prefetch(issued=4, used=3, wasted=1)
    tel.set_occupancy("cached", 1 << 20)
    tel.set_gauge("rss", 123.5)
    tel.end_token()
    tel.hit("disk")
    tel.end_token()
    snap = tel.snapshot()
    assert dict(snap.hits) == {"pinned": 5, "cached": 3, "disk": 3}
    assert snap.hit_rate == pytest.approx(8 / 11)
    assert (snap.bytes_read, snap.prefetch_issued, snap.prefetch_used, snap.prefetch_wasted) == (4096, 4, 3, 1)
    assert dict(snap.occupancy) == {"pinned": 0, "cached": 1 << 20, "disk": 0}
    assert dict(snap.gauges) == {"rss": 123.5}


def test_counts_show_at_token_boundaries_or_flush(clock):
    tel = Telemetry(clock=clock)
    tel.hit("pinned")
    tel.set_occupancy("pinned", 10)
    assert tel.snapshot().hits["pinned"] == 0  # not committed yet
    tel.flush()
    snap = tel.snapshot()
    assert (snap.hits["pinned"], snap.occupancy["pinned"], snap.tokens, snap.recent) == (1, 10, 0, ())


def test_unknown_names_are_refused_with_the_choices():
    tel = Telemetry()
    with pytest.raises(ValueError, match="expected one of"):
        tel.phase("attn")
    with pytest.raises(ValueError, match="expected one of"):
        tel.add_time("other", 1.0)  # "other" is derived, never timed
    with pytest.raises(ValueError, match="expected one of"):
        tel.set_occupancy("ssd", 1)
    with pytest.raises(KeyError):
        tel.hit("ssd")


def test_heat_halves_after_the_half_life_and_current_is_the_latest_token(clock):
    tel = Telemetry(n_layers=2, n_experts=4, heat_half_life=8, clock=clock)
    tel.route(0, np.array([1, 2]))
    tel.route(1, [3, 0])
    tel.end_token()
    snap = tel.snapshot()
    np.testing.assert_array_equal(snap.heat, [[0, 1, 1, 0], [1, 0, 0, 1]])
    assert snap.current == ((0, (1, 2)), (1, (3, 0)))  # in routing order
    for _ in range(8):
        tel.end_token()
    snap = tel.snapshot()
    np.testing.assert_allclose(snap.heat, [[0, 0.5, 0.5, 0], [0.5, 0, 0, 0.5]], rtol=1e-6)
    assert snap.current == ()  # the latest token routed nothing
    tel.route(0, [2])
    tel.end_token(n=8)  # a chunk of 8 decays by 8 tokens, then adds its own counts
    np.testing.assert_allclose(tel.snapshot().heat[0], [0, 0.25, 1.25, 0], rtol=1e-6)
    assert tel.snapshot().heat.dtype == np.float32


def test_route_copies_the_ids_and_counts_every_row_of_a_chunk(clock):
    tel = Telemetry(n_layers=1, n_experts=4, heat_half_life=float("inf"), clock=clock)
    ids = np.array([[0, 1], [1, 2], [1, -1]])  # [T, k]; -1 is padding
    tel.route(0, ids)
    ids[:] = 3  # the engine reuses its buffer before end_token
    tel.end_token(n=3, prefill=True)
    snap = tel.snapshot()
    np.testing.assert_array_equal(snap.heat, [[1, 3, 1, 0]])
    assert snap.current == ((0, (1,)),)  # the last token's row, padding dropped


def test_heat_matches_a_plain_decay_and_count_reference(clock):
    """Lazy decay, batched folding and renormalisation (half-life 1.5 over 400 tokens) change nothing."""
    rng = np.random.default_rng(0)
    L, E, half_life = 3, 6, 1.5
    tel = Telemetry(n_layers=L, n_experts=E, heat_half_life=half_life, clock=clock)
    ref = np.zeros((L, E))
    for step in range(400):
        n = int(rng.integers(1, 4))
        ref *= 0.5 ** (n / half_life)
        for layer in range(L):
            ids = rng.integers(-1, E, size=(n, 2)) if n > 1 else rng.integers(-1, E, size=2)  # -1: padding
            tel.route(layer, ids)
            np.add.at(ref[layer], ids[ids >= 0], 1)
        tel.end_token(n=n, prefill=n > 1)
        if step % 97 == 0 or step == 399:  # snapshots between long runs of unfolded tokens
            np.testing.assert_allclose(tel.snapshot().heat, ref, rtol=1e-5, atol=1e-30)


def test_heat_is_sized_on_first_use_when_the_shape_is_not_given(clock):
    tel = Telemetry(heat_half_life=float("inf"), clock=clock)
    tel.route(2, [5])
    tel.end_token()
    tel.route(0, [7])
    tel.end_token()
    heat = tel.snapshot().heat
    assert heat.shape == (3, 8)
    assert (heat[2, 5], heat[0, 7], heat.sum()) == (1, 1, 2)


def test_snapshot_is_immutable_and_independent_of_later_updates(clock):
    tel = Telemetry(n_layers=1, n_experts=2, clock=clock)
    tel.hit("pinned")
    tel.route(0, [1])
    tel.set_gauge("kv", 1.0)
    tel.end_token()
    snap = tel.snapshot()
    assert tel.snapshot() is snap  # nothing changed: the same object is shared
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.tokens = 5
    with pytest.raises(ValueError):
        snap.heat[0, 0] = 9.0
    with pytest.raises(TypeError):
        snap.hits["pinned"] = 9
    with pytest.raises(TypeError):
        snap.gauges["kv"] = 9.0
    for _ in range(3):
        tel.hit("pinned")
        tel.route(0, [0])
        tel.set_gauge("kv", 2.0)
        tel.set_occupancy("pinned", 7)
        tel.end_token()
    assert (snap.tokens, snap.hits["pinned"], snap.gauges["kv"], snap.occupancy["pinned"], len(snap.recent)) == (1, 1, 1.0, 0, 1)
    np.testing.assert_array_equal(snap.heat, [[0, 1]])
    assert snap.current == ((0, (1,)),)
    later = tel.snapshot()
    assert later.seq == snap.seq + 3 and later.tokens == 4 and not np.shares_memory(later.heat, snap.heat)


def test_subscribe_delivers_at_end_token_until_closed(clock):
    tel = Telemetry(clock=clock)
    got: list[Snapshot] = []
    with tel.subscribe(got.append) as sub:
        tel.end_token()
        tel.end_token()
    tel.end_token()
    sub.close()  # idempotent
    assert [s.tokens for s in got] == [1, 2]
    assert [s.seq for s in got] == [1, 2]
    assert sub.closed


def test_min_interval_throttles_and_flush_delivers_the_last_state(clock):
    tel = Telemetry(clock=clock)
    got: list[int] = []
    tel.subscribe(lambda s: got.append(s.tokens), min_interval=1 / 30)
    for _ in range(10):
        clock.advance(10)
        tel.end_token()
    assert got == [1, 5, 9]  # 40 ms apart on a 10 ms token, the first at once
    tel.flush()
    assert got == [1, 5, 9, 10]
    tel.flush()  # nothing new for it: no second delivery
    assert got == [1, 5, 9, 10]


def test_a_raising_callback_never_breaks_generation_and_is_dropped(clock):
    tel = Telemetry(clock=clock)
    good: list[int] = []

    def bad(snap: Snapshot) -> None:
        raise RuntimeError("view is gone")

    bad_sub = tel.subscribe(bad)
    tel.subscribe(lambda s: good.append(s.tokens))
    for _ in range(5):
        tel.end_token()
    assert good == [1, 2, 3, 4, 5]
    assert bad_sub.closed and bad_sub.failures == Telemetry.MAX_FAILURES == tel.callback_errors
    assert isinstance(bad_sub.last_error, RuntimeError)


def test_one_failure_is_forgiven_when_the_next_call_succeeds(clock):
    tel = Telemetry(clock=clock)
    calls = []

    def flaky(snap: Snapshot) -> None:
        calls.append(snap.tokens)
        if snap.tokens % 2:
            raise RuntimeError("odd")

    sub = tel.subscribe(flaky)
    for _ in range(6):
        tel.end_token()
    assert not sub.closed and sub.failures == 3 and len(calls) == 6


def test_close_waits_for_a_running_callback_and_then_it_never_runs():
    tel = Telemetry()
    entered, release = threading.Event(), threading.Event()
    calls = []

    def slow(snap: Snapshot) -> None:
        calls.append(snap.seq)
        entered.set()
        release.wait(5)

    sub = tel.subscribe(slow)
    engine = threading.Thread(target=tel.end_token)
    engine.start()
    assert entered.wait(5)
    closer = threading.Thread(target=sub.close)
    closer.start()
    closer.join(0.05)
    assert closer.is_alive()  # blocked behind the running callback
    release.set()
    closer.join(5)
    engine.join(5)
    tel.end_token()
    assert calls == [1] and sub.closed


def test_snapshots_from_another_thread_are_consistent_during_updates():
    """Every snapshot is a cut at a token boundary: the per-token counts agree with `tokens`."""
    half_life = 32.0
    tel = Telemetry(n_layers=2, n_experts=4, history=64, heat_half_life=half_life)
    n_tokens = 2500  # x (2 hits + bytes + prefetch + gauge + 2 routes + end_token): about 20k updates
    decay = 0.5 ** (1 / half_life)
    problems: list[str] = []
    done = threading.Event()

    def check(s: Snapshot) -> None:
        t = s.tokens
        expect = {"pinned": 2 * t, "cached": 0, "disk": t}
        if dict(s.hits) != expect or s.bytes_read != 100 * t or s.gauges.get("step", 0.0) != t:
            problems.append(f"counts {dict(s.hits)} {s.bytes_read} {dict(s.gauges)} at {t} tokens")
        if (s.prefetch_issued, s.prefetch_used, s.prefetch_wasted) != (2 * t, t, t):
            problems.append(f"prefetch at {t} tokens")
        if len(s.recent) != min(t, 64) or any(r.other < 0 for r in s.recent):
            problems.append(f"{len(s.recent)} records at {t} tokens")
        heat_sum = 4 * (1 - decay**t) / (1 - decay)  # 2 layers x 2 experts per token, each decayed by age
        if not np.isclose(s.heat.sum(), heat_sum, rtol=1e-4):
            problems.append(f"heat {s.heat.sum()} != {heat_sum} at {t} tokens")
        if t and s.current != ((0, (t % 4, (t + 1) % 4)), (1, (3, 0))):
            problems.append(f"current {s.current} at {t} tokens")

    def reader() -> None:
        while not done.is_set():
            check(tel.snapshot())

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, to interleave inside tokens
    try:
        th = threading.Thread(target=reader)
        th.start()
        tel.begin()
        for i in range(1, n_tokens + 1):
            with tel.phase("experts"):
                tel.hit("pinned", 2)
                tel.hit("disk")
                tel.bytes_read(100)
                tel.prefetch(issued=2, used=1, wasted=1)
                tel.route(0, [i % 4, (i + 1) % 4])
                tel.route(1, np.array([3, 0]))
            tel.set_gauge("step", i)
            tel.end_token()
        done.set()
        th.join(10)
    finally:
        sys.setswitchinterval(old)
    check(tel.snapshot())
    assert not problems, problems[:5]
    assert tel.snapshot().tokens == n_tokens


def test_to_dict_is_json_with_rounded_heat(clock):
    tel = Telemetry(n_layers=1, n_experts=3, heat_half_life=3.0, clock=clock)
    tel.route(0, np.array([0, 2], dtype=np.int32))
    tel.hit("cached", np.int64(2))
    tel.set_occupancy("pinned", np.int64(5))
    tel.set_gauge("recall", np.float32(0.75))
    clock.advance(10)
    tel.end_token()
    tel.end_token()
    d = json.loads(json.dumps(tel.snapshot().to_dict()))
    assert d["heat"] == [[0.7937, 0.0, 0.7937]]
    assert d["current"] == []
    assert d["hits"]["cached"] == 2 and d["occupancy"]["pinned"] == 5 and d["gauges"]["recall"] == 0.75
    assert d["recent"][0]["wall"] == pytest.approx(0.01) and d["tokens"] == 2
    assert len(tel.snapshot().to_dict(recent=1)["recent"]) == 1
    assert tel.snapshot().to_dict(recent=0)["recent"] == []


def test_from_dict_inverts_to_dict_through_json(clock):
    tel = Telemetry(n_layers=2, n_experts=3, heat_half_life=4.0, clock=clock)
    tel.begin()
    with tel.phase("attention"):
        clock.advance(2)
    tel.route(0, np.array([[0, 2], [1, 2]], np.int32))
    tel.end_token(n=2, prefill=True)
    for i in range(3):
        with tel.phase("experts"):
            clock.advance(1 + i)
            with tel.phase("io_wait"):
                clock.advance(0.5)
        tel.route(0, [i, 2])
        tel.route(1, [1, -1])
        tel.hit("disk")
        tel.hit("cached", 2)
        tel.bytes_read(4096)
        tel.prefetch(issued=2, used=1, wasted=1)
        tel.set_occupancy("cached", 1 << 20)
        tel.set_gauge("budget", 123456789.0)
        tel.end_token()
    snap = tel.snapshot()
    back = Snapshot.from_dict(json.loads(json.dumps(snap.to_dict())))
    for name in Snapshot.__dataclass_fields__:
        if name != "heat":
            want, got = getattr(snap, name), getattr(back, name)
            assert (dict(got) if isinstance(got, MappingProxyType) else got) == (
                dict(want) if isinstance(want, MappingProxyType) else want), name
    assert back.recent[0] == snap.recent[0] and back.recent[0].prefill and back.recent[0].n == 2
    assert back.current == ((0, (2, 2)), (1, (1,)))
    assert back.heat.dtype == np.float32 and back.heat.shape == (2, 3) and not back.heat.flags.writeable
    np.testing.assert_allclose(back.heat, snap.heat, atol=1e-4)     # to_dict rounds heat to 4 decimals
    assert isinstance(back.hits, MappingProxyType) and isinstance(back.gauges, MappingProxyType)
    assert back.to_dict() == json.loads(json.dumps(snap.to_dict()))  # and it goes back out unchanged
    # the last `recent` records only, and a model without experts
    assert Snapshot.from_dict(snap.to_dict(recent=2)).recent == snap.recent[-2:]
    empty = Snapshot.from_dict(json.loads(json.dumps(Telemetry().snapshot().to_dict())))
    assert empty.heat.shape == (0, 0) and empty.recent == () and empty.tokens == 0


def test_from_dict_names_what_is_missing_or_malformed(clock):
    d = Telemetry(n_layers=1, n_experts=2, clock=clock).snapshot().to_dict()
    with pytest.raises(ValueError, match="'gauges'"):
        Snapshot.from_dict({k: v for k, v in d.items() if k != "gauges"})
    with pytest.raises(ValueError, match="heat"):
        Snapshot.from_dict({**d, "heat": [1.0, 2.0]})
    with pytest.raises(ValueError, match="malformed"):
        Snapshot.from_dict({**d, "hits": [1, 2]})


def test_reset_forgets_counts_and_heat_but_keeps_states(clock):
    tel = Telemetry(n_layers=1, n_experts=2, clock=clock)
    tel.hit("disk")
    tel.route(0, [1])
    tel.set_occupancy("cached", 3)
    tel.end_token()
    seq = tel.snapshot().seq
    tel.reset()
    snap = tel.snapshot()
    assert (snap.tokens, snap.hits["disk"], snap.recent, snap.current, snap.heat.sum()) == (0, 0, (), (), 0)
    assert snap.occupancy["cached"] == 3 and snap.seq == seq + 1


def test_disabled_telemetry_does_nothing():
    got = []
    for tel in (NULL, Telemetry(n_layers=2, n_experts=2, enabled=False)):
        assert not tel.enabled
        sub = tel.subscribe(got.append)
        tel.begin()
        with tel.phase("attention"):
            tel.route(0, [1])
            tel.hit("pinned")
        with tel.phase("not-a-phase"):
            pass
        tel.add_time("io_wait", 1.0)
        tel.bytes_read(10)
        tel.prefetch(issued=1)
        tel.set_occupancy("cached", 1)
        tel.set_gauge("x", 1.0)
        tel.end_token()
        tel.flush()
        tel.reset()
        snap = tel.snapshot()
        assert (snap.seq, snap.tokens, snap.recent, snap.hits["pinned"], snap.heat.sum()) == (0, 0, (), 0, 0)
        sub.close()
    assert got == []
    assert Telemetry().enabled and set(Telemetry().snapshot().hits) == set(TIERS)
