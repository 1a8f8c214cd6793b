"""The inspector (pytest-qt, offscreen): figures, bars, the Brain grid, selection, the atlas offer, cleanup.

Snapshots come from a real `Telemetry` driven by a fake clock; atlases from `app.atlas.build.build_atlas`.
The Atlas's 3D canvas needs OpenGL, which the offscreen platform lacks: `test_atlas_renders_under_xvfb`
runs the `gl_*` checks below in a child pytest on the Xvfb display that pytest-xvfb started.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before pytest-qt makes the QApplication

import numpy as np
import pytest
from PySide6.QtCore import QCoreApplication, QEvent, QPoint, QPointF, Qt, QTimer
from PySide6.QtGui import QColor, QPalette
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QToolButton, QToolTip

from app.atlas.build import build_atlas
from app.atlas.probes import ProbeTopic
from engine.offload.story import ExpertLog
from engine.spec import MoESpec
from engine.telemetry import PHASES, Telemetry
from ui.inspector import (
    TIER_CACHED,
    TIER_DISK,
    TIER_NONE,
    TIER_PINNED,
    TIER_RESIDENT,
    Inspector,
    resident_tiers,
    tiers_from_store,
)
from ui.inspector import inspector as inspector_module
from ui.inspector.brain import BrainView
from ui.inspector.common import PLOT_HZ, fmt_ms, fmt_percent, nice_ceil, theme_for

REPO = Path(__file__).resolve().parents[2]
MS = 1_000_000  # ns
GB, MB = 10**9, 10**6  # decimal, as `--max-memory` and the app count


class FakeClock:
    """A perf_counter_ns stand-in that moves only when told."""

    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns

    def advance(self, ms: float) -> None:
        self.ns += int(ms * MS)


class Generation:
    """Drives a Telemetry like the engine would: 10 ms per decoded token, two experts per layer."""

    def __init__(self, n_layers: int = 4, n_experts: int = 8, history: int = 512):
        self.n_layers, self.n_experts = n_layers, n_experts
        self.clock = FakeClock()
        self.tel = Telemetry(n_layers, n_experts, history=history, clock=self.clock)
        self.t = 0
        self.tel.begin()

    def routes(self, t: int) -> list[tuple[int, tuple[int, int]]]:
        """The experts token t routes to, per layer."""
        return [(layer, ((t + layer) % self.n_experts, (t + layer + 3) % self.n_experts))
                for layer in range(self.n_layers)]

    def prefill(self, n: int) -> None:
        with self.tel.phase("attention"):
            self.clock.advance(3 * n)
        with self.tel.phase("experts"):
            self.clock.advance(2 * n)
        self.tel.end_token(n=n, prefill=True)

    def decode(self, tokens: int = 1, hits: tuple[int, int, int] = (3, 1, 4)) -> None:
        for _ in range(tokens):
            tel, clock = self.tel, self.clock
            with tel.phase("attention"):
                clock.advance(2)
            with tel.phase("dense"):
                clock.advance(1)
            with tel.phase("experts"):
                for layer, ids in self.routes(self.t):
                    tel.route(layer, np.array(ids))
                for tier, n in zip(("pinned", "cached", "disk"), hits):
                    tel.hit(tier, n)
                with tel.phase("io_wait"):
                    clock.advance(4)
                clock.advance(2)
            with tel.phase("sampling"):
                clock.advance(0.5)
            clock.advance(0.5)  # other
            tel.end_token()
            self.t += 1

    def current(self) -> list[tuple[int, tuple[int, int]]]:
        """The routes of the latest token."""
        return self.routes(self.t - 1)


def tiny_atlas(n_layers: int = 4, n_experts: int = 8, n_topics: int = 3) -> dict:
    """An atlas in the sidecar's format: expert e prefers topic e % n_topics; expert 1 of layer 0 is never chosen."""
    topics = [ProbeTopic(f"topic{t}", f"Topic {t}", ("a b c", "d e f")) for t in range(n_topics)]
    counts = {}
    for layer in range(n_layers):
        c = np.ones((n_experts, n_topics, 2), np.int64)
        for e in range(n_experts):
            c[e, e % n_topics] += 20 + e + layer
        counts[layer] = c
    counts[0][1] = 0
    tokens = np.full((n_topics, 2), 50, np.int64)
    return build_atlas(Path("/models/tiny"), topics, counts, tokens, "0" * 64, "tests")


