"""The Time tab: per-token time by phase as stacked bars over the recent records, with averages.

One bar per record of the snapshot's `recent` window (oldest left). A prefill chunk of n tokens
is drawn at its time per token and marked with a triangle; the averages (the telemetry's own) are
over decoded tokens only. The height scale follows the decoded tokens (`scale_ms`), so that a
prompt chunk or a rare cold read does not flatten every other bar: a bar taller than the scale is
cut at the top and marked with an arrow, and the text below says how high the highest one went.
The table follows every frame; the bars (one BarGraphItem per phase, its arrays replaced) only
frames with `plots` set, at most PLOT_HZ.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication
from PySide6.QtWidgets import QGridLayout, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from engine.telemetry import PHASES, TokenTimes
from ui.inspector.common import Theme, fmt_ms, fmt_percent, live_plot, nice_ceil, style_plot, swatch_css
from ui.inspector.data import Frame

# the phases' names, translated where shown
LABELS = {"attention": QT_TRANSLATE_NOOP("TimeView", "attention"),
          "dense": QT_TRANSLATE_NOOP("TimeView", "dense matmuls"),
          "experts": QT_TRANSLATE_NOOP("TimeView", "expert matmuls"),
          "io_wait": QT_TRANSLATE_NOOP("TimeView", "I/O wait"),
          "sampling": QT_TRANSLATE_NOOP("TimeView", "sampling"),
          "other": QT_TRANSLATE_NOOP("TimeView", "other")}
_FIELDS = attrgetter("n", *PHASES)  # a record's token count and seconds per phase
X_LABELS, Y_LABELS = 6, 5           # at most so many tick labels on each axis
EMPTY_MS, EMPTY_RECORDS = 100.0, 10  # the axes with no records yet: room for a typical token, not 0..1 ms


def scale_ms(tops: np.ndarray, prefill: np.ndarray, mean_ms: float) -> float:
    """The plot's height in ms: room for nearly every decoded bar and twice the mean, not for outliers.

    `tops` [R] are the bars' heights, `prefill` [R] marks prompt chunks. The 95th percentile of the
    decoded bars (all bars when none is decoded) sets it; bars above are drawn cut. No bars: EMPTY_MS.
    """
    decoded = tops[~prefill] if (~prefill).any() else tops
    if decoded.size == 0:
        return EMPTY_MS
    return nice_ceil(1.1 * max(float(np.percentile(decoded, 95)), 2.0 * mean_ms))


def tick_spacing(span: float, most: int, whole: bool = False) -> tuple[float, float]:
    """(major, minor) tick spacing for an axis of `span` with at most `most` labels: round steps (1, 2, 5 ...);
    `whole`: no step below 1 (an axis of records, where three records were labelled 0, 0.5, 1 ...)."""
    major = nice_ceil(span / most)
    if whole and major < 2:
        return 1.0, 1.0
    return major, major / 5 if major >= 5 else major / 2


class TimeView(QWidget):
    """Stacked per-phase bars of the recent tokens and a table of averages."""

    def __init__(self, theme: Theme, parent: QWidget | None = None):
        super().__init__(parent)
        self.plot = pg.PlotWidget()
        item = self.plot.getPlotItem()
        live_plot(item, self.tr("ms per token"), self.tr("recent records (oldest left)"))
        self.bars = {p: pg.BarGraphItem(x0=[], width=[], y0=[], height=[]) for p in PHASES}  # bottom to top
        for bar in self.bars.values():
            item.addItem(bar)
        self.prefill_marks = pg.ScatterPlotItem(symbol="t", size=7)
        item.addItem(self.prefill_marks)
        self.clip_marks = pg.ScatterPlotItem(symbol="arrow_up", size=9)   # bars cut at the top of the scale
        item.addItem(self.clip_marks)
        self.scale = 1.0                                                   # the plot's height, ms
        self._spacing: tuple[tuple[float, float], ...] = ()                # the axes' tick spacing in force
        self._clipped = ""                                                 # the summary's note on cut bars
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
            table.addWidget(QLabel(QCoreApplication.translate("TimeView", LABELS[p])), row, 1)
            table.addWidget(self.averages[p], row, 2)
            table.addWidget(self.shares[p], row, 3)
        table.setColumnStretch(1, 1)
        self.total = QLabel(self.tr("no decoded tokens yet"))
        self.total.setWordWrap(True)
        side = QWidget()
        col = QVBoxLayout(side)
        col.setContentsMargins(0, 0, 0, 0)
        col.addWidget(QLabel("<b>{}</b>".format(self.tr("Mean per decoded token"))))
        col.addLayout(table)
        col.addStretch(1)
        side.setMaximumWidth(360)

        # the bars take the tab's whole width; the table and the summary sit under them
        under = QHBoxLayout()
        under.addWidget(side, 1)
        under.addWidget(self.total, 1)
        layout = QVBoxLayout(self)
        layout.addWidget(self.plot, 1)
        layout.addLayout(under)
        self.set_theme(theme)
        self._plot((), 0.0)     # the empty axes now: pyqtgraph's own 0..1 read as "0.1 to 0.9 ms per token"

    def set_theme(self, theme: Theme) -> None:
        """Recolour bars and swatches."""
        self.theme = theme
        style_plot(self.plot, [self.plot.getPlotItem()], theme)
        for p, bar in self.bars.items():
            bar.setOpts(brush=pg.mkBrush(theme.qcolor(theme.phases[p])), pen=pg.mkPen(None))
            self.swatches[p].setStyleSheet(swatch_css(theme.phases[p]))
        for marks in (self.prefill_marks, self.clip_marks):
            marks.setBrush(pg.mkBrush(theme.qcolor(theme.foreground)))
            marks.setPen(pg.mkPen(None))
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
        if frame.plots:
            self._plot(snap.recent, wall)
        if wall > 0:
            self.total.setText(self.tr("mean {time} per decoded token ({speed} tok/s); {n} records shown, triangles "
                                       "mark prompt chunks").format(time=fmt_ms(wall), speed=f"{snap.tok_per_s:.1f}",
                                                                    n=len(snap.recent)) + self._clipped)
        else:
            self.total.setText(self.tr("no decoded tokens yet"))

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
        # a round height, so the axis (costly to redraw) changes only when the decoded bars outgrow it
        self.scale = scale_ms(tops, prefill, wall * 1e3)
        cut = tops > self.scale
        centres = x0 + width / 2
        self.prefill_marks.setData(x=centres[prefill], y=np.minimum(tops[prefill], self.scale))
        self.clip_marks.setData(x=centres[cut], y=np.full(int(cut.sum()), self.scale * 0.97))
        n_cut = int(cut.sum())
        if n_cut == 0:                          # (also no records: no bar, no maximum)
            self._clipped = ""
        else:
            highest = fmt_ms(float(tops.max()) / 1e3)
            self._clipped = (self.tr("; 1 bar cut at the top (arrow), {time}").format(time=highest) if n_cut == 1 else
                             self.tr("; {n} bars cut at the top (arrows), the highest {time}").format(n=n_cut,
                                                                                                     time=highest))
        self.mean_line.setVisible(wall > 0)
        if wall > 0:
            self.mean_line.setPos(wall * 1e3)
        item = self.plot.getPlotItem()
        records = r if r else EMPTY_RECORDS     # (whole records on the axis, not fractions of one)
        item.getViewBox().setRange(xRange=(0, records), yRange=(0, self.scale), padding=0)
        # a few labels whatever the width: pyqtgraph's own spacing crowds a narrow axis (24 labels were seen)
        spacing = (tick_spacing(records, X_LABELS, whole=True), tick_spacing(self.scale, Y_LABELS))
        if spacing != self._spacing:
            self._spacing = spacing
            item.getAxis("bottom").setTickSpacing(*spacing[0])
            item.getAxis("left").setTickSpacing(*spacing[1])
