"""The inspector's Time tab (pytest-qt, offscreen): one stacked bar per record, the averages, a scale for the
decoded tokens that cuts a prompt's spike, and round tick labels.

Snapshots come from a real `Telemetry` driven by a fake clock (`support.inspector`).
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before pytest-qt makes the QApplication

import pytest

from engine.telemetry import PHASES
from support.inspector import (
    Generation,
    no_leftovers,  # noqa: F401 - an autouse fixture
    redraw,
)
from ui.inspector.common import fmt_ms


def test_time_draws_one_stacked_bar_per_record_and_the_averages(qtbot, inspector):
    gen = Generation()
    gen.prefill(5)
    gen.decode(12)
    snap = gen.tel.snapshot()
    inspector.tabs.setCurrentWidget(inspector.time)
    inspector.set_snapshot(snap)
    redraw(qtbot, inspector)

    view = inspector.time
    assert view.bar_count() == len(snap.recent) == 13
    att, dense = view.bars["attention"].opts, view.bars["dense"].opts
    assert att["height"][0] == pytest.approx(3.0)     # the prompt chunk, per token: 15 ms / 5
    assert att["height"][-1] == pytest.approx(2.0)
    assert dense["y0"][-1] == pytest.approx(2.0)      # stacked on attention
    assert view.bars["other"].opts["y0"][-1] == pytest.approx(9.5)
    assert len(view.prefill_marks.data) == 1
    for p in PHASES:
        assert view.averages[p].text() == fmt_ms(snap.averages[p])
    assert view.averages["io_wait"].text() == "4.0 ms"
    assert view.shares["io_wait"].text() == "40.0%"
    assert view.mean_line.value() == pytest.approx(10.0)


def test_time_scales_to_decoded_tokens_and_cuts_a_prompt_spike(qtbot, inspector):
    gen = Generation()
    with gen.tel.phase("attention"):                  # a slow first prompt chunk: 400 ms per token
        gen.clock.advance(400 * 8)
    gen.tel.end_token(n=8, prefill=True)
    gen.decode(30)
    inspector.resize(900, 600)
    inspector.tabs.setCurrentWidget(inspector.time)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)

    view = inspector.time
    # decoded bars are 10 ms: the scale leaves them room (twice the mean), not the 400 ms spike
    assert view.scale == 25.0
    assert view.plot.getPlotItem().getViewBox().viewRange()[1] == pytest.approx([0.0, 25.0])
    assert len(view.clip_marks.data) == 1 and view.clip_marks.data["x"][0] < 1
    assert "; 1 bar cut at the top (arrow), 400.0 ms" in view.total.text()
    # the bars use the tab's width; the table sits under them
    assert view.plot.width() > 0.9 * view.width()


def test_time_axes_carry_a_few_round_tick_labels(qtbot, inspector):
    gen = Generation()
    gen.prefill(50)
    gen.decode(300)
    inspector.tabs.setCurrentWidget(inspector.time)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)
    item = inspector.time.plot.getPlotItem()
    qtbot.waitUntil(lambda: inspector.time.bar_count() == 301, timeout=3000)
    for name, most in (("bottom", 6), ("left", 5)):
        axis = item.getAxis(name)
        low, high = axis.range
        labelled = axis.tickValues(low, high, axis.height() if name == "left" else axis.width())[0][1]
        assert 2 <= len(labelled) <= most + 1, (name, labelled)


def _decoded(qtbot, inspector, n: int) -> None:
    """The Time tab shown with N decoded tokens' records."""
    gen = Generation()
    gen.decode(n)
    inspector.tabs.setCurrentWidget(inspector.time)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)


def test_a_few_records_are_counted_in_whole_records(qtbot, inspector):
    # three decoded tokens were labelled 0, 0.5, 1, 1.5 ... records
    _decoded(qtbot, inspector, 3)
    qtbot.waitUntil(lambda: inspector.time.bar_count() == 3, timeout=3000)
    bottom = inspector.time.plot.getPlotItem().getAxis("bottom")
    levels = bottom.tickValues(*bottom.range, bottom.width())
    assert levels and all(float(v).is_integer() for _, values in levels for v in values), levels


def test_time_with_no_records_says_so_after_a_model_with_some(qtbot, inspector):
    # a model opened after another, its Time tab shown before any question: no bars, no stale mean, no error
    _decoded(qtbot, inspector, 5)
    assert inspector.time.bar_count() == 5
    inspector.set_snapshot(Generation().tel.snapshot())
    qtbot.waitUntil(lambda: inspector.time.bar_count() == 0, timeout=3000)     # the next tick that plots
    assert inspector.time.total.text() == "no decoded tokens yet"


def test_time_before_any_record_shows_axes_of_whole_ms_and_records(qtbot, inspector):
    # a fresh Time tab showed pyqtgraph's 0..1: "0.1 ... 0.9 ms per token" over fractions of a record
    view = inspector.time
    inspector.tabs.setCurrentWidget(view)
    item = view.plot.getPlotItem()
    left, bottom = item.getAxis("left"), item.getAxis("bottom")
    qtbot.waitUntil(lambda: left.height() > 0 and bottom.width() > 0, timeout=3000)

    def check() -> None:
        x_range, y_range = item.getViewBox().viewRange()
        assert y_range == pytest.approx([0.0, 100.0]) and x_range == pytest.approx([0.0, 10.0])
        for axis, length in ((left, left.height()), (bottom, bottom.width())):
            labelled = axis.tickValues(*axis.range, length)[0][1]
            assert len(labelled) >= 2 and all(float(v).is_integer() for v in labelled), labelled
        assert view.bar_count() == 0 and view.total.text() == "no decoded tokens yet"

    check()
    inspector.set_snapshot(Generation().tel.snapshot())     # a model loaded, nothing asked yet
    redraw(qtbot, inspector)
    check()
