"""The Brain tab: every expert of every layer as one cell of a grid [layers x experts].

By default hue is the expert's tier, always visible; brightness is the heat (decayed routing count, log-scaled
against the hottest), so "brighter = routed more lately" holds on light and dark themes alike. A
cold expert in RAM keeps more brightness than a cold one on disk, so residency reads at a glance. The legend
(ui/inspector/brain_legend.py) offers other colour maps (ui/inspector/colours.py: atlas topic, recency, read-ahead
outcome) and filters by tier and topic that dim the experts they leave out. The
experts the current token routed to flash. The whole grid is one RGBA image built with numpy and handed to a
single ImageItem per redraw, so 20,000 experts cost one array and one texture, not 20,000 items.
Hovering a cell shows its tooltip; clicking selects it and opens its story beside the grid (ui/inspector/story.py),
retold from each frame's counters. Below the grid, the replay (ui/inspector/replay.py) shows a recorded token in
place of the current one, the experts it read from disk in the I/O colour; "Compare answers" draws two answers'
routing as a difference instead (ui/inspector/compare.py).
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPoint, QRectF, QSettings, Qt, Signal
from PySide6.QtWidgets import QGraphicsRectItem, QHBoxLayout, QToolTip, QVBoxLayout, QWidget

from engine.offload.story import ExpertCounts
from ui.inspector.brain_legend import BrainLegend
from ui.inspector.colours import (
    MAP_AHEAD,
    MAP_RECENCY,
    MAP_TIERS,
    dim,
    filtered,
    heat_level,
    map_rgb,
    tier_codes,
    topic_grid,
)
from ui.inspector.common import Theme, describe_expert, layer_expert, style_plot, tier_name
from ui.inspector.compare import CompareBar, difference_rgba
from ui.inspector.data import TIER_NONE, AtlasData, Frame
from ui.inspector.replay import ReplayBar
from ui.inspector.story import StoryPanel, story_text


def grid_rgba(theme: Theme, shape: tuple[int, int], tiers: np.ndarray | None, heat: np.ndarray | None,
              current: tuple[tuple[int, tuple[int, ...]], ...], colour_map: str = MAP_TIERS,
              topics: np.ndarray | None = None, counts: ExpertCounts | None = None) -> np.ndarray:
    """The Brain image [L, E, 4] uint8: a colour map (ui/inspector/colours.py; by default tier hue, brighter with
    heat), the current token's experts in flash."""
    bg = np.array(theme.background, np.float32)
    fg = np.array(theme.foreground, np.float32)
    codes = tier_codes(tiers, shape)                                                       # [L, E]
    rgb = map_rgb(colour_map, theme, codes, heat_level(heat, shape), topics, counts)      # [L, E, 3]
    rgb[codes == TIER_NONE] = bg + (fg - bg) * 0.06                                        # no expert: just off the background
    rgba = np.empty((*shape, 4), np.uint8)
    rgba[..., :3] = rgb
    rgba[..., 3] = 255
    flash = np.array(theme.flash, np.uint8)
    for layer, ids in current:
        if 0 <= layer < shape[0]:
            cols = np.fromiter((e for e in ids if 0 <= e < shape[1]), np.int64)
            rgba[layer, cols, :3] = flash
    return rgba


def cell_ticks(n: int, most: int = 12) -> list[tuple[float, str]]:
    """Axis ticks for n cells: whole indices at cell centres, every 1, 2, 5, 10, 20, 50... so at most `most` show."""
    step = 1
    while n > step * most:
        step = step * 5 // 2 if str(step)[0] == "2" else step * 2      # 1, 2, 5, 10, 20, 50, ...
    return [(i + 0.5, str(i)) for i in range(0, n, step)]


