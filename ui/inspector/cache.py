"""The Cache tab: the cache-quality meter. The expert cache's live hit rate over its recent trace, its policy
replayed on that trace, Belady's optimum, and both against the expert cache's size, the current one marked: what a
budget change would do, shown before it is made.

The engine sends a frozen `CacheTrace` (engine/offload/quality.py) about once a second; replaying it takes up to
seconds at thousands of experts, so it runs on a worker thread, one at a time and at most every REPLAY_S while the
tab is in view, and its frozen `CacheQuality` comes back to the GUI thread through a queued signal.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QGridLayout, QLabel, QVBoxLayout, QWidget

from engine.offload.quality import CacheQuality, CacheTrace, cache_quality
from ui.inspector.common import Theme, fmt_bytes, fmt_percent, live_plot, style_plot
from ui.inspector.data import Frame

REPLAY_S = 3.0          # seconds between the starts of two replays (each holds the GIL much of its time)
GB, MB = 1e9, 1e6


class CacheView(QWidget):
    """Live, replayed and optimal hit rates now, and a curve of the replayed ones against the cache's size."""

    replayed = Signal(object)       # a CacheQuality, emitted on the worker thread and handled on the GUI thread

    def __init__(self, theme: Theme, parent: QWidget | None = None):
        super().__init__(parent)
        self.plot = pg.PlotWidget()
        item = self.plot.getPlotItem()
        live_plot(item, self.tr("hit rate (%)"), self.tr("expert cache"))
        self.policy_curve = pg.PlotDataItem(symbol="o", symbolSize=6)
        self.optimum_curve = pg.PlotDataItem(symbol="t", symbolSize=6)
        item.addItem(self.optimum_curve)
        item.addItem(self.policy_curve)
        self.marker = pg.InfiniteLine(angle=90, movable=False)   # the cache's size now
        self.marker.setVisible(False)
        item.addItem(self.marker)

        grid = QGridLayout()
        self.figures: dict[str, QLabel] = {}
        for row, (key, text) in enumerate((("live", self.tr("live hit rate")),
                                           ("policy", self.tr("its policy, replayed")),
                                           ("optimum", self.tr("Belady's optimum")),
                                           ("share", self.tr("share of the optimum")))):
            grid.addWidget(QLabel(text), row, 0)
            self.figures[key] = QLabel("—")
            grid.addWidget(self.figures[key], row, 1)
        grid.setColumnStretch(2, 1)
        self.status = QLabel(self.no_cache_text())
        self.status.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addLayout(grid)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.status)

        self.trace: CacheTrace | None = None          # the latest trace given
        self.quality: CacheQuality | None = None      # the latest replay shown
        self.replays = 0                              # replays shown (tests, diagnostics)
        self._replaying: CacheTrace | None = None     # the trace of the replay under way
        self._worker: threading.Thread | None = None
        self._cancel = threading.Event()
        self._started_at = -float("inf")              # time.monotonic() of the last replay's start
        self._closed = False
        self._later = QTimer(self)                    # starts a replay once REPLAY_S has passed
        self._later.setSingleShot(True)
        self._later.timeout.connect(self._maybe_replay)
        self.replayed.connect(self._show, Qt.ConnectionType.QueuedConnection)
        self.set_theme(theme)

    def set_theme(self, theme: Theme) -> None:
        """Recolour the plot and its curves."""
        self.theme = theme
        style_plot(self.plot, [self.plot.getPlotItem()], theme)
        ours, best = theme.phases["experts"], theme.phases["sampling"]
        self.policy_curve.setPen(pg.mkPen(theme.qcolor(ours), width=2))
        self.policy_curve.setSymbolBrush(theme.qcolor(ours))
        self.optimum_curve.setPen(pg.mkPen(theme.qcolor(best), width=2, style=Qt.PenStyle.DashLine))
        self.optimum_curve.setSymbolBrush(theme.qcolor(best))
        self.marker.setPen(pg.mkPen(theme.qcolor(theme.foreground), width=1))

    def set_trace(self, trace: CacheTrace | None) -> None:
        """The expert cache's latest trace (None: no expert cache); replayed when the tab is next in view."""
        self.trace = trace
        if trace is None:
            self.quality = None
            self._clear(self.no_cache_text())

    def no_cache_text(self) -> str:
        """What the tab says without an expert cache."""
        return self.tr("no expert cache: load a model with --max-memory to stream its experts")

    def redraw(self, frame: Frame) -> None:
        """The tab is in view: replay the latest trace if it is new (the figures follow when the replay ends)."""
        self._maybe_replay()

    def close_views(self) -> None:
        """Stop a replay under way (waiting for it) and start no other."""
        self._closed = True
        self._later.stop()
        self._cancel.set()
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    # --- internals ---------------------------------------------------------------------------

    def _maybe_replay(self) -> None:
        trace = self.trace
        if self._closed or trace is None or not self.isVisible() or self._worker is not None:
            return
        if self.quality is not None and trace is self._replaying:
            return                                    # shown already
        if not trace.steps:
            self._clear(self.tr("no layer step recorded yet: the meter starts with the first answer"))
            return
        wait = self._started_at + REPLAY_S - time.monotonic()
        if wait > 0:
            self._later.start(int(wait * 1000) + 1)
            return
        self._started_at = time.monotonic()
        self._replaying = trace
        self._cancel.clear()
        self.status.setText(self.tr("replaying {requests} expert requests of the last {steps} layer steps...").format(
            requests=trace.requests, steps=len(trace.steps)))
        self._worker = threading.Thread(target=self._replay, args=(trace,), name="cache-replay", daemon=True)
        self._worker.start()

    def _replay(self, trace: CacheTrace) -> None:
        """Worker thread: replay, hand the result to the GUI thread (nothing when cancelled)."""
        quality = cache_quality(trace, cancelled=self._cancel.is_set)
        if quality is not None:
            self.replayed.emit(quality)

    def _show(self, quality: CacheQuality) -> None:
        if self._worker is not None:
            self._worker.join()                       # it ends with the emit: at most a moment
            self._worker = None
        if self._closed:
            return
        self.quality = quality
        self.replays += 1
        ours, best = quality.at(quality.capacity)
        self.figures["live"].setText(fmt_percent(quality.live))
        self.figures["policy"].setText(fmt_percent(ours))
        self.figures["optimum"].setText(fmt_percent(best))
        self.figures["share"].setText(fmt_percent(ours / best) if best > 0 else "—")
        nbytes = quality.capacities.astype(np.float64) * quality.slot_bytes   # [C]
        unit, name = (GB, "GB") if nbytes[-1] >= GB else (MB, "MB")
        x = nbytes / unit
        self.policy_curve.setData(x, 100 * quality.policy)
        self.optimum_curve.setData(x, 100 * quality.optimum)
        self.marker.setValue(quality.capacity * quality.slot_bytes / unit)
        self.marker.setVisible(True)
        item = self.plot.getPlotItem()
        item.setLabel("bottom", self.tr("expert cache ({unit})").format(unit=name))
        item.setXRange(0, float(x[-1]) * 1.02, padding=0)
        item.setYRange(0, 100, padding=0)
        self.status.setText(self.tr("over the last {steps} layer steps ({requests} expert requests); the cache holds "
                                    "{size} now (the line). Replays start cold: they can read below the live rate.")
                            .format(steps=len(self._replaying.steps) if self._replaying else 0,
                                    requests=quality.requests, size=fmt_bytes(quality.capacity * quality.slot_bytes)))
        self._maybe_replay()                          # a newer trace may have come meanwhile

    def _clear(self, text: str) -> None:
        for label in self.figures.values():
            label.setText("—")
        self.policy_curve.setData([], [])
        self.optimum_curve.setData([], [])
        self.marker.setVisible(False)
        self.status.setText(text)
