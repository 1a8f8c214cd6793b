"""The Cache tab (pytest-qt, offscreen): the meter shows what a replay of a real store's trace computes, off the
GUI thread, again for a newer trace, never while hidden, and leaves no thread behind."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before pytest-qt makes the QApplication

import numpy as np
import pytest

from engine.offload.quality import cache_quality
from support.offload import greedy_logits, load_streamed, mixtral_container
from support.qt import no_leftovers  # noqa: F401 - an autouse fixture
from ui.inspector import cache as cache_module
from ui.inspector.common import fmt_percent

N_EXPERTS, TOP_K, LAYERS = 8, 2, 3


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Two traces of a real store (LFRU, 4 slots, read-ahead on): after 8 tokens and after 16."""
    container = mixtral_container(tmp_path_factory, N_EXPERTS, TOP_K, LAYERS)
    loaded = load_streamed(container, 4, policy="lfru")
    try:
        greedy_logits(loaded, [3, 17, 5, 99], 4, batch_prompt=False)
        first = loaded.store.cache_trace()
        greedy_logits(loaded, [42, 8, 23, 61, 7, 150, 12, 33], 8, batch_prompt=False)
        return first, loaded.store.cache_trace()
    finally:
        loaded.close()


def test_the_meter_shows_the_replay_of_a_real_trace(qtbot, inspector, traces):
    trace = traces[1]
    expected = cache_quality(trace)
    ours, best = expected.at(trace.capacity)
    assert trace.live_hit_rate is not None and 0 < best < 1
    view = inspector.cache
    inspector.set_cache_trace(trace)
    with qtbot.waitSignal(view.replayed, timeout=30_000):
        inspector.tabs.setCurrentWidget(view)
    qtbot.waitUntil(lambda: view.replays == 1, timeout=3000)
    assert view.figures["live"].text() == fmt_percent(trace.live_hit_rate)
    assert view.figures["policy"].text() == fmt_percent(ours)
    assert view.figures["optimum"].text() == fmt_percent(best)
    assert view.figures["share"].text() == fmt_percent(ours / best)
    x, y = view.policy_curve.getData()
    assert np.allclose(x, expected.capacities * trace.slot_bytes / cache_module.MB)
    assert np.allclose(y, 100 * expected.policy)
    assert np.allclose(view.optimum_curve.getData()[1], 100 * expected.optimum)
    assert view.marker.isVisible() and view.marker.value() == pytest.approx(4 * trace.slot_bytes / cache_module.MB)
    assert f"{trace.requests} expert requests" in view.status.text()


def test_a_newer_trace_is_replayed_in_turn_and_none_while_hidden(qtbot, inspector, traces, monkeypatch):
    monkeypatch.setattr(cache_module, "REPLAY_S", 0.2)
    first, second = traces
    view = inspector.cache
    inspector.tabs.setCurrentWidget(inspector.overview)
    drawn = inspector.redraws
    inspector.set_cache_trace(first)
    qtbot.waitUntil(lambda: inspector.redraws > drawn, timeout=3000)   # a tick drew it, with the Cache tab out of view
    assert view.replays == 0 and view._worker is None and not view._later.isActive()
    inspector.tabs.setCurrentWidget(view)
    qtbot.waitUntil(lambda: view.replays == 1, timeout=30_000)
    assert view.figures["live"].text() == fmt_percent(first.live_hit_rate)
    inspector.set_cache_trace(second)                   # the next replay waits for REPLAY_S after the first began
    qtbot.waitUntil(lambda: view.replays == 2, timeout=30_000)
    assert view.quality.requests == second.requests
    assert view.figures["optimum"].text() == fmt_percent(cache_quality(second).at(second.capacity)[1])
    inspector.forget_model()                            # the model went: nothing to show
    assert view.figures["live"].text() == "—" and not view.marker.isVisible()


def test_closing_during_a_replay_stops_and_joins_it(qtbot, inspector, traces):
    view = inspector.cache
    inspector.set_cache_trace(traces[1])
    inspector.tabs.setCurrentWidget(view)
    qtbot.waitUntil(lambda: view._worker is not None or view.replays > 0, timeout=3000)
    inspector.close_views()
    assert view._worker is None
    replays = view.replays
    inspector.set_cache_trace(traces[0])
    view.redraw(None)                                   # as a tick would (closed views have no timer left)
    assert view._worker is None and not view._later.isActive() and view.replays == replays