class BrainView(QWidget):
    """The layers x experts grid; emits `selected(layer, expert)` when the user clicks a cell."""

    selected = Signal(int, int)

    def __init__(self, theme: Theme, parent: QWidget | None = None, settings: QSettings | None = None):
        super().__init__(parent)
        self.view = pg.GraphicsLayoutWidget()
        self.plot = self.view.addPlot()
        self.plot.invertY(True)       # layer 0 on top, as a model is read
        self.plot.setMenuEnabled(False)
        self.plot.hideButtons()
        self.plot.setLabel("left", self.tr("layer"))
        self.plot.setLabel("bottom", self.tr("expert"))
        self.image = pg.ImageItem(axisOrder="row-major")  # cell (layer, expert) = pixel [row layer, column expert]
        self.plot.addItem(self.image)
        self.outline = QGraphicsRectItem()
        self.outline.setZValue(10)
        self.outline.setVisible(False)
        self.plot.addItem(self.outline)
        self.view.scene().sigMouseMoved.connect(self._moved)
        self.view.scene().sigMouseClicked.connect(self._clicked)

        self.legend = BrainLegend(theme, settings)   # the colour map, its key and the filters
        self.legend.changed.connect(lambda: self._replayed(0, 0))
        self.status = self.legend.status

        self.story = StoryPanel()                  # the clicked expert's story
        self.story.closed.connect(lambda: self.set_selected(None))
        self.replay = ReplayBar()                  # recorded tokens instead of the current one
        self.replay.moved.connect(self._replayed)
        self.compare = CompareBar()                # two answers' routing as a difference
        self.compare.changed.connect(lambda: self._replayed(0, 0))
        row = QHBoxLayout()
        row.addWidget(self.view, 1)
        row.addWidget(self.story)
        layout = QVBoxLayout(self)
        layout.addLayout(row, 1)
        layout.addWidget(self.replay)
        layout.addWidget(self.compare)
        layout.addWidget(self.legend)

        self.rgba: np.ndarray | None = None    # [L, E, 4] the image last drawn
        self.shape = (0, 0)
        self.frame: Frame | None = None
        self.hovered: tuple[int, int] | None = None
        self.selected_cell: tuple[int, int] | None = None
        self._topics: tuple[AtlasData | None, tuple[int, int], np.ndarray, tuple[int, ...]] | None = None
        self.set_theme(theme)

    def set_theme(self, theme: Theme) -> None:
        """Recolour axes, the outline and the legend (the image follows at the next redraw)."""
        self.theme = theme
        style_plot(self.view, [self.plot], theme)
        pen = pg.mkPen(theme.qcolor(theme.foreground), width=2)
        pen.setCosmetic(True)
        self.outline.setPen(pen)
        self.compare.set_theme(theme)
        self.legend.set_theme(theme)

    def redraw(self, frame: Frame) -> None:
        """Rebuild and show the grid of the frame."""
        self.frame = frame
        snap = frame.snapshot
        shape = frame.shape
        if shape[0] == 0 or shape[1] == 0:
            self.image.clear()
            self.rgba, self.shape = None, (0, 0)
            self.status.setText(self.tr("no experts: a dense model, or no model loaded"))
            return
        routes = frame.counts.routes if frame.counts is not None else None
        self.replay.set_routes(routes)
        self.compare.set_routes(routes)
        legend = self.legend
        legend.set_atlas(frame.atlas)
        topics, present = self._topic_grid(frame.atlas, shape)
        if self.compare.active:
            a, b = self.compare.grids(shape)
            self.rgba = difference_rgba(self.theme, a, b)
            self.compare.summary.setText(self.tr("{a} experts chosen more in A, {b} in B, {same} as often").format(
                a=int((a > b).sum()), b=int((b > a).sum()), same=int(((a == b) & (a > 0)).sum())))
            self._show(shape, frame, topics)
            return
        self.compare.summary.setText("")
        if self.replay.active:
            current, reads = self.replay.shown()
        else:
            current, reads = (snap.current if snap is not None else ()), []
        self.rgba = grid_rgba(self.theme, shape, frame.tiers, snap.heat if snap is not None else None, current,
                              legend.colour_map, topics, frame.counts)
        read = np.array(self.theme.phases["io_wait"], np.uint8)
        for layer, ids in reads:                   # the experts the replayed token waited for
            if 0 <= layer < shape[0]:
                self.rgba[layer, [e for e in ids if 0 <= e < shape[1]], :3] = read
        legend.show_key(present, frame.counts is not None)
        self._show(shape, frame, topics)

    def _topic_grid(self, atlas: AtlasData | None, shape: tuple[int, int]) -> tuple[np.ndarray, tuple[int, ...]]:
        """Each expert's strongest atlas topic [L, E] and the topics some expert has, kept while atlas and shape
        stay."""
        kept = self._topics
        if kept is None or kept[0] is not atlas or kept[1] != shape:
            grid = topic_grid(atlas, shape)
            kept = self._topics = (atlas, shape, grid, tuple(int(t) for t in np.unique(grid[grid >= 0])))
        return kept[2], kept[3]

    def _show(self, shape: tuple[int, int], frame: Frame, topics: np.ndarray) -> None:
        """Dim what the filters leave out, hand the built image to the plot; axes follow a new shape."""
        legend = self.legend
        if legend.filtering:
            dim(self.rgba, filtered(tier_codes(frame.tiers, shape), legend.shown_tiers, topics, legend.topic()),
                self.theme)
        self.image.setImage(self.rgba, autoLevels=False)
        if shape != self.shape:
            self.shape = shape
            vb = self.plot.getViewBox()
            vb.setLimits(xMin=0, xMax=shape[1], yMin=0, yMax=shape[0])
            vb.setRange(xRange=(0, shape[1]), yRange=(0, shape[0]), padding=0)
            # cells are indices, not coordinates: label each at its centre, never 0.5 or an edge
            self.plot.getAxis("left").setTicks([cell_ticks(shape[0])])
            self.plot.getAxis("bottom").setTicks([cell_ticks(shape[1])])
        self.status.setText("" if frame.tiers is not None else self.tr("tiers not reported"))
        self._tell_story()

    def _replayed(self, token: int, swept: int) -> None:
        """The replay moved: draw the last frame again with the replayed token."""
        if self.frame is not None:
            self.redraw(self.frame)

    def set_selected(self, cell: tuple[int, int] | None) -> None:
        """Outline a cell (None: none) without emitting `selected`."""
        self.selected_cell = cell
        if cell is None:
            self.outline.setVisible(False)
            self.story.setVisible(False)
            return
        layer, expert = cell
        self.outline.setRect(QRectF(expert, layer, 1, 1))
        self.outline.setVisible(True)
        self._tell_story()

    def _tell_story(self) -> None:
        """The selected expert's story, from the last frame's counters, tiers and atlas."""
        cell, frame = self.selected_cell, self.frame
        if cell is None or frame is None:
            return
        layer, expert = cell
        tiers = frame.tiers
        tier = int(tiers[layer, expert]) if tiers is not None and layer < tiers.shape[0] and expert < tiers.shape[1] \
            else None
        self.story.show_story(layer, expert, story_text(frame.counts, layer, expert, tier, frame.atlas))

    def cell_at(self, scene_pos: pg.QtCore.QPointF) -> tuple[int, int] | None:
        """The (layer, expert) under a scene position, None outside the grid."""
        vb = self.plot.getViewBox()
        if not vb.sceneBoundingRect().contains(scene_pos):
            return None
        p = vb.mapSceneToView(scene_pos)
        layer, expert = int(np.floor(p.y())), int(np.floor(p.x()))
        if 0 <= layer < self.shape[0] and 0 <= expert < self.shape[1]:
            return layer, expert
        return None

    def hover_text(self, layer: int, expert: int) -> str:
        """The tooltip of a cell: layer, expert, tier, recent selections, atlas topic."""
        frame = self.frame
        lines = [layer_expert(layer, expert)]
        if frame is None:
            return lines[0]
        tiers = frame.tiers
        if tiers is not None and layer < tiers.shape[0] and expert < tiers.shape[1]:
            lines.append(self.tr("tier: {tier}").format(tier=tier_name(int(tiers[layer, expert]))))
        else:
            lines.append(self.tr("tier: not reported"))
        snap = frame.snapshot
        if snap is not None and layer < snap.heat.shape[0] and expert < snap.heat.shape[1]:
            routed_now = any(lay == layer and expert in ids for lay, ids in snap.current)
            lines.append((self.tr("selections: {heat} (recent, decayed); routed by the current token") if routed_now
                          else self.tr("selections: {heat} (recent, decayed)")).format(
                heat=f"{snap.heat[layer, expert]:.1f}"))
        lines.append(describe_expert(frame.atlas, layer, expert) if frame.atlas is not None
                     else self.tr("atlas: none yet"))
        counts, shown = frame.counts, self.legend.colour_map
        if counts is not None and layer < counts.last.shape[0] and expert < counts.last.shape[1]:
            if shown == MAP_RECENCY:
                since = int(counts.since_routed()[layer, expert])
                lines.append(self.tr("last chosen: never") if since < 0 else
                             self.tr("last chosen: {n} tokens ago").format(n=since))
            elif shown == MAP_AHEAD:
                lines.append(self.tr("read ahead: {used} used, {wasted} wasted").format(
                    used=int(counts.ahead_used[layer, expert]), wasted=int(counts.ahead_wasted[layer, expert])))
        return "\n".join(lines)

    def _moved(self, scene_pos: pg.QtCore.QPointF) -> None:
        cell = self.cell_at(scene_pos)
        if cell == self.hovered:
            return
        self.hovered = cell
        if cell is None:
            QToolTip.hideText()
            return
        local = self.view.mapFromScene(scene_pos)
        where = self.view.viewport().mapToGlobal(QPoint(local.x(), local.y()))
        QToolTip.showText(where, self.hover_text(*cell), self.view)

    def _clicked(self, event: object) -> None:
        if event.button() != Qt.MouseButton.LeftButton:
            return
        cell = self.cell_at(event.scenePos())
        if cell is None:
            return
        event.accept()
        self.set_selected(cell)
        self.selected.emit(*cell)

    def leaveEvent(self, event: object) -> None:
        """Drop the tooltip when the pointer leaves the grid."""
        self.hovered = None
        QToolTip.hideText()
        super().leaveEvent(event)
