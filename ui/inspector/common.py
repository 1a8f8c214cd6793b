"""Colours and number formats shared by the inspector's views, for light and dark palettes.

A `Theme` is derived from the widget's QPalette (dark when the window colour is dark), so the
views follow the desktop theme and re-theme on a palette change. Colours are RGB tuples (0..255)
so numpy (Brain) and vispy (Atlas) can use them as well as Qt.

pyqtgraph's global config is left alone: the Brain's ImageItem is built with
`axisOrder="row-major"` (a per-item option), which has the effect of
`pg.setConfigOptions(imageAxisOrder="row-major")` without changing other plots of the process.

Software rendering is the budget: Qt's raster engine blends translucent lines and fills pixel by
pixel, so grids and areas are drawn in opaque colours mixed with the background beforehand (a
translucent grid alone takes a large share of a frame's budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyqtgraph as pg
from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication
from PySide6.QtGui import QColor, QPalette

from engine.offload.budget import format_bytes
from ui.inspector.data import TIER_CACHED, TIER_DISK, TIER_NONE, TIER_PINNED, TIER_RESIDENT, TIER_UNKNOWN, AtlasData

RGB = tuple[int, int, int]

REDRAW_HZ = 30  # figures (numbers, the Brain) redraw at most this often, whatever the token rate
PLOT_HZ = 5     # plots (curves, bars) redraw at most this often: they cost several ms a frame

# Categorical topic colours, chosen to stay apart on light and dark backgrounds; none grey (`Theme.unused` is "no
# topic") and none too dark for a dark background.
_TOPICS: tuple[RGB, ...] = (
    (31, 119, 200), (235, 120, 20), (40, 160, 70), (210, 45, 50), (140, 90, 190), (150, 95, 70),
    (220, 100, 180), (150, 165, 30), (80, 85, 225), (20, 180, 190), (95, 60, 140), (250, 160, 150),
)


@dataclass(frozen=True)
class Theme:
    """The inspector's colours for one palette."""

    dark: bool
    background: RGB          # plot and grid background (the palette's Base)
    foreground: RGB          # text, the selection outline (WindowText)
    muted: RGB               # axis lines (Mid)
    tiers: dict[int, RGB]    # tier code -> its colour (the Brain brightens it to full for the hottest experts)
    phases: dict[str, RGB]   # telemetry phase -> bar colour
    flash: RGB               # experts routed by the current token
    unused: RGB              # experts never chosen by the atlas probes

    def topic(self, index: int) -> RGB:
        """Colour of topic `index` (-1: no topic)."""
        if index < 0:
            return self.unused
        base = _TOPICS[index % len(_TOPICS)]
        if index < len(_TOPICS):
            return base
        k = 0.6 if self.dark else 1.4  # a second round of the same hues, lighter or darker
        return tuple(int(min(255, c * k)) for c in base)  # type: ignore[return-value]

    def qcolor(self, rgb: RGB, alpha: int = 255) -> QColor:
        """A QColor of rgb."""
        return QColor(rgb[0], rgb[1], rgb[2], alpha)

    def over_background(self, rgb: RGB, opacity: float) -> QColor:
        """The opaque colour rgb at `opacity` shows over the background (cheap to paint, unlike alpha)."""
        return QColor(*(round(b + (c - b) * opacity) for c, b in zip(rgb, self.background)))


def theme_for(palette: QPalette) -> Theme:
    """The theme of a palette: dark when its window colour is dark; background, text and lines from its roles."""

    def rgb(role: QPalette.ColorRole) -> RGB:
        c = palette.color(role)
        return c.red(), c.green(), c.blue()

    dark = palette.color(QPalette.ColorRole.Window).lightness() < 128
    bg, fg, muted = rgb(QPalette.ColorRole.Base), rgb(QPalette.ColorRole.WindowText), rgb(QPalette.ColorRole.Mid)
    if dark:
        return Theme(
            dark=True, background=bg, foreground=fg, muted=muted,
            tiers={TIER_DISK: (120, 150, 160), TIER_CACHED: (60, 200, 120), TIER_PINNED: (200, 110, 255),
                   TIER_RESIDENT: (80, 170, 235), TIER_UNKNOWN: (170, 170, 170)},
            phases={"attention": (80, 150, 235), "dense": (40, 185, 180), "experts": (170, 120, 250),
                    "io_wait": (235, 85, 80), "sampling": (240, 190, 60), "other": (130, 135, 145)},
            flash=(255, 225, 40), unused=(90, 92, 98),
        )
    return Theme(
        dark=False, background=bg, foreground=fg, muted=muted,
        tiers={TIER_DISK: (120, 150, 160), TIER_CACHED: (25, 150, 80), TIER_PINNED: (120, 65, 210),
               TIER_RESIDENT: (30, 110, 200), TIER_UNKNOWN: (110, 110, 110)},
        phases={"attention": (40, 110, 210), "dense": (20, 150, 145), "experts": (125, 80, 210),
                "io_wait": (215, 55, 50), "sampling": (225, 160, 20), "other": (150, 155, 165)},
        flash=(255, 200, 0), unused=(195, 198, 205),
    )


