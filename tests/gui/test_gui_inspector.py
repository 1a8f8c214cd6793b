"""The inspector as a whole (pytest-qt, offscreen): figures follow every snapshot while views redraw on timer
ticks and plots at most PLOT_HZ, the theme follows the palette, and closed views stop every timer.

Snapshots come from a real `Telemetry` driven by a fake clock (`support.inspector`). The tabs have their own
modules: test_gui_inspector_overview, _time, _brain, _story (selection, an expert's story, replay, comparison),
_atlas, and test_gui_cache_meter.
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before pytest-qt makes the QApplication

from PySide6.QtCore import QTimer
from PySide6.QtGui import QColor, QPalette

from support.inspector import (
    MB,
    Generation,
    no_leftovers,  # noqa: F401 - an autouse fixture
    redraw,
)
from ui.inspector import Inspector
from ui.inspector import inspector as inspector_module
from ui.inspector.common import PLOT_HZ


def test_figures_follow_every_snapshot_and_plots_at_most_plot_hz(qtbot, inspector, monkeypatch):
    now = [1000.0]

    class Clock:  # the inspector's time.monotonic, moved only by the test
        @staticmethod
        def monotonic() -> float:
            return now[0]

    monkeypatch.setattr(inspector_module, "time", Clock)
    gen = Generation()
    overview = inspector.overview
    gen.decode(1)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)                        # the first snapshot is plotted at once
    plotted = inspector.replots
    assert len(overview.pinned_curve.getData()[0]) == 1

    for i in range(8):                              # a burst faster than PLOT_HZ
        gen.tel.set_occupancy("pinned", (i + 1) * 10 * MB)
        gen.decode(1)
        inspector.set_snapshot(gen.tel.snapshot())
        redraw(qtbot, inspector)
        assert overview.values["tokens"].text().startswith(f"{gen.t} decoded")  # figures: every snapshot
        now[0] += 0.1 / PLOT_HZ
    assert inspector.replots == plotted             # 0.8 plot intervals: the plots waited
    assert len(overview.pinned_curve.getData()[0]) == 1

    now[0] += 0.3 / PLOT_HZ                         # their turn comes: drawn without a new snapshot
    qtbot.waitUntil(lambda: inspector.replots == plotted + 1, timeout=3000)
    inspector._sampler.stop()                       # (the history's own timer would replot at SAMPLE_HZ)
    qtbot.wait(5 * Inspector.INTERVAL_MS)
    assert inspector.replots == plotted + 1         # and nothing more while nothing changes


def test_views_redraw_on_timer_ticks_not_per_snapshot(qtbot, inspector):
    gen = Generation()
    redraw(qtbot, inspector)                  # the first tick after show
    ticks = inspector.redraws
    for _ in range(20):                       # a burst of tokens between two ticks
        gen.decode(1)
        inspector.set_snapshot(gen.tel.snapshot())
    assert inspector.redraws == ticks
    redraw(qtbot, inspector)
    assert inspector.redraws == ticks + 1     # one redraw for the whole burst
    assert inspector.overview.values["tokens"].text().startswith("20 decoded")
    inspector.set_snapshot(gen.tel.snapshot())  # the same state again: nothing to draw
    qtbot.wait(5 * Inspector.INTERVAL_MS)
    assert inspector.redraws == ticks + 1


def test_the_theme_follows_a_dark_palette(qtbot, inspector):
    assert not inspector.brain.theme.dark
    dark = QPalette(QColor(30, 30, 34))
    inspector.setPalette(dark)
    qtbot.waitUntil(lambda: inspector.brain.theme.dark, timeout=3000)
    assert inspector.time.theme.dark and inspector.overview.theme.dark and inspector.atlas.theme.dark


def test_close_views_stops_every_timer_for_good(qtbot, inspector):
    timers = inspector.findChildren(QTimer)
    assert any(t.isActive() for t in timers)
    inspector.close_views()
    assert not [t for t in inspector.findChildren(QTimer) if t.isActive()]
    inspector.hide()
    inspector.show()                                  # closed views stay closed
    assert not [t for t in inspector.findChildren(QTimer) if t.isActive()]