@pytest.fixture(autouse=True)
def no_leftovers(qtbot):
    """Fail a test that leaves a thread, a visible window or an Inspector (with its timer) behind."""
    before = set(threading.enumerate())
    yield
    # pytest-qt has closed the widgets given to qtbot.addWidget; let their deleteLater run
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    QCoreApplication.processEvents()
    QToolTip.hideText()
    qtbot.waitUntil(lambda: not [w for w in QApplication.topLevelWidgets() if w.isVisible()], timeout=3000)
    assert not [w for w in QApplication.allWidgets() if isinstance(w, Inspector)], "an Inspector outlived its test"
    assert set(threading.enumerate()) <= before, "a thread outlived its test"


def redraw(qtbot, insp: Inspector) -> None:
    """Wait for the next timer tick that redraws."""
    n = insp.redraws
    qtbot.waitUntil(lambda: insp.redraws > n, timeout=3000)


def cell_point(brain: BrainView, layer: int, expert: int) -> QPoint:
    """Viewport pixel at the centre of a Brain cell."""
    scene = brain.plot.getViewBox().mapViewToScene(QPointF(expert + 0.5, layer + 0.5))
    return brain.view.mapFromScene(scene)


# --- Overview and Time -----------------------------------------------------------------------------

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
    qtbot.waitUntil(lambda: len(overview.history) >= 4, timeout=10_000)
    h = overview.history.samples()
    assert np.all(h[:, 2] == 100 * MB)
    gaps = np.diff(h[1:, 0])                          # (the first sample came with the first tick)
    assert np.all(gaps > 0.5 / SAMPLE_HZ) and np.all(gaps < 3 / SAMPLE_HZ)
    # one change: drawn as a step at its sample, flat before and after
    gen.tel.set_occupancy("cached", 300 * MB)
    gen.decode(1)
    inspector.set_snapshot(gen.tel.snapshot())
    n = len(overview.history)
    qtbot.waitUntil(lambda: len(overview.history) >= n + 3, timeout=10_000)
    qtbot.waitUntil(lambda: len(overview.cached_curve.getData()[0]) >= n + 3, timeout=10_000)
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
    assert "1 bars cut at the top" in view.total.text() and "400.0 ms" in view.total.text()
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


# --- Brain ---------------------------------------------------------------------------------------

def test_brain_flashes_the_current_tokens_experts_and_names_a_hovered_cell(qtbot, inspector):
    gen = Generation(4, 8)
    gen.decode(6)
    tiers = np.full((4, 8), TIER_DISK, np.int8)
    tiers[:, :2] = TIER_PINNED
    tiers[:, 2:5] = TIER_CACHED
    inspector.set_model_info(4, 8, 2 * GB)
    inspector.set_tiers(tiers)
    inspector.set_atlas(tiny_atlas(4, 8, 3))
    inspector.tabs.setCurrentWidget(inspector.brain)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)

    brain = inspector.brain
    image = brain.image.image                                  # [L, E, 4] as handed to the ImageItem
    assert image.shape == (4, 8, 4)
    flash = np.array(brain.theme.flash, np.uint8)
    routed = np.zeros((4, 8), bool)
    for layer, ids in gen.current():
        routed[layer, list(ids)] = True
    assert routed.sum() == 8
    assert (image[routed][:, :3] == flash).all()
    assert not (image[~routed][:, :3] == flash).all(axis=1).any()

    # on screen, too (not transposed): the pixel at a routed cell's centre is the flash colour
    layer, (expert, _) = gen.current()[2]
    shot = brain.view.viewport().grab().toImage()
    pixel = shot.pixelColor(cell_point(brain, layer, expert))
    assert (pixel.red(), pixel.green(), pixel.blue()) == tuple(int(c) for c in flash)

    # hover: the tooltip names layer, expert, tier, selections and the atlas topic
    QTest.mouseMove(brain.view.viewport(), cell_point(brain, 3, 1))
    qtbot.waitUntil(lambda: brain.hovered == (3, 1), timeout=3000)
    text = brain.hover_text(3, 1)
    assert text.splitlines()[0] == "layer 3, expert 1"
    assert "tier: pinned" in text
    assert "selections: " in text
    assert "atlas topic: Topic 1" in text                     # expert 1 prefers topic 1
    assert QToolTip.text() == text
    assert "atlas: never chosen by the probes" in brain.hover_text(0, 1)

    # once the answer ends, the last token's experts are history: nothing flashes
    inspector.set_generating(False)
    redraw(qtbot, inspector)
    assert not (brain.image.image[..., :3] == flash).all(axis=-1).any()
    inspector.set_generating(True)
    redraw(qtbot, inspector)
    assert (brain.image.image[routed][:, :3] == flash).all()


