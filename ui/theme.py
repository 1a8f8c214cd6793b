"""The app's look: the Fusion style with a light or dark palette that follows the system, and the icon.

Views read their colours from the palette (`chat_colors`), so a theme change repaints them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication, Qt
from PySide6.QtGui import QColor, QIcon, QPalette
from PySide6.QtWidgets import QApplication

ASSETS = Path(__file__).resolve().parent.parent / "assets"   # beside the packages, as app/atlas/probes.py finds it
ICON = ASSETS / "icon.svg"
ACCENT = QColor(20, 150, 130)   # the hummingbird's teal


def app_icon() -> QIcon:
    """The app icon: the SVG, with the pre-rendered PNG sizes when they are there."""
    icon = QIcon()
    for png in sorted((ASSETS / "icons").glob("colibri-*.png")):
        icon.addFile(str(png))
    if ICON.is_file():
        icon.addFile(str(ICON))
    return icon


def palette(dark: bool) -> QPalette:
    """A calm palette for Fusion, light or dark, with the accent as highlight."""
    p = QPalette()
    if dark:
        base, window, text, button, mid = QColor(30, 32, 36), QColor(38, 40, 45), QColor(225, 227, 230), \
            QColor(48, 51, 57), QColor(70, 74, 82)
        alt, disabled, link = QColor(44, 46, 52), QColor(120, 124, 132), QColor(90, 200, 180)
    else:
        base, window, text, button, mid = QColor(255, 255, 255), QColor(243, 244, 246), QColor(28, 30, 34), \
            QColor(236, 237, 240), QColor(190, 194, 200)
        alt, disabled, link = QColor(248, 249, 250), QColor(150, 154, 160), QColor(10, 120, 105)
    R, G = QPalette.ColorRole, QPalette.ColorGroup
    for role, color in ((R.Window, window), (R.WindowText, text), (R.Base, base), (R.AlternateBase, alt),
                        (R.Text, text), (R.Button, button), (R.ButtonText, text), (R.ToolTipBase, base),
                        (R.ToolTipText, text), (R.PlaceholderText, disabled), (R.Mid, mid), (R.Link, link),
                        (R.Highlight, ACCENT), (R.HighlightedText, QColor(255, 255, 255)),
                        (R.BrightText, QColor(255, 90, 90))):
        p.setColor(role, color)
    for role in (R.WindowText, R.Text, R.ButtonText):
        p.setColor(G.Disabled, role, disabled)
    return p


def set_palette(app: QApplication, dark: bool) -> None:
    """Give the app the light or dark palette; in the dark one, check boxes and radio buttons get a visible edge.

    Fusion outlines an indicator in the window colour darkened, which on the dark window is the box's own fill:
    an unchecked "Greedy" was a dark square on a dark background. These widgets paint no background of their own,
    so a lighter window colour for them alone changes only that outline (setting the app palette drops it again).
    """
    p = palette(dark)
    app.setPalette(p)
    if dark:
        edge = QColor(120, 126, 138)
        indicators = QPalette(p)
        indicators.setColor(QPalette.ColorRole.Window, edge.lighter(127))   # Fusion: window.darker(140).lighter(110)
        for name in ("QCheckBox", "QRadioButton"):
            app.setPalette(indicators, name)


THEMES = ("system", "light", "dark")   # the View > Theme choices
THEME_NAMES = {"system": QT_TRANSLATE_NOOP("Theme", "System"), "light": QT_TRANSLATE_NOOP("Theme", "Light"),
               "dark": QT_TRANSLATE_NOOP("Theme", "Dark")}


def theme_name(choice: str) -> str:
    """A theme's name as the menus show it, in the language of the UI."""
    return QCoreApplication.translate("Theme", THEME_NAMES[choice])


def apply_theme(app: QApplication, choice: str = "system") -> None:
    """Fusion with a light or dark palette: the system's (re-applied when the system switches), or the one chosen."""
    if choice not in THEMES:
        raise ValueError(f"theme {choice!r}: choose one of {', '.join(THEMES)}")
    app.setStyle("Fusion")
    app.setProperty("colibriTheme", choice)
    if choice == "system":
        follow_scheme(app, app.styleHints().colorScheme())
    else:
        set_palette(app, choice == "dark")
    if not app.property("colibriThemed"):
        app.styleHints().colorSchemeChanged.connect(lambda scheme: follow_scheme(app, scheme))
        app.setProperty("colibriThemed", True)


def follow_scheme(app: QApplication, scheme: Qt.ColorScheme) -> None:
    """Take the palette of a colour scheme (Unknown counts as light) unless the user chose a theme; every widget
    repaints with it."""
    if app.property("colibriTheme") in (None, "system"):
        set_palette(app, scheme == Qt.ColorScheme.Dark)


@dataclass(frozen=True)
class ChatColors:
    """Colours of the transcript, derived from a palette."""

    user: QColor
    assistant: QColor
    muted: QColor
    error: QColor
    code_background: QColor


def chat_colors(p: QPalette) -> ChatColors:
    """The transcript's colours for palette p."""
    dark = p.color(QPalette.ColorRole.Window).lightness() < 128
    base = p.color(QPalette.ColorRole.Base)
    code = base.lighter(135) if dark else base.darker(106)
    return ChatColors(
        user=QColor(110, 170, 255) if dark else QColor(30, 90, 190),
        assistant=QColor(90, 200, 180) if dark else ACCENT.darker(115),
        muted=p.color(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Text),
        error=QColor(255, 110, 100) if dark else QColor(190, 40, 30),
        code_background=code,
    )
