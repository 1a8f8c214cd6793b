"""The Overview tab: rates, hit rates, model memory against the budget, and tier occupancy over time.

Figures follow every frame. The two plots draw a history the view keeps itself: the Inspector samples
the latest snapshot on a SAMPLE_HZ timer, whether data arrived or not, so an idle stretch stays flat
and a change shows when it happened; curves are steps (a value holds until the next sample). They are
redrawn only by frames with `plots` set (at most PLOT_HZ). Sizes are decimal (MB, GB), the units of
`--max-memory`.

Model memory is the process RSS minus the `rss_baseline` gauge (the interpreter and libraries,
measured before the model was loaded): that is what the budget covers, so it is what the stacked bar
(ui.inspector.budget) and the plot set against the budget; the baseline is shown apart.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication
from PySide6.QtWidgets import QGridLayout, QLabel, QVBoxLayout, QWidget

from engine.telemetry import Snapshot
from ui.inspector.budget import BudgetBar, memory_parts, model_memory
from ui.inspector.colours import tier_colour
from ui.inspector.common import Theme, fmt_bytes, fmt_ms, fmt_percent, live_plot, nice_ceil, style_plot, tier_name
from ui.inspector.data import TIER_CACHED, TIER_DISK, TIER_PINNED, Frame

SAMPLE_HZ = 2   # history samples a second, taken on a timer whether data arrived or not
HISTORY = 3600  # samples kept: half an hour at SAMPLE_HZ
RECENT_TOKENS = 64  # the recent hit rate's window
POINTS = 500    # at most this many points per curve: a plot is a few hundred pixels wide
T, PINNED, CACHED, DISK, MODEL, BUDGET = range(6)  # columns of a history sample (seconds, then bytes)

# (key, title, tooltip) of the figures, in reading order (three columns); translated where shown ("{n}": RECENT_TOKENS)
FIGURES = (
    ("tok_per_s", QT_TRANSLATE_NOOP("OverviewView", "Decode speed"),
     QT_TRANSLATE_NOOP("OverviewView", "decoded tokens per second over the recent tokens")),
    ("ttft", QT_TRANSLATE_NOOP("OverviewView", "Time to first token"),
     QT_TRANSLATE_NOOP("OverviewView", "from the request to its first token, prompt included")),
    ("hit_rate", QT_TRANSLATE_NOOP("OverviewView", "Expert hit rate"),
     QT_TRANSLATE_NOOP("OverviewView", "routed experts found in memory (pinned or cached), not read from disk, "
                                       "since the model was loaded")),
    ("hit_recent", QT_TRANSLATE_NOOP("OverviewView", "Hit rate, last {n} tokens"),
     QT_TRANSLATE_NOOP("OverviewView", "the same over the latest tokens (prompt and decoded): how the cache "
                                       "serves now")),
    ("model", QT_TRANSLATE_NOOP("OverviewView", "Model memory"),
     QT_TRANSLATE_NOOP("OverviewView", "process RSS minus the baseline: weights, expert cache, KV cache and "
                                       "buffers, what the memory budget covers")),
    ("baseline", QT_TRANSLATE_NOOP("OverviewView", "Baseline"),
     QT_TRANSLATE_NOOP("OverviewView", "process RSS before the model was loaded: the interpreter and libraries, "
                                       "outside the budget")),
    ("kv", QT_TRANSLATE_NOOP("OverviewView", "KV cache"),
     QT_TRANSLATE_NOOP("OverviewView", "memory of the attention keys and values")),
    ("tokens", QT_TRANSLATE_NOOP("OverviewView", "Tokens"),
     QT_TRANSLATE_NOOP("OverviewView", "decoded and prompt tokens of this generation")),
    ("bytes_read", QT_TRANSLATE_NOOP("OverviewView", "Read from disk"),
     QT_TRANSLATE_NOOP("OverviewView", "expert bytes read from disk")),
    ("prefetch", QT_TRANSLATE_NOOP("OverviewView", "Prefetch used / issued"),
     QT_TRANSLATE_NOOP("OverviewView", "experts read ahead of time that a token then used")),
)


def axis_unit(peak: float) -> tuple[str, float]:
    """The decimal unit an axis reaching `peak` bytes is labelled in: ('MB', 1e6) below 10 GB, else GB."""
    return ("GB", 1e9) if peak >= 10e9 else ("MB", 1e6)


class History:
    """The last HISTORY samples [S, 6] (T, PINNED, ... columns), oldest first, in one preallocated array."""

    def __init__(self, size: int = HISTORY):
        self._rows = np.full((size, 6), np.nan)   # [HISTORY, 6]
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def append(self, sample: tuple[float, float, float, float, float, float]) -> None:
        """Add a sample, dropping the oldest when full (one memmove of the array)."""
        if self._n == len(self._rows):
            self._rows[:-1] = self._rows[1:]
        else:
            self._n += 1
        self._rows[self._n - 1] = sample

    def samples(self) -> np.ndarray:
        """The samples [S, 6], a view: read it before the next append."""
        return self._rows[: self._n]


class OverviewView(QWidget):
    """Figures of the latest snapshot and the memory history."""

    def __init__(self, theme: Theme, parent: QWidget | None = None):
        super().__init__(parent)
        self.values: dict[str, QLabel] = {}
        grid = QGridLayout()
        for n, (key, title, tip) in enumerate(FIGURES):
            tip = QCoreApplication.translate("OverviewView", tip)
            name = QLabel(QCoreApplication.translate("OverviewView", title).format(n=RECENT_TOKENS))
            value = QLabel("—")
            name.setToolTip(tip)
            value.setToolTip(tip)
            value.setObjectName(f"overview_{key}")
            font = value.font()
            font.setPointSizeF(font.pointSizeF() * 1.3)
            font.setBold(True)
            value.setFont(font)
            grid.addWidget(name, 2 * (n // 3), n % 3)
            grid.addWidget(value, 2 * (n // 3) + 1, n % 3)
            self.values[key] = value
        self.budget_bar = BudgetBar(theme)

        self.memory_plot = pg.PlotWidget()
        self.disk_plot = pg.PlotWidget()
        mem, disk = self.memory_plot.getPlotItem(), self.disk_plot.getPlotItem()
        live_plot(mem, self.tr("{unit} in memory").format(unit="MB"), x_grid=True)
        live_plot(disk, self.tr("{unit} on disk").format(unit="MB"), self.tr("seconds ago"), x_grid=True)
        self.units = {"memory": "MB", "disk": "MB"}
        self.legend = mem.addLegend(offset=(8, 8))
        # stacked areas: the cached curve is pinned + cached, drawn first so pinned covers its lower part
        # steps: a sample's value holds until the next one, so nothing is drawn as a slope that never happened
        self.cached_curve = mem.plot(name=tier_name(TIER_CACHED), fillLevel=0, stepMode="right")
        self.pinned_curve = mem.plot(name=tier_name(TIER_PINNED), fillLevel=0, stepMode="right")
        self.model_curve = mem.plot(name=self.tr("model memory"), stepMode="right")
        self.budget_curve = mem.plot(name=self.tr("budget"), stepMode="right")
        self.disk_curve = disk.plot(fillLevel=0, stepMode="right")
        for curve in (self.cached_curve, self.pinned_curve, self.disk_curve):
            curve.setSkipFiniteCheck(True)                   # occupancy is always known (0 when not reported)

        layout = QVBoxLayout(self)
        layout.addLayout(grid)
        layout.addWidget(self.budget_bar)
        layout.addWidget(self.memory_plot, 3)
        layout.addWidget(self.disk_plot, 1)

        self._t0: float | None = None
        self._seen = -1
        self.history = History()
        self._hits: deque[tuple[int, int, int]] = deque()   # (tokens, hits in memory, all hits) of recent snapshots
        self.set_theme(theme)

    def set_theme(self, theme: Theme) -> None:
        """Recolour plots and curves (opaque fills: translucent ones cost a blend per pixel)."""
        self.theme = theme
        style_plot(self.memory_plot, [self.memory_plot.getPlotItem()], theme)
        style_plot(self.disk_plot, [self.disk_plot.getPlotItem()], theme)
        for curve, tier in ((self.cached_curve, TIER_CACHED), (self.pinned_curve, TIER_PINNED)):
            curve.setPen(pg.mkPen(theme.qcolor(theme.tiers[tier]), width=1))
            curve.setBrush(pg.mkBrush(theme.over_background(theme.tiers[tier], 0.6)))
        # the disk's slate, faded like those, read as grey beside the Brain: it takes a cold disk cell's colour
        disk = theme.qcolor(tier_colour(theme, TIER_DISK, 0.0))
        self.disk_curve.setPen(pg.mkPen(disk, width=1))
        self.disk_curve.setBrush(pg.mkBrush(disk))
        self.legend.setLabelTextColor(theme.qcolor(theme.foreground))
        self.model_curve.setPen(pg.mkPen(theme.qcolor(theme.foreground), width=1))
        self.budget_curve.setPen(pg.mkPen(theme.qcolor(theme.phases["io_wait"]), width=1,
                                          style=pg.QtCore.Qt.PenStyle.DashLine))
        self.budget_bar.set_theme(theme)

    def sample(self, snap: Snapshot | None, budget: float | None, now: float) -> None:
        """Add a history sample of the latest snapshot at `now` (time.monotonic seconds), new data or not."""
        if snap is None:
            return
        if self._t0 is None:
            self._t0 = now
        occ = snap.occupancy
        model = model_memory(snap.gauges)
        self.history.append((now - self._t0, occ.get("pinned", 0), occ.get("cached", 0), occ.get("disk", 0),
                             model if model is not None else np.nan, budget if budget is not None else np.nan))

    def record(self, snap: Snapshot | None) -> None:
        """Note a snapshot not seen yet for the recent hit rate (at every tick and sample, shown or not)."""
        if snap is None or snap.seq == self._seen:
            return
        self._seen = snap.seq
        tokens = snap.tokens + snap.prefill_tokens
        hits = self._hits
        if hits and tokens < hits[-1][0]:     # counts were reset: the window starts again
            hits.clear()
        held = snap.hits.get("pinned", 0) + snap.hits.get("cached", 0)
        hits.append((tokens, held, held + snap.hits.get("disk", 0)))
        while len(hits) > 1 and hits[1][0] <= tokens - RECENT_TOKENS:
            hits.popleft()

    def recent_hit_rate(self) -> tuple[float, int] | None:
        """(hit rate, tokens it covers) over about the last RECENT_TOKENS tokens; None before any hit."""
        if len(self._hits) < 2:
            return None
        (t0, held0, all0), (t1, held1, all1) = self._hits[0], self._hits[-1]
        if all1 == all0:
            return None
        return (held1 - held0) / (all1 - all0), t1 - t0

    def redraw(self, frame: Frame) -> None:
        """Show the frame's figures, and the history if the frame says plots."""
        snap = frame.snapshot
        if snap is None:
            return
        v = self.values
        v["tok_per_s"].setText(f"{snap.tok_per_s:.1f} tok/s" if snap.tokens else "—")
        ttft = snap.gauges.get("ttft")
        v["ttft"].setText(fmt_ms(ttft) if ttft is not None else "—")
        total = sum(snap.hits.values())
        v["hit_rate"].setText(fmt_percent(snap.hit_rate) if total else "—")
        recent = self.recent_hit_rate()
        v["hit_recent"].setText("—" if recent is None else fmt_percent(recent[0]) if recent[1] >= RECENT_TOKENS
                                else self.tr("{rate} ({n} tokens)").format(rate=fmt_percent(recent[0]), n=recent[1]))
        v["tokens"].setText(self.tr("{decoded} decoded, {prompt} prompt").format(decoded=snap.tokens,
                                                                                 prompt=snap.prefill_tokens))
        v["bytes_read"].setText(fmt_bytes(snap.bytes_read))
        wasted = self.tr(", {n} wasted").format(n=snap.prefetch_wasted) if snap.prefetch_wasted else ""
        v["prefetch"].setText(f"{snap.prefetch_used} / {snap.prefetch_issued}{wasted}")
        v["kv"].setText(fmt_bytes(snap.gauges.get("kv_bytes")))
        model, budget = model_memory(snap.gauges), frame.budget
        v["model"].setText(fmt_bytes(model))
        v["baseline"].setText(fmt_bytes(snap.gauges.get("rss_baseline")))
        self.budget_bar.set_memory(memory_parts(snap.gauges, snap.occupancy), budget)
        if frame.plots and len(self.history):
            self._plot(envelope(self.history.samples(), POINTS))

    def _plot(self, h: np.ndarray) -> None:
        """Hand the history [S, 6] to the curves (new arrays) and fit both plots to it, in round numbers."""
        t = h[:, T] - h[-1, T]                                   # seconds ago, the latest sample at 0
        stacked = h[:, PINNED] + h[:, CACHED]
        mem_peak = float(np.fmax.reduce(np.concatenate([stacked, h[:, MODEL], h[:, BUDGET]]), initial=0.0))
        disk_peak = float(np.fmax.reduce(h[:, DISK], initial=0.0))
        mem_scale = self._unit("memory", self.memory_plot.getPlotItem(), self.tr("{unit} in memory"), mem_peak)
        disk_scale = self._unit("disk", self.disk_plot.getPlotItem(), self.tr("{unit} on disk"), disk_peak)
        self.pinned_curve.setData(t, h[:, PINNED] / mem_scale)
        self.cached_curve.setData(t, stacked / mem_scale)
        self.model_curve.setData(t, h[:, MODEL] / mem_scale, connect="finite")
        self.budget_curve.setData(t, h[:, BUDGET] / mem_scale, connect="finite")
        self.disk_curve.setData(t, h[:, DISK] / disk_scale)
        x_range = (-nice_ceil(-t[0]), 0.0)
        for plot, peak, scale in ((self.memory_plot, mem_peak, mem_scale), (self.disk_plot, disk_peak, disk_scale)):
            y_range = (0.0, nice_ceil(peak / scale * 1.05))
            plot.getPlotItem().getViewBox().setRange(xRange=x_range, yRange=y_range, padding=0)

    def _unit(self, name: str, item: pg.PlotItem, label: str, peak: float) -> float:
        """The scale of plot `name` for `peak` bytes, relabelling its axis (label: "{unit} ...") when the unit
        changes."""
        unit, scale = axis_unit(peak)
        if self.units[name] != unit:
            self.units[name] = unit
            item.setLabel("left", label.format(unit=unit))
        return scale


def envelope(samples: np.ndarray, points: int) -> np.ndarray:
    """At most `points` rows of samples [S, 6]: the most of each run of k, at the run's last time (a new array)."""
    k = -(-len(samples) // points)
    if k <= 1:
        return samples.copy()
    runs = samples[len(samples) % k:].reshape(-1, k, samples.shape[1])   # [S // k, k, 6], the oldest few dropped
    out = np.fmax.reduce(runs, axis=1)                                     # NaN only where a whole run is
    out[:, T] = runs[:, -1, T]
    return out