def test_brain_colours_follow_tiers_and_heat(qtbot):
    theme = theme_for(QPalette(QColor(250, 250, 250)))
    from ui.inspector.brain import grid_rgba

    tiers = np.array([[TIER_PINNED, TIER_CACHED, TIER_DISK, TIER_NONE]], np.int8)
    heat = np.array([[4.0, 4.0, 4.0, 0.0]], np.float32)
    rgba = grid_rgba(theme, (1, 4), tiers, heat, ())
    assert len({tuple(px) for px in rgba[0, :3]}) == 3          # three tiers, three colours
    cold = grid_rgba(theme, (1, 4), tiers, heat * np.array([[1, 0, 0, 0]], np.float32), ())

    def luma(px: np.ndarray) -> float:
        return float(px[:3].astype(float) @ np.array([0.299, 0.587, 0.114]))

    # hot is brighter than cold for every tier, on the light theme and the dark one (the legend says so)
    for t in (theme, theme_for(QPalette(QColor(30, 30, 30)))):
        hot, chill = grid_rgba(t, (1, 4), tiers, heat, ()), grid_rgba(t, (1, 4), tiers, heat * 0, ())
        for e in range(3):
            assert luma(hot[0, e]) > luma(chill[0, e]) + 40, (t.dark, e)
        hue = np.argmax(t.tiers[TIER_CACHED])                     # the tier's hue stays: green leads when cold too
        assert np.argmax(chill[0, 1, :3]) == hue and np.argmax(hot[0, 1, :3]) == hue
    assert luma(cold[0, 1]) < luma(rgba[0, 1])
    # never routed, an expert in RAM still reads apart from one on disk, on either theme
    for t in (theme, theme_for(QPalette(QColor(30, 30, 30)))):
        frozen = grid_rgba(t, (1, 4), tiers, np.zeros((1, 4), np.float32), ()).astype(int)
        assert np.abs(frozen[0, 1, :3] - frozen[0, 2, :3]).sum() > 100          # cached vs disk
        assert np.abs(frozen[0, 0, :3] - frozen[0, 2, :3]).sum() > 100          # pinned vs disk
    wider = grid_rgba(theme, (2, 6), tiers, heat, ((1, (5, 9)),))  # grids grow; ids outside are ignored
    assert tuple(wider[1, 5, :3]) == theme.flash


def test_the_current_token_is_cleared_when_the_answer_ends_and_the_model_goes(qtbot, inspector):
    gen = Generation()
    gen.decode(3)
    inspector.set_model_info(4, 8, None)
    inspector.set_generating(True)
    inspector.tabs.setCurrentWidget(inspector.brain)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)
    flash = np.array(inspector.brain.theme.flash, np.uint8)
    flashing = lambda: int(np.all(inspector.brain.rgba[..., :3] == flash, axis=-1).sum())  # noqa: E731
    assert flashing() == 8                                # two experts in each of four layers
    inspector.set_generating(False)
    redraw(qtbot, inspector)
    assert flashing() == 0
    inspector.set_generating(True)
    redraw(qtbot, inspector)
    assert flashing() == 8
    inspector.forget_model()                              # unloaded: nothing of it stays, the current token least
    redraw(qtbot, inspector)
    assert inspector.brain.rgba is None and inspector.brain.status.text().startswith("no experts")