def live_plot(item: pg.PlotItem, left: str, bottom: str | None = None, x_grid: bool = False) -> None:
    """Set up a plot the views fill from a timer: labelled axes with plain numbers, a grid, no mouse.

    The views set the ranges themselves (auto-range would settle only while painting, and then
    paint again); the SI prefix is off so an axis says "MB", not "MB (x0.001)".
    """
    item.setMenuEnabled(False)
    item.hideButtons()
    item.setMouseEnabled(x=False, y=False)
    item.disableAutoRange()
    item.showGrid(x=x_grid, y=True)
    for name, label in (("left", left), ("bottom", bottom), ("right", None), ("top", None)):
        axis = item.getAxis(name)
        axis.enableAutoSIPrefix(False)                 # hidden axes too: each would relabel itself per range
        axis.setStyle(tickAlpha=255, maxTickLevel=1)  # opaque grid lines of the two coarser levels
        axis.setZValue(-200)                           # ... under the data (the view box sits at -100)
        if label is not None:
            item.setLabel(name, label)


# the tiers' names as the views show them, translated at use (ui.inspector.data stays free of Qt)
TIER_NAMES = {TIER_NONE: QT_TRANSLATE_NOOP("Tiers", "no expert"),
              TIER_DISK: QT_TRANSLATE_NOOP("Tiers", "disk"),
              TIER_CACHED: QT_TRANSLATE_NOOP("Tiers", "cached"),
              TIER_PINNED: QT_TRANSLATE_NOOP("Tiers", "pinned"),
              TIER_RESIDENT: QT_TRANSLATE_NOOP("Tiers", "resident"),
              TIER_UNKNOWN: QT_TRANSLATE_NOOP("Tiers", "unknown")}


def tier_name(code: int | None) -> str:
    """A tier's name in the language of the UI ('?' for a code no tier has)."""
    return QCoreApplication.translate("Tiers", TIER_NAMES[code]) if code in TIER_NAMES else "?"


def describe_expert(atlas: AtlasData, layer: int, expert: int) -> str:
    """One line for a tooltip: the expert's top topic, specialisation and probe selections in the atlas."""
    i = atlas.row(layer, expert)
    if i is None:
        return QCoreApplication.translate("Atlas", "atlas: not mapped")
    if atlas.top[i] < 0:
        return QCoreApplication.translate("Atlas", "atlas: never chosen by the probes")
    return QCoreApplication.translate(
        "Atlas", "atlas topic: {topic} (specialisation {specialisation:.2f}, {n} probe selections)").format(
        topic=atlas.titles[atlas.top[i]], specialisation=float(atlas.specialisation[i]), n=int(atlas.selections[i]))


def layer_expert(layer: int, expert: int) -> str:
    """'layer 3, expert 12', in the language of the UI."""
    return QCoreApplication.translate("Atlas", "layer {layer}, expert {expert}").format(layer=layer, expert=expert)


_NICE = (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)


def nice_ceil(x: float) -> float:
    """The least round number (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8 times a power of ten) >= x; 1 for x <= 0.

    Plots set their ranges to such numbers, so a range (and its axis, costly to redraw) changes
    only when the data outgrows it, not with every sample.
    """
    if not x > 0 or not math.isfinite(x):
        return 1.0
    power = 10.0 ** math.floor(math.log10(x))
    return next(m * power for m in _NICE if m * power >= x * (1 - 1e-12))


def style_plot(plot: pg.PlotWidget | pg.GraphicsLayoutWidget, items: list[pg.PlotItem], theme: Theme) -> None:
    """Give a plot widget and its plot items the theme's background, axis, grid and text colours."""
    plot.setBackground(theme.qcolor(theme.background))
    for item in items:
        for name in ("left", "bottom", "right", "top"):
            axis = item.getAxis(name)
            axis.setPen(theme.qcolor(theme.muted))
            if axis.grid is not False:  # the ticks are grid lines: faint, and opaque
                axis.setTickPen(pg.mkPen(theme.over_background(theme.foreground, 0.15)))
            axis.setTextPen(theme.qcolor(theme.foreground))


def swatch_css(rgb: RGB) -> str:
    """Style sheet of a small colour square (a QLabel)."""
    return f"background-color: rgb{rgb}; border-radius: 2px;"


def fmt_bytes(n: float | None) -> str:
    """Bytes in the decimal units of `--max-memory` and the app: '1.50 GB'; '—' for unknown."""
    if n is None or not math.isfinite(n):
        return "—"
    return format_bytes(n)


def fmt_ms(seconds: float | None) -> str:
    """Seconds as milliseconds: '12.3 ms'; '—' for unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "—"
    ms = seconds * 1e3
    return f"{ms:.3f} ms" if ms < 1 else f"{ms:.1f} ms" if ms < 1000 else f"{seconds:.2f} s"


def fmt_percent(fraction: float | None) -> str:
    """A fraction as a percentage: '87.5%'."""
    if fraction is None or not math.isfinite(fraction):
        return "—"
    return f"{100 * fraction:.1f}%"
