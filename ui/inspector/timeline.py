"""The Time tab: per-token time by phase as stacked bars over the recent records, with averages.

One bar per record of the snapshot's `recent` window (oldest left). A prefill chunk of n tokens
is drawn at its time per token and marked with a triangle; the averages (the telemetry's own) are
over decoded tokens only.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QGridLayout, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from engine.telemetry import PHASES
from ui.inspector.common import Theme, fmt_ms, fmt_percent, style_plot, swatch_css
from ui.inspector.data import Frame

LABELS = {"attention": "attention", "dense": "dense matmuls", "experts": "expert matmuls",
          "io_wait": "I/O wait", "sampling": "sampling", "other": "other"}


class TimeView(QWidget):
    """Stacked per-phase bars of the recent tokens and a table of averages."""

    def __init__(self, theme: Theme, parent: QWidget | None = None):
        super().__init__(parent)
        self.plot = pg.PlotWidget()
        item = self.plot.getPlotItem()
        item.setMenuEnabled(False)
        item.setLabel("left", "ms per token")
        item.setLabel("bottom", "recent records (oldest left)")
        item.showGrid(y=True, alpha=0.15)
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
        """Draw the frame's recent records and averages."""
        snap = frame.snapshot
        if snap is None:
            return
        recent = snap.recent
        r = len(recent)
        if r:
            per_token = np.array([[getattr(rec, p) / max(rec.n, 1) for p in PHASES] for rec in recent]) * 1e3  # [R, 6] ms
            bottoms = np.zeros((r, len(PHASES)))
            np.cumsum(per_token[:, :-1], axis=1, out=bottoms[:, 1:])                                    # [R, 6]
        else:
            per_token = bottoms = np.zeros((0, len(PHASES)))
        x0 = np.arange(r, dtype=np.float64)
        width = np.full(r, 0.85 if r <= 60 else 1.0)  # gaps between many thin bars alias into stripes
        for j, p in enumerate(PHASES):
            self.bars[p].setOpts(x0=x0, width=width, y0=bottoms[:, j], height=per_token[:, j])
        prefill = np.array([rec.prefill for rec in recent], bool)
        tops = per_token.sum(axis=1) if r else np.zeros(0)
        self.prefill_marks.setData(x=(x0 + width / 2)[prefill], y=tops[prefill])

        avg = snap.averages
        wall = avg.get("wall", 0.0)
        for p in PHASES:
            self.averages[p].setText(fmt_ms(avg.get(p, 0.0)) if snap.tokens else "—")
            self.shares[p].setText(fmt_percent(avg.get(p, 0.0) / wall) if wall > 0 else "")
        if snap.tokens and wall > 0:
            self.total.setText(f"mean {fmt_ms(wall)} per decoded token ({snap.tok_per_s:.1f} tok/s); "
                               f"{r} records shown, triangles mark prompt chunks")
            self.mean_line.setPos(wall * 1e3)
            self.mean_line.setVisible(True)
        else:
            self.total.setText("no decoded tokens yet")
            self.mean_line.setVisible(False)
