"""The Inspector widget: Overview, Time, Brain, Atlas and Cache tabs, redrawn from the latest snapshot on a timer.

Setters only store what they are given; a QTimer (at most REDRAW_HZ, running while the widget is
shown) builds one frozen `Frame` per tick when something changed and hands it to the tab in view,
so the cost of the views is bounded by the screen rate, never by the token rate. Figures follow
every such frame; the plots (Overview curves, Time bars), which cost several ms to paint, only
frames with `plots` set: at most PLOT_HZ, and one more once a change has waited its turn. A second
timer samples the Overview's history at SAMPLE_HZ, shown or hidden, from the widget's creation until
`close_views`: the history records time as it passed, not only when data arrived.

Threads: `set_snapshot`, `set_tiers` and `set_expert_counts` store one reference and may be called from any thread
(e.g. a telemetry subscriber on the engine thread); every other method is for the GUI thread. The Cache tab
replays the expert cache's trace on a worker thread of its own (ui/inspector/cache.py).
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
from PySide6.QtCore import QEvent, QSettings, QTimer, Signal
from PySide6.QtWidgets import QTabWidget, QToolTip, QVBoxLayout, QWidget

from engine.offload.quality import CacheTrace
from engine.offload.story import ExpertCounts
from engine.telemetry import Snapshot
from ui.inspector.atlas import AtlasView
from ui.inspector.brain import BrainView
from ui.inspector.cache import CacheView
from ui.inspector.common import PLOT_HZ, REDRAW_HZ, theme_for
from ui.inspector.data import AtlasData, Frame
from ui.inspector.overview import SAMPLE_HZ, OverviewView
from ui.inspector.timeline import TimeView


class Inspector(QWidget):
    """The live inspector of a generation (see the module doc for the threading contract)."""

    atlasRequested = Signal()          # the user asked to compute the atlas
    atlasCancelRequested = Signal()    # the user cancelled that computation
    expertSelected = Signal(int, int)  # (layer, expert) chosen in the Brain or the Atlas

    INTERVAL_MS = math.ceil(1000 / REDRAW_HZ)

    def __init__(self, parent: QWidget | None = None, settings: QSettings | None = None):
        super().__init__(parent)
        theme = theme_for(self.palette())
        self.overview = OverviewView(theme)
        self.time = TimeView(theme)
        self.brain = BrainView(theme, settings=settings)    # its colour map and filters are kept in settings
        self.atlas = AtlasView(theme)
        self.cache = CacheView(theme)
        self.tabs = QTabWidget()
        for view, name in ((self.overview, self.tr("Overview")), (self.time, self.tr("Time")),
                           (self.brain, self.tr("Brain")), (self.atlas, self.tr("Atlas")),
                           (self.cache, self.tr("Cache"))):
            self.tabs.addTab(view, name)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.tabs)

        self._snapshot: Snapshot | None = None
        self._generating = True     # until told otherwise, flash what the snapshots say
        self._drawn: Snapshot | None = None   # the snapshot of the last redraw
        self._dirty = True                    # something besides the snapshot changed
        self._replot = True                   # draw the plots at the next tick, whatever PLOT_HZ allows
        self._plots_behind = False            # the plots miss a change the figures show
        self._plotted_at = -math.inf          # time.monotonic() of the last plot redraw
        self._shape = (0, 0)
        self._budget: float | None = None
        self._tiers: np.ndarray | None = None
        self._atlas: AtlasData | None = None
        self._selected: tuple[int, int] | None = None
        self._counts: ExpertCounts | None = None
        self._closed = False
        self.redraws = 0                      # timer ticks that drew a new state (tests, diagnostics)
        self.replots = 0                      # timer ticks that redrew the plots as well

        self._timer = QTimer(self)
        self._timer.setInterval(self.INTERVAL_MS)
        self._timer.timeout.connect(self._tick)
        self._sampler = QTimer(self)
        self._sampler.setInterval(round(1000 / SAMPLE_HZ))
        self._sampler.timeout.connect(self._sample)
        self._sampler.start()
        self.tabs.currentChanged.connect(self._redraw_all)
        self.brain.selected.connect(self._user_selected)
        self.atlas.selected.connect(self._user_selected)
        self.atlas.computeRequested.connect(self.atlasRequested)
        self.atlas.cancelRequested.connect(self.atlasCancelRequested)

    # --- the API of the main window ---------------------------------------------------------

    def set_snapshot(self, snapshot: Snapshot) -> None:
        """Keep the latest telemetry snapshot; the next tick draws it (cheap, any thread)."""
        self._snapshot = snapshot

    def set_generating(self, active: bool) -> None:
        """Whether an answer is being written: the current token's experts flash only while one is."""
        if active != self._generating:
            self._generating = active
            self._dirty = True

    def set_model_info(self, n_layers: int, n_experts: int, budget_bytes: int | None) -> None:
        """The Brain grid's shape and the memory budget (None: no budget, or the "budget" gauge)."""
        self._shape = (max(0, int(n_layers)), max(0, int(n_experts)))
        self._budget = float(budget_bytes) if budget_bytes else None
        self.atlas.set_has_experts(self._shape[1] > 0)
        self._redraw_all()

    def forget_model(self) -> None:
        """The model was closed: drop its snapshot and tiers, so no view shows its heat or current token."""
        self._snapshot = None
        self._tiers = None
        self._counts = None
        self.cache.set_trace(None)
        self._shape = (0, 0)
        self._budget = None
        self._dirty = self._replot = True

    def set_tiers(self, tiers: np.ndarray | None) -> None:
        """Each expert's tier [L, E] int8 (see ui.inspector.data), copied; None: unknown (any thread)."""
        if tiers is not None:
            tiers = np.array(tiers, np.int8)
            if tiers.ndim != 2:
                raise ValueError(f"tiers must be a [layers, experts] grid, got shape {tiers.shape}")
            tiers.flags.writeable = False
        self._tiers = tiers
        self._dirty = True

    def set_expert_counts(self, counts: ExpertCounts | None) -> None:
        """The expert cache's per-expert counters (None: not streamed); the Brain tells the selected expert's story
        from them (cheap, any thread)."""
        self._counts = counts
        self._dirty = True

    def set_cache_trace(self, trace: CacheTrace | None) -> None:
        """The expert cache's recent trace (None: no expert cache); the Cache tab replays it when in view."""
        self.cache.set_trace(trace)
        self._dirty = True

    def set_atlas(self, atlas: dict | None) -> None:
        """The model's atlas as `app.atlas.build` reads it (None: offer to compute one); ValueError if unreadable."""
        data = AtlasData.from_dict(atlas) if atlas is not None else None
        self._atlas = data
        self.atlas.set_atlas(data)
        self.atlas.set_progress(None)
        self.atlas.set_selected(self._selected)
        self._dirty = True

    def set_atlas_progress(self, fraction: float | None) -> None:
        """Progress 0..1 of the atlas being computed, with a Cancel button; None hides it."""
        self.atlas.set_progress(fraction)

    def select_expert(self, layer: int, expert: int) -> None:
        """Highlight an expert in the Brain and the Atlas (no expertSelected: the caller knows)."""
        self._selected = (layer, expert)
        self.brain.set_selected(self._selected)
        self.atlas.set_selected(self._selected)

    def close_views(self) -> None:
        """Stop the timers and the Cache tab's replay, free the Atlas's GL context; nothing is drawn afterwards."""
        self._closed = True
        self._timer.stop()
        self._sampler.stop()
        QToolTip.hideText()
        self.cache.close_views()
        self.brain.replay.stop()
        self.atlas.close_gl()

    # --- Qt ------------------------------------------------------------------------------------

    def showEvent(self, event: QEvent) -> None:
        """Start redrawing when shown."""
        super().showEvent(event)
        if not self._closed:
            self._redraw_all()
            self._timer.start()

    def hideEvent(self, event: QEvent) -> None:
        """Nothing to draw while hidden."""
        self._timer.stop()
        super().hideEvent(event)

    def closeEvent(self, event: QEvent) -> None:
        """Closing the inspector releases its views."""
        self.close_views()
        super().closeEvent(event)

    def changeEvent(self, event: QEvent) -> None:
        """Follow the palette (light / dark)."""
        if event.type() == QEvent.Type.PaletteChange:
            theme = theme_for(self.palette())
            for view in (self.overview, self.time, self.brain, self.atlas, self.cache):
                view.set_theme(theme)
            self._redraw_all()
        super().changeEvent(event)

    # --- internals ---------------------------------------------------------------------------

    def _redraw_all(self, *args: object) -> None:
        """Figures and plots at the next tick (a tab shown, a new theme or budget)."""
        self._dirty = self._replot = True

    def _user_selected(self, layer: int, expert: int) -> None:
        self.select_expert(layer, expert)
        self.expertSelected.emit(layer, expert)

    def _frame(self, plots: bool) -> Frame:
        snap = self._snapshot
        if snap is not None and snap.current and not self._generating:
            snap = dataclasses.replace(snap, current=())    # the last token's route is history once the answer ends
        shape = self._shape
        for grid in (snap.heat if snap is not None else None, self._tiers):
            if grid is not None and grid.ndim == 2:
                shape = (max(shape[0], grid.shape[0]), max(shape[1], grid.shape[1]))
        return Frame(snap, shape, self._budget_of(snap), self._tiers, self._atlas, self._selected, plots, self._counts)

    def _budget_of(self, snap: Snapshot | None) -> float | None:
        """set_model_info's budget, else the snapshot's "budget" gauge."""
        if self._budget is None and snap is not None and snap.gauges.get("budget"):
            return snap.gauges["budget"]
        return self._budget

    def _sample(self) -> None:
        """A history sample of the latest snapshot, new or not (the SAMPLE_HZ timer)."""
        snap = self._snapshot
        if snap is not None and not self._closed:
            self.overview.record(snap)
            self.overview.sample(snap, self._budget_of(snap), time.monotonic())
            if self.tabs.currentWidget() is self.overview:   # other tabs have nothing new to draw
                self._plots_behind = True

    def _tick(self) -> None:
        """Redraw the tab in view if a new snapshot arrived or anything else changed; its plots when due."""
        snap = self._snapshot
        view = self.tabs.currentWidget()
        now = time.monotonic()
        changed = self._dirty or snap is not self._drawn
        self._plots_behind |= changed
        due = self._replot or (self._plots_behind and now - self._plotted_at >= 1 / PLOT_HZ)
        plots = due and snap is not None  # no snapshot, nothing to plot: the first one is plotted at once
        if not changed and not plots and not (view is self.atlas and self.atlas.pending):
            return
        self._dirty = False
        self._drawn = snap
        if snap is not None and not len(self.overview.history):   # the first snapshot is plotted at once
            self._sample()
        frame = self._frame(plots)
        self.overview.record(frame.snapshot)
        if view is not None:
            view.redraw(frame)
        if changed:
            self.redraws += 1
        if plots:
            self._replot = self._plots_behind = False
            self._plotted_at = now
            self.replots += 1
