"""The Time tab: per-token time by phase as stacked bars over the recent records, with averages.

One bar per record of the snapshot's `recent` window (oldest left). A prefill chunk of n tokens
is drawn at its time per token and marked with a triangle; the averages (the telemetry's own) are
over decoded tokens only. The table follows every frame; the bars (one BarGraphItem per phase, its
arrays replaced) only frames with `plots` set, at most PLOT_HZ.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QGridLayout, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from engine.telemetry import PHASES, TokenTimes
from ui.inspector.common import Theme, fmt_ms, fmt_percent, live_plot, nice_ceil, style_plot, swatch_css
from ui.inspector.data import Frame

LABELS = {"attention": "attention", "dense": "dense matmuls", "experts": "expert matmuls",
          "io_wait": "I/O wait", "sampling": "sampling", "other": "other"}
_FIELDS = attrgetter("n", *PHASES)  # a record's token count and seconds per phase


class TimeView(QWidget):
    """Stacked per-phase bars of the recent tokens and a table of averages."""

    def __init__(self, theme: Theme, parent: QWidget | None = None):
        super().__init__(parent)
        self.plot = pg.PlotWidget()
        item = self.plot.getPlotItem()
        live_plot(item, "ms per token", "recent records (oldest left)")
        self.bars = {p: pg.BarGraphItem(x0=[], width=[], y0=[], height=[]) for p in PHASES}  # bottom to top
        for bar in self.bars.values():
            item.addItem(bar)
        self.prefill_marks = pg.ScatterPlotItem(symbol="t", size=7)
        item.addItem(self.prefill_marks)
        self.mean_line = pg.InfiniteLine(angle=0, movable=False)
        self.mean_line.setVisible(False)
        item.addItem(self.mean_line)

        table = QGridLayout()
        self.swatches: dict[str, QLabel] = {}
        self.averages: dict[str, QLabel] = {}
        self.shares: dict[str, QLabel] = {}
        for row, p in enumerate((*reversed(PHASES),)):  # top of the stack first, as drawn
            swatch = QLabel()
            swatch.setFixedSize(12, 12)
            self.swatches[p] = swatch
            self.averages[p], self.shares[p] = QLabel("—"), QLabel("")
            table.addWidget(swatch, row, 0)
            table.addWidget(QLabel(LABELS[p]), row, 1)
            table.addWidget(self.averages[p], row, 2)
            table.addWidget(self.shares[p], row, 3)
        table.setColumnStretch(1, 1)
        self.total = QLabel("no decoded tokens yet")
        self.total.setWordWrap(True)
        side = QWidget()
        col = QVBoxLayout(side)
        col.addWidget(QLabel("<b>Mean per decoded token</b>"))
        col.addLayout(table)
        col.addWidget(self.total)
        col.addStretch(1)
        side.setFixedWidth(300)

        layout = QHBoxLayout(self)
        layout.addWidget(self.plot, 1)
        layout.addWidget(side)
        self.set_theme(theme)

    def set_theme(self, theme: Theme) -> None:
        """Recolour bars and swatches."""
        self.theme = theme
        style_plot(self.plot, [self.plot.getPlotItem()], theme)
        for p, bar in self.bars.items():
            bar.setOpts(brush=pg.mkBrush(theme.qcolor(theme.phases[p])), pen=pg.mkPen(None))
            self.swatches[p].setStyleSheet(swatch_css(theme.phases[p]))
        self.prefill_marks.setBrush(pg.mkBrush(theme.qcolor(theme.foreground)))
        self.prefill_marks.setPen(pg.mkPen(None))
        self.mean_line.setPen(pg.mkPen(theme.qcolor(theme.foreground), width=1, style=pg.QtCore.Qt.PenStyle.DashLine))

    def bar_count(self) -> int:
        """Bars per phase now drawn (one per recent record)."""
        return len(self.bars[PHASES[0]].opts["x0"])

    def redraw(self, frame: Frame) -> None:
        """Show the frame's averages, and its recent records as bars if the frame says plots."""
        snap = frame.snapshot
        if snap is None:
            return
        avg = snap.averages
        wall = avg.get("wall", 0.0) if snap.tokens else 0.0
        for p in PHASES:
            self.averages[p].setText(fmt_ms(avg.get(p, 0.0)) if snap.tokens else "—")
            self.shares[p].setText(fmt_percent(avg.get(p, 0.0) / wall) if wall > 0 else "")
        if wall > 0:
            self.total.setText(f"mean {fmt_ms(wall)} per decoded token ({snap.tok_per_s:.1f} tok/s); "
                               f"{len(snap.recent)} records shown, triangles mark prompt chunks")
        else:
            self.total.setText("no decoded tokens yet")
        if frame.plots:
            self._plot(snap.recent, wall)

    def _plot(self, recent: tuple[TokenTimes, ...], wall: float) -> None:
        """Stacked bars of the records (seconds per phase), the mean line at `wall` s (0: none)."""
        r = len(recent)
        fields = np.array([_FIELDS(rec) for rec in recent], np.float64).reshape(r, 1 + len(PHASES))  # [R, 7]
        per_token = fields[:, 1:] * (1e3 / np.maximum(fields[:, :1], 1))                                # [R, 6] ms
        bottoms = np.zeros((r, len(PHASES)))
        np.cumsum(per_token[:, :-1], axis=1, out=bottoms[:, 1:])                                        # [R, 6]
        x0 = np.arange(r, dtype=np.float64)
        width = np.full(r, 0.85 if r <= 60 else 1.0)  # gaps between many thin bars alias into stripes
        for j, p in enumerate(PHASES):
            self.bars[p].setOpts(x0=x0, width=width, y0=bottoms[:, j], height=per_token[:, j])
        prefill = np.fromiter((rec.prefill for rec in recent), bool, r)
        tops = per_token.sum(axis=1)                                                                    # [R]
        self.prefill_marks.setData(x=(x0 + width / 2)[prefill], y=tops[prefill])
        self.mean_line.setVisible(wall > 0)
        if wall > 0:
            self.mean_line.setPos(wall * 1e3)
        peak = max(float(tops.max(initial=0.0)), wall * 1e3)
        # the height in round numbers, so the axis (costly to redraw) changes only when the bars outgrow it
        self.plot.getPlotItem().getViewBox().setRange(xRange=(0, max(r, 1)), yRange=(0, nice_ceil(peak * 1.05)),
                                                      padding=0)