def test_brain_labels_whole_layers_and_experts_at_cell_centres_on_256_experts(qtbot, inspector):
    gen = Generation(4, 256)
    gen.decode(2)
    inspector.set_model_info(4, 256, None)
    inspector.tabs.setCurrentWidget(inspector.brain)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)

    brain = inspector.brain
    assert brain.rgba.shape == (4, 256, 4)
    for axis, n, most in (("left", 4, 4), ("bottom", 256, 12)):
        (ticks,) = brain.plot.getAxis(axis)._tickLevels            # what setTicks was given
        labels = [int(label) for _, label in ticks]               # whole indices, never "0.5"
        assert labels[0] == 0 and labels[-1] < n and len(labels) <= most
        assert [pos for pos, _ in ticks] == [i + 0.5 for i in labels]
    # the last expert of the last layer is a cell like any other: hover names it
    QTest.mouseMove(brain.view.viewport(), cell_point(brain, 3, 255))
    qtbot.waitUntil(lambda: brain.hovered == (3, 255), timeout=3000)
    assert brain.hover_text(3, 255).startswith("layer 3, expert 255")


# --- selection between Brain and Atlas -----------------------------------------------------------

def test_selecting_in_the_brain_highlights_in_the_atlas_and_back(qtbot, inspector):
    gen = Generation(4, 8)
    gen.decode(2)
    inspector.set_model_info(4, 8, None)
    inspector.set_atlas(tiny_atlas(4, 8, 3))
    inspector.tabs.setCurrentWidget(inspector.brain)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)

    with qtbot.waitSignal(inspector.expertSelected, timeout=3000) as blocker:
        QTest.mouseClick(inspector.brain.view.viewport(), Qt.MouseButton.LeftButton, pos=cell_point(inspector.brain, 2, 6))
    assert blocker.args == [2, 6]
    assert inspector.brain.selected_cell == (2, 6) and inspector.brain.outline.isVisible()
    assert inspector.atlas.selected_key == (2, 6)
    assert "selected: layer 2, expert 6" in inspector.atlas.legend.info.text()

    # the Atlas's own pick ends in its `selected` signal (a real click is checked under Xvfb)
    with qtbot.waitSignal(inspector.expertSelected, timeout=3000) as blocker:
        inspector.atlas.selected.emit(1, 3)
    assert blocker.args == [1, 3]
    assert inspector.brain.selected_cell == (1, 3)
    assert inspector.brain.outline.rect().topLeft() == QPointF(3, 1)


