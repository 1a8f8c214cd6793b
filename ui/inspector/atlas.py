"""The Atlas tab: the experts in 3D at their atlas positions (vispy), or an offer to compute the atlas.

Points are coloured by top topic and sized by the evidence behind their place: their probe selections,
log-scaled against the most chosen expert's. Three lines from the origin are the projection's axes, each reaching
past the farthest expert on its side and labelled there with the share of the spread it carries (the atlas's
explained variance, when it records it). The camera looks at the middle of the experts' bounding box, from where
all of them and the labels fit.
The canvas takes the pane's width; a Qt legend under it lays the topics out in as many columns as fit.
Three Markers visuals share one scene: the experts (set once per atlas), the experts the current
token routed to (drawn over the rest, updated per redraw) and a ring on the selected expert.
Hover and click pick the point nearest the pointer on screen, from positions projected through
the scene's own transforms (no GL picking pass). Dragging turns the turntable camera.

Without an OpenGL context (QT_QPA_PLATFORM=offscreen, a remote session without GLX) the canvas
is replaced by a message; the selection and the routed experts are still tracked. When Qt replaces
the widget's GL context (a dock floated or docked again), the canvas is rebuilt from the same camera.
"""

from __future__ import annotations

import time

import numpy as np
from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication, QPoint, Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication, QOffscreenSurface, QOpenGLContext
from PySide6.QtWidgets import (
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QStackedWidget,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from ui.inspector.common import Theme, describe_expert, layer_expert, swatch_css
from ui.inspector.data import AtlasData, Frame

PICK_RADIUS = 8.0      # px: how near the pointer a point must be to be hovered or clicked
CLICK_SLOP = 4.0       # px: a press and release further apart than this are a drag (rotation)
DRAW_SHARE = 2.0       # routed experts are redrawn at most once per this many canvas draw times
FRAME = 1.2            # the canvas's narrower side over the diameter of the sphere holding the experts and axis labels
AXIS_BEYOND = 0.12     # each axis reaches past the farthest expert on its side by this share of the cloud's size
LABEL_BEYOND = 0.04    # ... and its label past the axis's end by this share: at the end, clear of the dots
_clock = time.monotonic  # the time-left estimate's clock (tests set their own)
KEY_COLUMN = 150       # px: the width of one column of the legend's topics
# the offers of the empty page, translated where shown
NO_ATLAS = QT_TRANSLATE_NOOP("AtlasView", "This model has no atlas yet. Computing it routes a set of probe prompts on "
                             "a dozen topics (Python, SQL, mathematics, law, French, ...) through the model and "
                             "records which experts each topic uses.")
NO_MODEL = QT_TRANSLATE_NOOP("AtlasView", "The atlas maps the experts of a Mixture-of-Experts model: load one to see "
                             "or compute its atlas.")
_NO_GL_WIDGETS = {"offscreen", "minimal", "linuxfb", "vnc"}  # Qt platforms without RasterGLSurface
_gl_problem: list[tuple[str, dict[str, str]] | None] = []  # gl_problem()'s answer once asked: (text, its fields)


def gl_problem() -> str | None:
    """Why vispy cannot draw in this process (None: it can), in the language of the UI; asked once, then cached."""
    if not _gl_problem:
        _gl_problem.append(_ask_gl())
    if _gl_problem[0] is None:
        return None
    text, fields = _gl_problem[0]
    return QCoreApplication.translate("AtlasView", text).format(**fields)


def _ask_gl() -> tuple[str, dict[str, str]] | None:
    """gl_problem's answer as a text to translate (marked for lupdate) and its fields."""
    platform = QGuiApplication.platformName()
    where = {"platform": platform}
    ctx = QOpenGLContext()
    if platform in _NO_GL_WIDGETS:  # they may make a context (offscreen does, given a DISPLAY) but no QOpenGLWidget
        return QT_TRANSLATE_NOOP("AtlasView", "the Qt platform '{platform}' cannot show OpenGL widgets"), where
    if not ctx.create():
        return QT_TRANSLATE_NOOP("AtlasView", "no OpenGL context on the Qt platform '{platform}'"), where
    surface = QOffscreenSurface()
    surface.setFormat(ctx.format())
    surface.create()
    current = ctx.makeCurrent(surface)
    ctx.doneCurrent()
    surface.destroy()
    if not current:
        return QT_TRANSLATE_NOOP("AtlasView", "an OpenGL context exists on the Qt platform '{platform}' but cannot be "
                                 "made current"), where
    try:
        import vispy.app

        vispy.app.use_app("pyside6")
    except Exception as exc:  # vispy already bound to another toolkit, or missing
        return QT_TRANSLATE_NOOP("AtlasView", "vispy cannot draw with PySide6 ({why})"), {"why": str(exc)}
    return None


def marker_sizes(selections: np.ndarray) -> np.ndarray:
    """Marker diameters [N] px of experts chosen `selections` [N] times by the probes: 4..16, log-scaled against the
    most chosen (more evidence, a bigger dot), smaller when there are many points (less overlap, less fill)."""
    crowd = float(np.clip(np.sqrt(2000 / max(len(selections), 1)), 0.45, 1.0))
    most = float(selections.max()) if len(selections) else 0.0
    evidence = np.log1p(selections) / np.log1p(most) if most > 0 else np.zeros(len(selections))
    return (4.0 + 12.0 * evidence) * crowd


def extent(positions: np.ndarray) -> float:
    """The cloud's size: the longest side of its bounding box (1 without experts)."""
    return max(float(np.ptp(positions, axis=0).max()), 1e-6) if len(positions) else 1.0


def axis_ends(positions: np.ndarray) -> np.ndarray:
    """How far [3] each axis reaches from the origin along its positive side: past the farthest expert there."""
    high = positions.max(axis=0) if len(positions) else np.zeros(3)                 # [3]
    return (np.maximum(high, 0.0) + AXIS_BEYOND * extent(positions)).astype(np.float32)


def label_positions(positions: np.ndarray) -> np.ndarray:
    """Where [3, 3] the three axis labels sit, one a row: on each axis, past its end."""
    return np.diag(axis_ends(positions) + LABEL_BEYOND * extent(positions)).astype(np.float32)


def framing(positions: np.ndarray) -> tuple[tuple[float, float, float], float]:
    """The turntable's centre and scale factor for positions [N, 3]: the middle of their bounding box (not their
    mean, which a far cluster pulls aside), and a view of the sphere round it that holds every expert and label."""
    if not len(positions):
        return (0.0, 0.0, 0.0), 2.0 * FRAME
    centre = (positions.min(axis=0) + positions.max(axis=0)) / 2                     # [3]
    seen = np.concatenate([positions, label_positions(positions), np.zeros((1, 3))])  # [N + 4, 3] the origin too
    radius = max(float(np.linalg.norm(seen - centre, axis=1).max()), 1e-3)
    x, y, z = (float(v) for v in centre)
    return (x, y, z), 2.0 * radius * FRAME


def axis_labels(data: AtlasData) -> list[str]:
    """The three axes' names, with their explained variance when the atlas records it: 'PC1 41%'."""
    shares = data.explained_variance
    return [f"PC{i + 1} {100 * shares[i]:.0f}%" if i < len(shares) else f"PC{i + 1}" for i in range(3)]


class _Legend(QWidget):
    """Topic colours with their expert counts, in as many columns as the width holds; what size, axes, flash and
    ring mean; the expert hovered or selected."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.grid = QGridLayout()
        self.grid.setContentsMargins(0, 0, 0, 0)
        self.grid.setHorizontalSpacing(6)
        self.grid.setVerticalSpacing(2)
        self.notes = QLabel(self.tr("size: probe selections (bigger = more evidence) · bright: routed by the current "
                                    "token · ring: selected expert · drag: turn, wheel: zoom, shift+drag: pan"))
        self.notes.setWordWrap(True)
        self.axes = QLabel("")
        self.axes.setWordWrap(True)
        self.info = QLabel(self.tr("hover an expert"))
        # two lines, whatever they say: a hover must not resize the canvas above
        self.info.setFixedHeight(2 * self.info.fontMetrics().lineSpacing() + 4)
        self.info.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 2, 4, 2)
        layout.setSpacing(4)
        layout.addWidget(QLabel("<b>{}</b>".format(self.tr("Top topic"))))
        layout.addLayout(self.grid)
        layout.addWidget(self.axes)
        layout.addWidget(self.notes)
        layout.addWidget(self.info)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)
        self.rows: list[QLabel] = []
        self.swatches: list[QLabel] = []
        self.columns = 0                       # topic columns the grid is laid out in (0: not yet)

    def fill(self, data: AtlasData, theme: Theme) -> None:
        """One entry per topic (and one for experts never chosen), and the axes' shares of the spread."""
        for w in self.swatches + self.rows:
            self.grid.removeWidget(w)
            w.deleteLater()
        self.rows, self.swatches = [], []
        counts = np.bincount(data.top + 1, minlength=len(data.topics) + 1)  # [topics + 1], slot 0 = never chosen
        entries = [(theme.topic(t), f"{data.titles[t]} ({counts[t + 1]})") for t in range(len(data.topics))]
        if counts[0]:
            entries.append((theme.unused, self.tr("never chosen ({n})").format(n=counts[0])))
        for rgb, text in entries:
            swatch = QLabel()
            swatch.setFixedSize(12, 12)
            swatch.setStyleSheet(swatch_css(rgb))
            label = QLabel(text)
            label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)  # the columns follow the width
            self.swatches.append(swatch)
            self.rows.append(label)
        self.columns = 0
        self._flow()
        names = ", ".join(axis_labels(data))
        if data.explained_variance:
            self.axes.setText(self.tr("axes: {names} of the spread between the experts' topic mixes").format(names=names))
        else:
            self.axes.setText(self.tr("axes: {names} (this atlas does not record their shares of the spread: compute "
                                      "it again to see them)").format(names=names))

    def resizeEvent(self, event: object) -> None:
        super().resizeEvent(event)
        self._flow()

    def _flow(self) -> None:
        """Lay the entries out top to bottom in as many columns of KEY_COLUMN px as the width holds."""
        columns = max(1, min(self.width() // KEY_COLUMN, len(self.rows)))
        if columns == self.columns or not self.rows:
            return
        self.columns = columns
        for w in self.swatches + self.rows:
            self.grid.removeWidget(w)
        per_column = -(-len(self.rows) // columns)
        for i, (swatch, label) in enumerate(zip(self.swatches, self.rows)):
            row, col = i % per_column, i // per_column
            self.grid.addWidget(swatch, row, 2 * col)
            self.grid.addWidget(label, row, 2 * col + 1)
        for col in range(self.grid.columnCount()):
            self.grid.setColumnStretch(col, 1 if col % 2 and col // 2 < columns else 0)


class AtlasView(QWidget):
    """The 3D atlas; emits `selected(layer, expert)` on a click, `computeRequested` / `cancelRequested`."""

    selected = Signal(int, int)
    computeRequested = Signal()
    cancelRequested = Signal()

    def __init__(self, theme: Theme, parent: QWidget | None = None):
        super().__init__(parent)
        self.theme = theme
        self.pages = QStackedWidget()

        # page 0: no atlas yet
        empty = QWidget()
        self.message = QLabel(QCoreApplication.translate("AtlasView", NO_MODEL))
        self.message.setWordWrap(True)
        self.message.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.compute_button = QPushButton(self.tr("Compute atlas"))
        self.compute_button.clicked.connect(self.computeRequested)
        self.compute_button.setEnabled(False)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self._since: tuple[float, float] | None = None  # (monotonic time, fraction) of the computation's first news
        self.cancel_button = QPushButton(self.tr("Cancel"))
        self.cancel_button.clicked.connect(self.cancelRequested)
        row = QHBoxLayout()
        row.addStretch(1)
        row.addWidget(self.compute_button)
        row.addWidget(self.progress, 2)
        row.addWidget(self.cancel_button)
        row.addStretch(1)
        col = QVBoxLayout(empty)
        col.addStretch(1)
        col.addWidget(self.message)
        col.addLayout(row)
        col.addStretch(1)
        self.pages.addWidget(empty)

        # page 1: the atlas (canvas or a message) over the legend
        shown = QWidget()
        self.stage = QWidget()                   # holds the canvas (or the message without GL)
        self.canvas_host = QVBoxLayout(self.stage)
        self.canvas_host.setContentsMargins(0, 0, 0, 0)
        self.no_gl = QLabel("")
        self.no_gl.setWordWrap(True)
        self.no_gl.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.no_gl.setVisible(False)
        self.canvas_host.addWidget(self.no_gl)
        self.legend = _Legend()
        split = QVBoxLayout(shown)
        split.setContentsMargins(0, 0, 0, 0)
        split.setSpacing(2)
        split.addWidget(self.stage, 1)
        split.addWidget(self.legend)
        self.pages.addWidget(shown)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.pages)

        self.data: AtlasData | None = None
        self.canvas = None                       # vispy SceneCanvas, made when an atlas arrives and GL works
        self._view = self._points = self._lit = self._ring = self._axes = None
        self._axis_text = None                   # one vispy Text visual: the three labels at the axes' ends
        self.lit_rows = np.zeros(0, np.int64)    # [K] atlas rows routed by the current token
        self.selected_key: tuple[int, int] | None = None
        self.hovered: tuple[int, int] | None = None
        self._current: tuple = ()
        self._closed = False
        self.draw_cost = 0.0                     # s, smoothed CPU time of one canvas draw
        self.pending = False                     # a newer token waits for its turn to be drawn
        self._lit_at = 0.0
        self._draw_start = 0.0
        self.set_progress(None)

    # --- state from the inspector ------------------------------------------------------------

    def set_theme(self, theme: Theme) -> None:
        """Recolour the canvas, points and legend."""
        self.theme = theme
        if self.data is not None:
            self.legend.fill(self.data, theme)
        if self.canvas is not None:
            self.canvas.bgcolor = np.array(theme.background) / 255
            self._draw_points()
            self._draw_axes()
            self._draw_overlays()

    def set_progress(self, fraction: float | None) -> None:
        """Show the computing progress with a Cancel button and, once it has a pace, the time left; None hides
        them."""
        busy = fraction is not None
        self.progress.setVisible(busy)
        self.cancel_button.setVisible(busy)
        self.compute_button.setVisible(not busy)
        if not busy:
            self._since = None
            return
        fraction = min(max(fraction, 0.0), 1.0)
        self.progress.setValue(int(fraction * 1000))
        percent = f"{100 * fraction:.0f}"
        left = self._seconds_left(fraction, _clock())
        if left is None:
            self.progress.setFormat(self.tr("computing the atlas: {percent}%").format(percent=percent))
        elif left < 60:
            self.progress.setFormat(self.tr("computing the atlas: {percent}%, about {s} s left").format(
                percent=percent, s=left))
        else:
            self.progress.setFormat(self.tr("computing the atlas: {percent}%, about {m} min {s} s left").format(
                percent=percent, m=left // 60, s=left % 60))

    def _seconds_left(self, fraction: float, now: float) -> int | None:
        """The time left at the pace since the first news, to 5 s; None until there is a pace to go by."""
        if self._since is None:
            self._since = (now, fraction)
        t0, f0 = self._since
        if now - t0 < 3.0 or fraction - f0 < 0.02:    # the first prompts' pace says little (a cold compile)
            return None
        return 5 * round((now - t0) * (1.0 - fraction) / (fraction - f0) / 5)

    def set_has_experts(self, has_experts: bool) -> None:
        """Offer to compute an atlas only for a model with routed experts."""
        self.message.setText(QCoreApplication.translate("AtlasView", NO_ATLAS if has_experts else NO_MODEL))
        self.compute_button.setEnabled(has_experts)

    def set_atlas(self, data: AtlasData | None) -> None:
        """Show an atlas (None: the offer to compute one)."""
        self.data = data
        self.hovered = None
        if data is None:
            self.pages.setCurrentIndex(0)
            return
        self.pages.setCurrentIndex(1)
        self.legend.fill(data, self.theme)
        self._ensure_canvas()
        self._frame()
        self._draw_points()
        self._draw_axes()
        self._current = ()
        self.lit_rows = np.zeros(0, np.int64)
        self._draw_overlays()

    def set_selected(self, key: tuple[int, int] | None) -> None:
        """Ring an expert (None: none) without emitting `selected`."""
        self.selected_key = key
        self._describe(key)
        self._draw_overlays()

    def redraw(self, frame: Frame) -> None:
        """Light up the experts the frame's token routed to (deferred, see `pending`, while GL is slow)."""
        snap = frame.snapshot
        current = snap.current if snap is not None else ()
        self.pending = False
        if self.data is None or current == self._current:
            return
        now = time.monotonic()
        if self.canvas is not None and now - self._lit_at < DRAW_SHARE * self.draw_cost:
            self.pending = True  # a software GL frame is slow: leave the GUI thread time to breathe
            return
        self._lit_at = now
        self._current = current
        rows = [self.data.row(layer, e) for layer, ids in current for e in ids]
        self.lit_rows = np.array([r for r in rows if r is not None], np.int64)
        self._draw_overlays()

    def close_gl(self) -> None:
        """Close the canvas and free its GL context; the view shows nothing 3D afterwards."""
        self._closed = True
        QToolTip.hideText()
        self._drop_canvas()

    # --- picking ---------------------------------------------------------------------------

    def screen_positions(self) -> np.ndarray:
        """Canvas pixel coordinates [N, 2] of every expert under the current camera."""
        if self._points is None or self.data is None:
            return np.zeros((0, 2))
        p = self._points.get_transform("visual", "canvas").map(self.data.positions)  # [N, 4] homogeneous
        return p[:, :2] / p[:, 3:4]

    def pick(self, x: float, y: float) -> int | None:
        """The atlas row of the expert drawn nearest canvas pixel (x, y), if within PICK_RADIUS."""
        xy = self.screen_positions()
        if not len(xy):
            return None
        d2 = ((xy - (x, y)) ** 2).sum(axis=1)
        i = int(np.argmin(d2))
        return i if d2[i] <= PICK_RADIUS ** 2 else None

    # --- internals ---------------------------------------------------------------------------

    def _ensure_canvas(self, camera: dict | None = None) -> None:
        """Make the canvas and its visuals (camera: the turntable's state to start from)."""
        if self.canvas is not None or self._closed:
            return
        problem = gl_problem()
        if problem is not None:
            self.no_gl.setText(self.tr("The 3D atlas needs OpenGL: {why}. The Brain tab shows the same experts; hover "
                                       "a cell there for its atlas topic.").format(why=problem))
            self.no_gl.setVisible(True)
            return
        from vispy import scene

        self.canvas = scene.SceneCanvas(keys=None, show=False, parent=self,
                                        bgcolor=np.array(self.theme.background) / 255)
        self.canvas.native.setMinimumSize(200, 200)
        self.canvas_host.addWidget(self.canvas.native, 1)
        self._view = self.canvas.central_widget.add_view()
        self._view.camera = scene.TurntableCamera(**(camera or {"fov": 40.0, "elevation": 20.0, "azimuth": 30.0}))
        self._axes = scene.visuals.Line(parent=self._view.scene, connect="segments", width=1.0)
        # the three labels in one visual: one draw call, not three (each costs on a software renderer)
        self._axis_text = scene.visuals.Text(["", "", ""], pos=np.zeros((3, 3), np.float32), parent=self._view.scene,
                                             font_size=8, anchor_x="center", anchor_y="bottom")
        self._points = scene.visuals.Markers(parent=self._view.scene)
        self._lit = scene.visuals.Markers(parent=self._view.scene)
        self._ring = scene.visuals.Markers(parent=self._view.scene)
        for overlay in (self._lit, self._ring, self._axis_text):   # drawn after the points and over them
            overlay.set_gl_state("translucent", depth_test=False)
            overlay.order = 1
        self.canvas.events.mouse_move.connect(self._on_move)
        self.canvas.events.draw.connect(self._draw_started, position="first")
        self.canvas.events.draw.connect(self._draw_finished, position="last")
        self.canvas.events.mouse_release.connect(self._on_release)
        self.canvas.events.initialize.connect(self._on_initialize)
        self._inits = 0

    def _drop_canvas(self) -> None:
        """Close the canvas (its GL context goes with its widget)."""
        if self.canvas is None:
            return
        native = self.canvas.native
        self.canvas.close()
        native.setParent(None)
        native.deleteLater()
        self.canvas = self._view = self._points = self._lit = self._ring = self._axes = self._axis_text = None

    def _on_initialize(self, event: object) -> None:
        self._inits += 1
        if self._inits > 1:
            # Qt gave the widget a new GL context (its dock floated or docked: a new window), and vispy's
            # GL objects died with the old one. Draw nothing until a new canvas replaces this one.
            for visual in (self._points, self._lit, self._ring, self._axes, self._axis_text):
                visual.visible = False
            QTimer.singleShot(0, self, self._rebuild_canvas)

    def _rebuild_canvas(self) -> None:
        """A new canvas in place of one whose GL context was replaced, seen from the same camera."""
        if self.canvas is None or self._closed:
            return
        cam = self._view.camera
        camera = {"fov": cam.fov, "elevation": cam.elevation, "azimuth": cam.azimuth, "distance": cam.distance,
                  "scale_factor": cam.scale_factor, "center": tuple(cam.center)}
        self._drop_canvas()
        self._ensure_canvas(camera)
        self._draw_points()
        self._draw_axes()
        self._draw_overlays()

    def _frame(self) -> None:
        """Point the camera at the atlas's experts, all in view (the turn the user gave it stays)."""
        if self._view is None or self.data is None:
            return
        centre, scale = framing(self.data.positions)
        # a scale factor, not a distance: vispy then backs off to fit the narrower side (a tall canvas cropped the sides)
        camera = self._view.camera
        camera.center, camera.scale_factor, camera.distance = centre, scale, None

    def _sizes(self) -> np.ndarray:
        """Marker diameters [N] px of the atlas's experts (`marker_sizes`)."""
        return marker_sizes(self.data.selections)

    def _draw_points(self) -> None:
        if self._points is None or self.data is None:
            return
        data, theme = self.data, self.theme
        colours = np.array([theme.topic(t) for t in range(len(data.topics))] + [theme.unused], np.float32) / 255
        faces = np.ones((len(data), 4), np.float32)
        faces[:, :3] = colours[data.top]           # row -1 (never chosen) is the last colour
        self._points.set_data(data.positions, face_color=faces, size=self._sizes(), edge_width=0)

    def _draw_axes(self) -> None:
        """The projection's three axes from the origin past the experts, each labelled with its share of the spread."""
        if self._axes is None or self.data is None:
            return
        positions = self.data.positions
        segments = np.zeros((6, 3), np.float32)                                    # [6, 3] origin, end, ...
        segments[1::2] = np.diag(axis_ends(positions))
        self._axes.set_data(pos=segments, color=(*(np.array(self.theme.muted) / 255), 1.0))
        self._axis_text.text = axis_labels(self.data)
        self._axis_text.pos = label_positions(positions)
        self._axis_text.color = (*(np.array(self.theme.foreground) / 255), 1.0)

    def _draw_overlays(self) -> None:
        if self._lit is None or self.data is None:
            return
        theme = self.theme
        rows = self.lit_rows
        flash = (*(np.array(theme.flash) / 255), 1.0)
        if len(rows):
            self._lit.set_data(self.data.positions[rows], face_color=flash, size=self._sizes()[rows] + 6,
                               edge_width=1.0, edge_color=(*(np.array(theme.foreground) / 255), 1.0))
        self._lit.visible = bool(len(rows))
        row = self.data.row(*self.selected_key) if self.selected_key is not None else None
        if row is not None:
            self._ring.set_data(self.data.positions[row : row + 1], symbol="ring", size=24,
                                face_color=(*(np.array(theme.foreground) / 255), 1.0), edge_width=0)
        self._ring.visible = row is not None

    def _draw_started(self, event: object) -> None:
        self._draw_start = time.perf_counter()

    def _draw_finished(self, event: object) -> None:
        cost = time.perf_counter() - self._draw_start
        self.draw_cost = cost if self.draw_cost == 0.0 else 0.8 * self.draw_cost + 0.2 * cost

    def _describe(self, key: tuple[int, int] | None) -> None:
        if key is None or self.data is None:
            return
        self.legend.info.setText(self.tr("selected: {expert}").format(expert=layer_expert(*key))
                                 + f"\n{describe_expert(self.data, *key)}")

    def _on_move(self, event: object) -> None:
        if event.is_dragging or self.data is None:
            return
        row = self.pick(*event.pos[:2])
        key = tuple(int(v) for v in self.data.keys[row]) if row is not None else None
        if key == self.hovered:
            return
        self.hovered = key
        if key is None:
            QToolTip.hideText()
            return
        text = f"{layer_expert(*key)}\n{describe_expert(self.data, *key)}"
        self.legend.info.setText(text)
        native = self.canvas.native
        QToolTip.showText(native.mapToGlobal(QPoint(int(event.pos[0]), int(event.pos[1]))), text, native)

    def _on_release(self, event: object) -> None:
        press = event.press_event
        if self.data is None or event.button != 1 or press is None or np.hypot(*(np.asarray(event.pos) - press.pos)) > CLICK_SLOP:
            return
        row = self.pick(*event.pos[:2])
        if row is None:
            return
        key = (int(self.data.keys[row, 0]), int(self.data.keys[row, 1]))
        self.set_selected(key)
        self.selected.emit(*key)
