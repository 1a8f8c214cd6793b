"""The Overview tab: rates, hit rate, model memory against the budget, and tier occupancy over time.

Figures follow every frame. The two plots draw a history the view keeps itself (one sample per new
snapshot, so at most REDRAW_HZ a second, in one preallocated array) and are redrawn only by frames
with `plots` set (at most PLOT_HZ). Sizes are decimal (MB, GB), the units of `--max-memory`.

Model memory is the process RSS minus the `rss_baseline` gauge (the interpreter and libraries,
measured before the model was loaded): that is what the budget covers, so it is what the bar and
the plot set against the budget; the baseline is shown apart.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QGridLayout, QLabel, QProgressBar, QVBoxLayout, QWidget

from ui.inspector.common import Theme, fmt_bytes, fmt_ms, fmt_percent, live_plot, nice_ceil, style_plot
from ui.inspector.data import TIER_CACHED, TIER_DISK, TIER_PINNED, Frame

HISTORY = 9000  # samples kept: five minutes at 30 Hz
POINTS = 500    # at most this many points per curve: a plot is a few hundred pixels wide
T, PINNED, CACHED, DISK, MODEL, BUDGET = range(6)  # columns of a history sample (seconds, then bytes)

# (key, title, tooltip) of the figures, in reading order (three columns)
FIGURES = (
    ("tok_per_s", "Decode speed", "decoded tokens per second over the recent tokens"),
    ("ttft", "Time to first token", "from the request to its first token, prompt included"),
    ("hit_rate", "Expert hit rate", "routed experts found in memory (pinned or cached), not read from disk"),
    ("model", "Model memory", "process RSS minus the baseline: weights, expert cache, KV cache and buffers, "
                              "what the memory budget covers"),
    ("baseline", "Baseline", "process RSS before the model was loaded: the interpreter and libraries, "
                             "outside the budget"),
    ("kv", "KV cache", "memory of the attention keys and values"),
    ("tokens", "Tokens", "decoded and prompt tokens of this generation"),
    ("bytes_read", "Read from disk", "expert bytes read from disk"),
    ("prefetch", "Prefetch used / issued", "experts read ahead of time that a token then used"),
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
            name, value = QLabel(title), QLabel("—")
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
        self.budget_bar = QProgressBar()
        self.budget_bar.setRange(0, 1000)
        self.budget_bar.setFormat("no budget")
        self.budget_bar.setValue(0)

        self.memory_plot = pg.PlotWidget()
        self.disk_plot = pg.PlotWidget()
        mem, disk = self.memory_plot.getPlotItem(), self.disk_plot.getPlotItem()
        live_plot(mem, "MB in memory", x_grid=True)
        live_plot(disk, "MB on disk", "seconds ago", x_grid=True)
        self.units = {"memory": "MB", "disk": "MB"}
        self.legend = mem.addLegend(offset=(8, 8))
        # stacked areas: the cached curve is pinned + cached, drawn first so pinned covers its lower part
        self.cached_curve = mem.plot(name="cached", fillLevel=0)
        self.pinned_curve = mem.plot(name="pinned", fillLevel=0)
        self.model_curve = mem.plot(name="model memory")
        self.budget_curve = mem.plot(name="budget")
        self.disk_curve = disk.plot(fillLevel=0)
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
        self.set_theme(theme)

    def set_theme(self, theme: Theme) -> None:
        """Recolour plots and curves (opaque fills: translucent ones cost a blend per pixel)."""
        self.theme = theme
        style_plot(self.memory_plot, [self.memory_plot.getPlotItem()], theme)
        style_plot(self.disk_plot, [self.disk_plot.getPlotItem()], theme)
        for curve, tier in ((self.cached_curve, TIER_CACHED), (self.pinned_curve, TIER_PINNED),
                            (self.disk_curve, TIER_DISK)):
            curve.setPen(pg.mkPen(theme.qcolor(theme.tiers[tier]), width=1))
            curve.setBrush(pg.mkBrush(theme.over_background(theme.tiers[tier], 0.6)))
        self.legend.setLabelTextColor(theme.qcolor(theme.foreground))
        self.model_curve.setPen(pg.mkPen(theme.qcolor(theme.foreground), width=1))
        self.budget_curve.setPen(pg.mkPen(theme.qcolor(theme.phases["io_wait"]), width=1,
                                          style=pg.QtCore.Qt.PenStyle.DashLine))

    def record(self, frame: Frame) -> None:
        """Add a history sample if the frame holds a snapshot not seen yet (called whether shown or not)."""
        snap = frame.snapshot
        if snap is None or snap.seq == self._seen:
            return
        self._seen = snap.seq
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        occ = snap.occupancy
        model = model_memory(snap.gauges)
        self.history.append((now - self._t0, occ.get("pinned", 0), occ.get("cached", 0), occ.get("disk", 0),
                             model if model is not None else np.nan,
                             frame.budget if frame.budget is not None else np.nan))

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
        v["tokens"].setText(f"{snap.tokens} decoded, {snap.prefill_tokens} prompt")
        v["bytes_read"].setText(fmt_bytes(snap.bytes_read))
        wasted = f", {snap.prefetch_wasted} wasted" if snap.prefetch_wasted else ""
        v["prefetch"].setText(f"{snap.prefetch_used} / {snap.prefetch_issued}{wasted}")
        v["kv"].setText(fmt_bytes(snap.gauges.get("kv_bytes")))
        model, budget = model_memory(snap.gauges), frame.budget
        v["model"].setText(fmt_bytes(model))
        v["baseline"].setText(fmt_bytes(snap.gauges.get("rss_baseline")))
        if budget and model is not None:
            self.budget_bar.setValue(int(min(1.0, max(0.0, model / budget)) * 1000))
            self.budget_bar.setFormat(f"model memory {fmt_bytes(model)} of the {fmt_bytes(budget)} budget "
                                      f"({fmt_percent(model / budget)})")
        elif budget:
            self.budget_bar.setValue(0)
            self.budget_bar.setFormat(f"budget {fmt_bytes(budget)} (model memory not reported)")
        else:
            self.budget_bar.setValue(0)
            self.budget_bar.setFormat("no memory budget (the whole model is resident)")
        if frame.plots and len(self.history):
            self._plot(envelope(self.history.samples(), POINTS))

    def _plot(self, h: np.ndarray) -> None:
        """Hand the history [S, 6] to the curves (new arrays) and fit both plots to it, in round numbers."""
        t = h[:, T] - h[-1, T]                                   # seconds ago, the latest sample at 0
        stacked = h[:, PINNED] + h[:, CACHED]
        mem_peak = float(np.fmax.reduce(np.concatenate([stacked, h[:, MODEL], h[:, BUDGET]]), initial=0.0))
        disk_peak = float(np.fmax.reduce(h[:, DISK], initial=0.0))
        mem_scale = self._unit("memory", self.memory_plot.getPlotItem(), "in memory", mem_peak)
        disk_scale = self._unit("disk", self.disk_plot.getPlotItem(), "on disk", disk_peak)
        self.pinned_curve.setData(t, h[:, PINNED] / mem_scale)
        self.cached_curve.setData(t, stacked / mem_scale)
        self.model_curve.setData(t, h[:, MODEL] / mem_scale, connect="finite")
        self.budget_curve.setData(t, h[:, BUDGET] / mem_scale, connect="finite")
        self.disk_curve.setData(t, h[:, DISK] / disk_scale)
        x_range = (-nice_ceil(-t[0]), 0.0)
        for plot, peak, scale in ((self.memory_plot, mem_peak, mem_scale), (self.disk_plot, disk_peak, disk_scale)):
            y_range = (0.0, nice_ceil(peak / scale * 1.05))
            plot.getPlotItem().getViewBox().setRange(xRange=x_range, yRange=y_range, padding=0)

    def _unit(self, name: str, item: pg.PlotItem, where: str, peak: float) -> float:
        """The scale of plot `name` for `peak` bytes, relabelling its axis when the unit changes."""
        unit, scale = axis_unit(peak)
        if self.units[name] != unit:
            self.units[name] = unit
            item.setLabel("left", f"{unit} {where}")
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


def model_memory(gauges: Mapping[str, float]) -> float | None:
    """Process RSS minus the baseline before loading (bytes); None unless both gauges are reported."""
    rss, baseline = gauges.get("rss"), gauges.get("rss_baseline")
    if rss is None or baseline is None:
        return None
    return max(0.0, rss - baseline)