def test_clicking_a_cell_tells_that_experts_story(qtbot, inspector):
    log = ExpertLog(4, 8, 2)                           # counters as a store keeps them
    log.steps[:] = 40
    log.hits[2, 6], log.misses[2, 6], log.reads[2, 6] = 7, 3, 4
    log.ahead_used[2, 6], log.ahead_wasted[2, 6] = 2, 1
    log.hits[1, 3], log.misses[1, 3] = 20, 0
    for token, tier in ((0, TIER_CACHED), (5, TIER_DISK), (9, TIER_CACHED), (12, TIER_PINNED)):
        log.tokens = token
        log.tier((2, 6), tier)
    tiers = np.full((4, 8), TIER_DISK, np.int8)
    tiers[2, 6], tiers[1, 3] = TIER_PINNED, TIER_CACHED
    inspector.set_model_info(4, 8, None)
    inspector.set_tiers(tiers)
    inspector.set_atlas(tiny_atlas(4, 8, 3))
    inspector.set_expert_counts(log.frozen())
    inspector.tabs.setCurrentWidget(inspector.brain)
    redraw(qtbot, inspector)
    story = inspector.brain.story
    assert not story.isVisible()

    QTest.mouseClick(inspector.brain.view.viewport(), Qt.MouseButton.LeftButton, pos=cell_point(inspector.brain, 2, 6))
    qtbot.waitUntil(story.isVisible, timeout=3000)
    text = story.body.text()
    assert story.title.text() == "layer 2, expert 6"
    assert "tier now: pinned" in text and "chosen by 10 of the layer's 40 steps (25.0%)" in text
    assert "served from memory 7, waited for disk 3" in text and "reads from disk: 4" in text
    assert "read ahead: 2 used, 1 wasted" in text
    assert "tier changes at token: 0: cached, 5: disk, 9: cached, 12: pinned" in text
    assert "atlas topic: Topic 0" in text                # expert 6 prefers topic 6 % 3
    entry = next(x for layer in tiny_atlas(4, 8, 3)["layers"] if layer["layer"] == 2 for x in layer["experts"]
                 if x["expert"] == 6)
    shares = sorted(((p, t) for t, p in enumerate(entry["topic_distribution"])), key=lambda pt: (-pt[0], pt[1]))
    assert shares[0][1] == 0 and shares[0][0] > shares[1][0] > 0
    assert "topic affinities: " + ", ".join(f"Topic {t} {fmt_percent(float(np.float32(p)))}" for p, t in shares) in text

    QTest.mouseClick(inspector.brain.view.viewport(), Qt.MouseButton.LeftButton, pos=cell_point(inspector.brain, 1, 3))
    qtbot.waitUntil(lambda: story.title.text() == "layer 1, expert 3", timeout=3000)
    assert "chosen by 20 of the layer's 40 steps (50.0%)" in story.body.text()
    assert "tier now: cached" in story.body.text() and "tier changes: none kept" in story.body.text()

    log.hits[1, 3] = 30                                  # newer counters follow at the next tick
    inspector.set_expert_counts(log.frozen())
    qtbot.waitUntil(lambda: "chosen by 30 of" in story.body.text(), timeout=3000)
    story.findChild(QToolButton).click()                 # dismissed: no expert selected
    assert not story.isVisible() and inspector.brain.selected_cell is None


def _replay_log() -> ExpertLog:
    """Three decoded tokens over 4 layers of 8 experts, top-2; token t routes to t + layer and 7 - layer, the latter
    read from disk in the odd layers."""
    log = ExpertLog(4, 8, 2)
    for token in (10, 11, 12):
        for layer in range(4):
            ids = [(token + layer) % 8, 7 - layer]
            log.routes.begin(token, layer, ids, {(layer, 7 - layer)} if layer % 2 else set())
    return log


def _flashed(brain: BrainView, colour: tuple[int, int, int]) -> set[tuple[int, int]]:
    hit = np.all(brain.rgba[..., :3] == np.array(colour, np.uint8), axis=-1)
    return {(int(a), int(b)) for a, b in zip(*np.nonzero(hit))}


def test_the_replay_steps_token_by_token_and_marks_disk_reads(qtbot, inspector):
    gen = Generation(4, 8)
    gen.decode(2)
    inspector.set_model_info(4, 8, None)
    inspector.set_snapshot(gen.tel.snapshot())
    inspector.set_expert_counts(_replay_log().frozen())
    inspector.tabs.setCurrentWidget(inspector.brain)
    redraw(qtbot, inspector)
    brain, bar = inspector.brain, inspector.brain.replay
    theme = brain.theme
    live = {(layer, e) for layer, ids in gen.current() for e in ids}
    assert bar.live.isChecked() and not bar.active and _flashed(brain, theme.flash) == live

    with qtbot.waitSignal(bar.moved, timeout=3000) as moved:
        bar.live.click()                               # off live: the last recorded token, whole
    assert moved.args == [12, 4] and bar.active
    chosen = {(layer, (12 + layer) % 8) for layer in range(4)} | {(0, 7), (2, 5)}
    reads = {(1, 6), (3, 4)}
    assert _flashed(brain, theme.flash) == chosen and _flashed(brain, theme.phases["io_wait"]) == reads
    with qtbot.waitSignal(bar.moved, timeout=3000) as moved:
        bar.back.click()
    assert moved.args == [11, 4]
    assert _flashed(brain, theme.flash) == {(layer, (11 + layer) % 8) for layer in range(4)} | {(0, 7), (2, 5)}
    with qtbot.waitSignal(bar.moved, timeout=3000) as moved:
        bar.slider.setValue(0)
    assert moved.args == [10, 4] and "token 10 (1 of 3)" in bar.label.text()
    with qtbot.waitSignal(bar.moved, timeout=3000) as moved:
        bar.live.click()                               # back to live: the current token again
    assert not bar.active and _flashed(brain, theme.flash) == live


