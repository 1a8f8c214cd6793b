"""The Overview tab: rates, hit rate, memory against the budget, and tier occupancy over time.

Figures come from the latest snapshot; the two plots from a history the view keeps itself, one
sample per redraw that saw a new snapshot (so at most REDRAW_HZ samples a second).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QGridLayout, QLabel, QProgressBar, QVBoxLayout, QWidget

from ui.inspector.common import Theme, fmt_bytes, fmt_ms, fmt_percent, style_plot
from ui.inspector.data import TIER_CACHED, TIER_DISK, TIER_PINNED, Frame

GIB = float(1 << 30)
HISTORY = 9000  # samples kept: five minutes at 30 Hz

# (key, label) of the figures, in reading order
FIGURES = (
    ("tok_per_s", "Decode speed"), ("ttft", "Time to first token"), ("hit_rate", "Expert hit rate"),
    ("rss", "Memory (RSS)"), ("tokens", "Tokens"), ("bytes_read", "Read from disk"),
    ("prefetch", "Prefetch used / issued"), ("kv", "KV cache"),
)


class OverviewView(QWidget):
    """Figures of the latest snapshot and the memory history."""

    def __init__(self, theme: Theme, parent: QWidget | None = None):
        super().__init__(parent)
        self.values: dict[str, QLabel] = {}
        grid = QGridLayout()
        for n, (key, title) in enumerate(FIGURES):
            name, value = QLabel(title), QLabel("—")
            value.setObjectName(f"overview_{key}")
            font = value.font()
            font.setPointSizeF(font.pointSizeF() * 1.3)
            font.setBold(True)
            value.setFont(font)
            grid.addWidget(name, 2 * (n // 4), n % 4)
            grid.addWidget(value, 2 * (n // 4) + 1, n % 4)
            self.values[key] = value
        self.budget_bar = QProgressBar()
        self.budget_bar.setRange(0, 1000)
        self.budget_bar.setFormat("no budget")
        self.budget_bar.setValue(0)

        self.memory_plot = pg.PlotWidget()
        self.disk_plot = pg.PlotWidget()
        mem, disk = self.memory_plot.getPlotItem(), self.disk_plot.getPlotItem()
        mem.setLabel("left", "GiB in memory")
        self.legend = mem.addLegend(offset=(8, 8))
        disk.setLabel("left", "GiB on disk")
        disk.setLabel("bottom", "seconds")
        disk.setXLink(mem)
        for item in (mem, disk):
            item.setMenuEnabled(False)
            item.showGrid(x=True, y=True, alpha=0.15)
        # stacked areas: the cached curve is pinned + cached, drawn first so pinned covers its lower part
        self.cached_curve = mem.plot(name="cached", fillLevel=0)
        self.pinned_curve = mem.plot(name="pinned", fillLevel=0)
        self.rss_curve = mem.plot(name="RSS")
        self.budget_curve = mem.plot(name="budget")
        self.disk_curve = disk.plot(fillLevel=0)

        layout = QVBoxLayout(self)
        layout.addLayout(grid)
        layout.addWidget(self.budget_bar)
        layout.addWidget(self.memory_plot, 3)
        layout.addWidget(self.disk_plot, 1)

        self._t0: float | None = None
        self._seen = -1
        self._history: deque[tuple[float, float, float, float, float, float]] = deque(maxlen=HISTORY)
        self.set_theme(theme)

    def set_theme(self, theme: Theme) -> None:
        """Recolour plots and curves."""
        self.theme = theme
        style_plot(self.memory_plot, [self.memory_plot.getPlotItem()], theme)
        style_plot(self.disk_plot, [self.disk_plot.getPlotItem()], theme)
        for curve, tier in ((self.cached_curve, TIER_CACHED), (self.pinned_curve, TIER_PINNED),
                            (self.disk_curve, TIER_DISK)):
            curve.setPen(pg.mkPen(theme.qcolor(theme.tiers[tier]), width=1))
            curve.setBrush(pg.mkBrush(theme.qcolor(theme.tiers[tier], 150)))
        self.legend.setLabelTextColor(theme.qcolor(theme.foreground))
        self.rss_curve.setPen(pg.mkPen(theme.qcolor(theme.foreground), width=2))
        self.budget_curve.setPen(pg.mkPen(theme.qcolor(theme.phases["io_wait"]), width=2,
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
        rss = snap.gauges.get("rss", np.nan)
        budget = frame.budget if frame.budget is not None else np.nan
        self._history.append((now - self._t0, occ.get("pinned", 0) / GIB, occ.get("cached", 0) / GIB,
                              occ.get("disk", 0) / GIB, rss / GIB, budget / GIB))

    def redraw(self, frame: Frame) -> None:
        """Show the frame's figures and the history."""
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
        kv = snap.gauges.get("kv_bytes")
        v["kv"].setText(fmt_bytes(kv) if kv is not None else "—")
        rss, budget = snap.gauges.get("rss"), frame.budget
        v["rss"].setText(fmt_bytes(rss) if rss is not None else "—")
        if budget and rss is not None:
            self.budget_bar.setValue(int(min(1.0, rss / budget) * 1000))
            self.budget_bar.setFormat(f"RSS {fmt_bytes(rss)} of the {fmt_bytes(budget)} budget "
                                      f"({fmt_percent(rss / budget)})")
        elif budget:
            self.budget_bar.setValue(0)
            self.budget_bar.setFormat(f"budget {fmt_bytes(budget)} (RSS not reported)")
        else:
            self.budget_bar.setValue(0)
            self.budget_bar.setFormat("no memory budget (the whole model is resident)")
        if self._history:
            h = np.array(self._history)                          # [S, 6] t, pinned, cached, disk, rss, budget
            t = h[:, 0]
            self.pinned_curve.setData(t, h[:, 1])
            self.cached_curve.setData(t, h[:, 1] + h[:, 2])
            self.disk_curve.setData(t, h[:, 3])
            self.rss_curve.setData(t, h[:, 4], connect="finite")
            self.budget_curve.setData(t, h[:, 5], connect="finite")
