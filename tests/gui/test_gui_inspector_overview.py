"""The inspector's Overview (pytest-qt, offscreen): rate, TTFT, hit rates and occupancy, model memory against
the budget and the bar that breaks it down, and the memory history sampled on a timer.

Snapshots come from a real `Telemetry` driven by a fake clock (`support.inspector`).
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before pytest-qt makes the QApplication

import numpy as np
import pytest

from support.inspector import (
    GB,
    MB,
    Generation,
    no_leftovers,  # noqa: F401 - an autouse fixture
    redraw,
)
from support.qt import EVENT_TIMEOUT_MS
from ui.inspector import TIER_DISK
from ui.inspector.common import nice_ceil


def test_overview_shows_rate_ttft_hit_rate_and_occupancy_in_decimal_units(qtbot, inspector):
    gen = Generation()
    gen.tel.set_gauge("ttft", 0.25)
    gen.tel.set_gauge("kv_bytes", 12 * MB)
    gen.tel.set_occupancy("pinned", GB // 2)
    gen.tel.set_occupancy("cached", GB // 4)
    gen.tel.set_occupancy("disk", 3 * GB)
    gen.decode(10, hits=(3, 1, 4))
    inspector.set_model_info(4, 8, 2 * GB)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)

    overview = inspector.overview
    v = overview.values
    assert v["tok_per_s"].text() == "100.0 tok/s"  # 10 ms per token on the fake clock
    assert v["ttft"].text() == "250.0 ms"
    assert v["hit_rate"].text() == "50.0%"         # (3 pinned + 1 cached) of 8
    assert v["kv"].text() == "12.00 MB"
    assert v["model"].text() == "—"                # no RSS reported
    assert "budget 2.00 GB (model memory not reported)" in overview.budget_bar.format()
    # the plots count in MB, plain numbers on a plain axis (no "x0.001" scale)
    mem_axis = overview.memory_plot.getPlotItem().getAxis("left")
    assert mem_axis.label.toPlainText().strip() == "MB in memory"
    assert overview.pinned_curve.getData()[1][-1] == pytest.approx(500)
    assert overview.cached_curve.getData()[1][-1] == pytest.approx(750)     # stacked on pinned
    assert overview.budget_curve.getData()[1][-1] == pytest.approx(2000)
    assert overview.disk_curve.getData()[1][-1] == pytest.approx(3000)
    assert overview.memory_plot.getPlotItem().getViewBox().viewRange()[1] == [0, nice_ceil(2000 * 1.05)]

    # no budget from the main window: the "budget" gauge is used
    inspector.set_model_info(4, 8, None)
    gen.tel.set_gauge("budget", 3 * GB)
    gen.decode(1)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)
    assert "budget 3.00 GB" in overview.budget_bar.format()


def test_overview_sets_model_memory_against_the_budget_and_shows_the_baseline_apart(qtbot, inspector):
    gen = Generation()
    gen.tel.set_gauge("rss_baseline", 400 * MB)    # the interpreter and libraries, before loading
    gen.tel.set_gauge("rss", 1_900 * MB)
    gen.decode(3)
    inspector.set_model_info(4, 8, 2 * GB)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)

    overview = inspector.overview
    assert overview.values["model"].text() == "1.50 GB"         # 1.9 GB RSS - 0.4 GB baseline
    assert overview.values["baseline"].text() == "400.00 MB"
    bar = overview.budget_bar
    assert bar.format() == "model memory 1.50 GB of the 2.00 GB budget (75.0%)"
    assert bar.value() == 750
    assert overview.model_curve.getData()[1][-1] == pytest.approx(1500)   # MB, against the budget line
    assert overview.budget_curve.getData()[1][-1] == pytest.approx(2000)

    # over the budget: the bar is full and the text says by how much
    gen.tel.set_gauge("rss", 2_600 * MB)
    gen.decode(1)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)
    assert bar.format() == ("model memory 2.20 GB of the 2.00 GB budget (110.0%): over by 200.00 MB, "
                            "the most in scratch (2.20 GB)")
    assert bar.value() == 1000 and bar.state == "over"


def test_the_budget_bar_stacks_what_model_memory_is_made_of_and_warns_near_and_over(qtbot, inspector):
    gen = Generation()
    gen.tel.set_gauge("rss_baseline", 400 * MB)
    gen.tel.set_gauge("rss", 400 * MB + 880 * MB)   # model memory 880 MB of a 1 GB budget: 88%
    gen.tel.set_gauge("dense_bytes", 300 * MB)
    gen.tel.set_gauge("kv_bytes", 180 * MB)
    gen.tel.set_gauge("working_bytes", 50 * MB)
    gen.tel.set_occupancy("pinned", 100 * MB)
    gen.tel.set_occupancy("cached", 200 * MB)
    gen.decode(1)
    inspector.set_model_info(4, 8, GB)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)
    bar = inspector.overview.budget_bar
    parts = bar.parts
    assert (parts.dense, parts.experts, parts.kv, parts.scratch) == (300 * MB, 300 * MB, 180 * MB, 100 * MB)
    assert bar.state == "ok" and bar.format() == "model memory 880.00 MB of the 1.00 GB budget (88.0%)"
    tip = bar.toolTip()
    for line in ("dense weights: 300.0 MB", "cached experts: 300.0 MB", "KV cache: 180.0 MB", "scratch: 100.0 MB",
                 "planned working buffers: 50.0 MB", "budget: 1,000.0 MB"):
        assert line in tip

    gen.tel.set_gauge("rss", 400 * MB + 950 * MB)   # 95%: amber
    gen.decode(1)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)
    assert bar.state == "near" and bar.format().endswith("(95.0%)")

    gen.tel.set_gauge("kv_bytes", 600 * MB)          # earlier chats' KV grew past the budget: red, and it says so
    gen.tel.set_gauge("rss", 400 * MB + 1_300 * MB)
    gen.decode(1)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)
    assert bar.state == "over"
    assert bar.format().endswith("(130.0%): over by 300.00 MB, the most in KV cache (600.00 MB)")
    image = bar.grab().toImage()                     # painted: the frame is red
    assert image.pixelColor(1, bar.height() // 4).red() > 150


def test_the_history_is_sampled_on_a_timer_as_steps_so_idle_time_stays_flat(qtbot, inspector, monkeypatch):
    from ui.inspector.overview import SAMPLE_HZ

    gen = Generation()
    gen.tel.set_occupancy("cached", 100 * MB)
    gen.decode(1)
    inspector.set_model_info(4, 8, GB)
    inspector.set_snapshot(gen.tel.snapshot())
    overview = inspector.overview
    # no new data: the timer keeps sampling, at SAMPLE_HZ, the same value
    qtbot.waitUntil(lambda: len(overview.history) >= 4, timeout=EVENT_TIMEOUT_MS)
    h = overview.history.samples()
    assert np.all(h[:, 2] == 100 * MB)
    gaps = np.diff(h[1:, 0])                          # (the first sample came with the first tick)
    assert np.all(gaps > 0.5 / SAMPLE_HZ) and np.all(gaps < 3 / SAMPLE_HZ)
    # one change: drawn as a step at its sample, flat before and after
    gen.tel.set_occupancy("cached", 300 * MB)
    gen.decode(1)
    inspector.set_snapshot(gen.tel.snapshot())
    n = len(overview.history)
    qtbot.waitUntil(lambda: len(overview.history) >= n + 3, timeout=EVENT_TIMEOUT_MS)
    qtbot.waitUntil(lambda: len(overview.cached_curve.getData()[0]) >= n + 3, timeout=EVENT_TIMEOUT_MS)
    assert overview.cached_curve.opts["stepMode"] == "right"
    path = overview.cached_curve.curve.getPath()      # the drawn path: vertical at the change, no slope
    x, y = (np.array([getattr(path.elementAt(i), a) for i in range(path.elementCount())]) for a in "xy")
    assert not np.any((np.diff(x) != 0) & (np.diff(y) != 0))   # steps only: every segment flat or vertical
    assert set(np.unique(y).tolist()) == {0, 100, 300}          # (0: the fill's baseline), MB


def test_the_recent_hit_rate_covers_the_last_64_tokens(qtbot, inspector):
    gen = Generation()
    gen.decode(100, hits=(0, 0, 8))                   # a cold start: every expert read from disk
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)
    v = inspector.overview.values
    for _ in range(8):                                # then the cache serves: 16 tokens at a time
        gen.decode(16, hits=(4, 4, 0))
        inspector.set_snapshot(gen.tel.snapshot())
        redraw(qtbot, inspector)
    assert v["hit_recent"].text() == "100.0%"         # the last 64 tokens were all hits
    assert v["hit_rate"].text() != "100.0%"           # the cumulative rate remembers the cold start


def test_a_long_history_keeps_its_latest_samples_and_is_plotted_with_its_peaks():
    from ui.inspector.overview import MODEL, PINNED, POINTS, History, T, envelope

    history = History(size=9000)
    for i in range(9100):                           # more than it keeps: the oldest go
        history.append((i / 30, 5e8 + (7e9 if i == 4321 else 0), 0, 0, 1e9 if 3000 <= i < 3100 else np.nan, 2e9))
    samples = history.samples()
    assert len(history) == 9000 and samples[0, T] == pytest.approx(100 / 30) and samples[-1, T] == pytest.approx(9099 / 30)
    plotted = envelope(samples, POINTS)             # a few hundred pixels wide: at most POINTS points
    assert len(plotted) <= POINTS and plotted[-1, T] == samples[-1, T]
    assert plotted[:, PINNED].max() == 7.5e9        # a one-sample spike survives
    assert np.nanmax(plotted[:, MODEL]) == 1e9 and np.isnan(plotted[:, MODEL]).any()  # gaps stay gaps


@pytest.mark.parametrize("dark", [False, True])
def test_overview_fills_the_disk_in_the_colour_of_the_brains_disk_cells(qtbot, inspector, dark):
    # the walkthrough saw "MB on disk" grey beside the Brain's slate disk cells
    from ui.theme import palette

    inspector.setPalette(palette(dark))
    inspector.set_model_info(4, 8, 2 * GB)
    inspector.set_tiers(np.full((4, 8), TIER_DISK, np.int8))       # an untouched model: every expert on disk, cold
    gen = Generation(4, 8)
    gen.tel.set_occupancy("disk", GB)
    inspector.tabs.setCurrentWidget(inspector.brain)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)
    brain = inspector.brain
    qtbot.waitUntil(lambda: brain.rgba is not None, timeout=3000)
    cells = {tuple(int(c) for c in px) for px in brain.rgba[..., :3].reshape(-1, 3)}
    assert len(cells) == 1 and inspector.overview.theme.dark == dark
    fill = inspector.overview.disk_curve.opts["fillBrush"].color()
    assert (fill.red(), fill.green(), fill.blue()) == cells.pop()