def test_playing_sweeps_each_token_down_the_layers_at_the_speed_set(qtbot, inspector):
    inspector.set_model_info(4, 8, None)
    inspector.set_expert_counts(_replay_log().frozen())
    inspector.tabs.setCurrentWidget(inspector.brain)
    redraw(qtbot, inspector)
    bar, brain = inspector.brain.replay, inspector.brain
    bar.speed.setValue(200)
    assert bar._timer.interval() == 5
    seen: list[tuple[int, int]] = []
    bar.moved.connect(lambda token, swept: seen.append((token, swept)))
    bar.live.click()
    bar.seek(1)
    seen.clear()
    bar.play.click()                                   # from token 11, its sweep starting over
    qtbot.waitUntil(lambda: not bar.play.isChecked(), timeout=5000)   # the last token swept: it pauses
    assert seen == [(11, 0), (11, 1), (11, 2), (11, 3), (11, 4), (12, 1), (12, 2), (12, 3), (12, 4)]
    assert not bar._timer.isActive() and bar.play.text() == "▶"
    bar.seek(0)
    bar.moved.connect(lambda token, swept: bar.play.click() if (token, swept) == (10, 2) else None)
    bar.play.click()
    qtbot.waitUntil(lambda: not bar.play.isChecked(), timeout=5000)   # paused mid-sweep: two layers of token 10
    assert not bar._timer.isActive() and (bar.index, bar.swept) == (0, 2)
    assert _flashed(brain, brain.theme.flash) == {(0, 2), (0, 7), (1, 3)}
    assert _flashed(brain, brain.theme.phases["io_wait"]) == {(1, 6)}


def test_two_answers_routing_is_drawn_as_a_difference(qtbot, inspector):
    log = ExpertLog(4, 8, 2)
    for token in (3, 4):                               # answer 1: experts 0 and 5 in every layer
        for layer in range(4):
            log.routes.begin(token, layer, [0, 5])
    for token in (30, 31):                             # answer 2, after a prompt: 1 and 5, and 2 once in layer 0
        for layer in range(4):
            log.routes.begin(token, layer, [1 if token == 30 or layer else 2, 5])
    inspector.set_model_info(4, 8, None)
    inspector.set_expert_counts(log.frozen())
    inspector.tabs.setCurrentWidget(inspector.brain)
    redraw(qtbot, inspector)
    brain, bar = inspector.brain, inspector.brain.compare
    assert [bar.first.itemText(i) for i in range(bar.first.count())] == ["answer 1: tokens 3-4", "answer 2: tokens 30-31"]
    assert (bar.first.currentIndex(), bar.second.currentIndex()) == (0, 1) and not bar.active
    with qtbot.waitSignal(bar.changed, timeout=3000):
        bar.on.click()
    theme = brain.theme
    a, b = theme.phases["attention"], theme.phases["sampling"]
    assert _flashed(brain, a) == {(layer, 0) for layer in range(4)}          # only answer 1 chose them
    assert _flashed(brain, b) == {(layer, 1) for layer in range(1, 4)}       # answer 2, every token
    assert tuple(brain.rgba[0, 1, :3]) != tuple(b) and tuple(brain.rgba[0, 2, :3]) != tuple(b)   # half its tokens
    assert not {(layer, 5) for layer in range(4)} & (_flashed(brain, a) | _flashed(brain, b))   # both, as often
    assert "4 experts chosen more in A, 5 in B, 4 as often" in bar.summary.text()
    with qtbot.waitSignal(bar.changed, timeout=3000):
        bar.second.setCurrentIndex(0)                  # an answer against itself: no difference
    assert not _flashed(brain, a) and not _flashed(brain, b)
    bar.on.click()
    assert not bar.active and bar.summary.text() == ""


# --- Atlas without GL ------------------------------------------------------------------------------

def test_atlas_offers_to_compute_with_progress_and_cancel(qtbot, inspector):
    atlas = inspector.atlas
    inspector.tabs.setCurrentWidget(atlas)
    assert atlas.pages.currentIndex() == 0 and not atlas.compute_button.isEnabled()  # no MoE model yet
    inspector.set_model_info(4, 8, None)
    assert atlas.compute_button.isVisible() and atlas.compute_button.isEnabled()
    with qtbot.waitSignal(inspector.atlasRequested, timeout=3000):
        QTest.mouseClick(atlas.compute_button, Qt.MouseButton.LeftButton)
    inspector.set_atlas_progress(0.4)
    assert atlas.progress.isVisible() and atlas.cancel_button.isVisible() and not atlas.compute_button.isVisible()
    assert atlas.progress.value() == 400
    with qtbot.waitSignal(inspector.atlasCancelRequested, timeout=3000):
        QTest.mouseClick(atlas.cancel_button, Qt.MouseButton.LeftButton)
    inspector.set_atlas_progress(None)
    assert not atlas.progress.isVisible() and atlas.compute_button.isVisible()

    inspector.set_atlas(tiny_atlas(4, 8, 3))
    assert atlas.pages.currentIndex() == 1
    assert [r.text() for r in atlas.legend.rows] == ["Topic 0 (12)", "Topic 1 (11)", "Topic 2 (8)", "never chosen (1)"]
    # offscreen Qt has no OpenGL: a message instead of the canvas, and no crash
    assert atlas.canvas is None
    assert atlas.no_gl.isVisible() and "OpenGL" in atlas.no_gl.text()

    inspector.set_atlas(None)
    assert atlas.pages.currentIndex() == 0


def test_atlas_tracks_the_current_tokens_experts_without_gl(qtbot, inspector):
    gen = Generation(4, 8)
    gen.decode(3)
    data = tiny_atlas(4, 8, 3)
    inspector.set_atlas(data)
    inspector.tabs.setCurrentWidget(inspector.atlas)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)
    lit = {tuple(int(v) for v in inspector.atlas.data.keys[r]) for r in inspector.atlas.lit_rows}
    assert lit == {(layer, e) for layer, ids in gen.current() for e in ids}


def test_set_atlas_names_an_unreadable_atlas(qtbot, inspector):
    with pytest.raises(ValueError, match="colibri atlas"):
        inspector.set_atlas({"format": "colibri-atlas", "layers": []})


# --- tiers ---------------------------------------------------------------------------------------

class _Layer:
    def __init__(self, ffn: object):
        self.ffn = ffn


class _Spec:
    def __init__(self, layers: list[_Layer]):
        self.layers = tuple(layers)
        self.n_layers = len(layers)


def test_tiers_from_a_store_and_for_a_resident_model():
    spec = _Spec([_Layer(None), _Layer(MoESpec(4, 2, 8)), _Layer(MoESpec(4, 2, 8))])  # layer 0 dense

    class Store:
        recipes = {(layer, e): None for layer in (1, 2) for e in range(4)}
        built = {(1, 0): None, (1, 2): None, (2, 3): None}
        pinned = {(1, 0)}

    Store.spec = spec
    tiers = tiers_from_store(Store())
    assert tiers.dtype == np.int8 and tiers.shape == (3, 4)
    assert tiers.tolist() == [[TIER_NONE] * 4,
                              [TIER_PINNED, TIER_DISK, TIER_CACHED, TIER_DISK],
                              [TIER_DISK, TIER_DISK, TIER_DISK, TIER_CACHED]]
    assert resident_tiers(spec).tolist() == [[TIER_NONE] * 4, [TIER_RESIDENT] * 4, [TIER_RESIDENT] * 4]


# --- theme and cleanup ---------------------------------------------------------------------------

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


# --- the 3D Atlas under Xvfb -----------------------------------------------------------------------

def test_atlas_renders_under_xvfb(xvfb, tmp_path):
    """Run the gl_* checks in a child pytest on the X server (the offscreen platform has no OpenGL)."""
    if xvfb is None:
        pytest.skip("pytest-xvfb started no X server (Xvfb missing, or --no-xvfb): `apt install xvfb`")
    env = dict(os.environ, QT_QPA_PLATFORM="xcb", DISPLAY=f":{xvfb.display}")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:xvfb", "-p", "no:cacheprovider",
           "-o", "python_functions=gl_*", "--rootdir", str(REPO), "--basetemp", str(tmp_path / "child")]
    child = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, f"the GL checks failed under Xvfb:\n{child.stdout}\n{child.stderr}"
    assert " passed" in child.stdout and "skipped" not in child.stdout, child.stdout


def gl_atlas_renders_lights_picks_and_selects(qtbot, inspector):
    """(Xvfb child only) the canvas draws, routed experts light up, hover names and click selects."""
    from ui.inspector.atlas import gl_problem

    assert gl_problem() is None, gl_problem()
    gen = Generation(8, 16)
    gen.decode(4)
    inspector.set_model_info(8, 16, None)
    inspector.set_atlas(tiny_atlas(8, 16, 5))
    inspector.tabs.setCurrentWidget(inspector.atlas)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)
    atlas = inspector.atlas
    assert atlas.canvas is not None and atlas.canvas.native.isVisible()
    qtbot.wait(100)

    image = atlas.canvas.render()                                     # [H, W, 4] uint8
    assert image.shape[2] == 4 and image.shape[0] > 100
    assert image[..., :3].std() > 5, "the atlas rendered a blank image"
    assert len(np.unique(image[..., :3].reshape(-1, 3), axis=0)) > 5  # several topic colours, not one fill
    assert atlas._lit.visible and len(atlas.lit_rows) == 16

    # hover and click the point that is nearest to its own screen position (not hidden by another)
    xy = atlas.screen_positions()
    row = next(i for i in range(len(xy)) if atlas.pick(*xy[i]) == i)
    key = (int(atlas.data.keys[row, 0]), int(atlas.data.keys[row, 1]))
    where = QPoint(int(round(xy[row, 0])), int(round(xy[row, 1])))
    QTest.mouseMove(atlas.canvas.native, where)
    qtbot.waitUntil(lambda: atlas.hovered == key, timeout=3000)
    assert f"layer {key[0]}, expert {key[1]}" in atlas.legend.info.text()
    with qtbot.waitSignal(inspector.expertSelected, timeout=3000) as blocker:
        QTest.mouseClick(atlas.canvas.native, Qt.MouseButton.LeftButton, pos=where)
    assert blocker.args == list(key)
    assert atlas._ring.visible and inspector.brain.selected_cell == key

    inspector.close_views()
    assert atlas.canvas is None


def gl_atlas_survives_its_dock_floating(qtbot):
    """(Xvfb child only) floating a dock gives the canvas a new GL context: the atlas is rebuilt, not broken."""
    from PySide6.QtWidgets import QDockWidget, QLabel, QMainWindow

    win = QMainWindow()
    insp = Inspector()
    qtbot.addWidget(win, before_close_func=lambda w: insp.close_views())
    dock = QDockWidget("Inspector")
    dock.setWidget(insp)
    win.setCentralWidget(QLabel("chat"))
    win.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, dock)
    win.resize(1000, 600)
    win.show()
    qtbot.waitExposed(win)
    gen = Generation(8, 16)
    gen.decode(2)
    insp.set_atlas(tiny_atlas(8, 16, 5))
    insp.tabs.setCurrentWidget(insp.atlas)
    insp.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, insp)
    first = insp.atlas.canvas

    dock.setFloating(True)
    qtbot.waitUntil(lambda: insp.atlas.canvas is not None and insp.atlas.canvas is not first, timeout=5000)
    qtbot.wait(100)
    image = insp.atlas.canvas.render()
    assert image[..., :3].std() > 5, "the atlas went blank when its dock floated"
    assert insp.atlas._points.visible and insp.atlas._lit.visible
