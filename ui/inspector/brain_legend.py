"""The Brain's legend and filters: the colour map the grid shows, what its colours mean, which experts it dims.

`BrainLegend` holds the user's choice (a map of ui/inspector/colours.py, the tiers shown, one topic or all) and keeps
it in QSettings (`KEY_MAP`, `KEY_TIERS`, `KEY_TOPIC`) when given some, so a new Inspector opens as the last one was
left; `changed` asks the Brain to draw its last frame again. The key is one rich-text label, set again only when
what it says changes (a topic appears, the map or the theme changes), not at every frame. A tier's swatch is a
cold cell beside a hot one, both exactly as the grid draws them.
"""

from __future__ import annotations

from html import escape

from PySide6.QtCore import QSettings, Qt, Signal
from PySide6.QtWidgets import QCheckBox, QComboBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from ui.inspector.colours import (
    AHEAD,
    MAP_AHEAD,
    MAP_RECENCY,
    MAP_TIERS,
    MAP_TOPIC,
    MAPS,
    RECENCY,
    ramp_colour,
    tier_colour,
)
from ui.inspector.common import RGB, Theme, tier_name
from ui.inspector.data import TIER_CACHED, TIER_DISK, TIER_PINNED, TIER_RESIDENT, AtlasData

KEY_MAP = "inspector/brain_map"          # QSettings: the colour map's name (colours.MAPS)
KEY_TIERS = "inspector/brain_tiers"      # the tier codes shown, space-separated ("" for none)
KEY_TOPIC = "inspector/brain_topic"      # the topic id shown alone ("" for all topics)
TIERS = (TIER_PINNED, TIER_CACHED, TIER_DISK, TIER_RESIDENT)   # the tiers a filter can leave out


class BrainLegend(QWidget):
    """The colour-map choice and key on one row, the tier and topic filters on the next."""

    changed = Signal()      # the map or a filter changed: draw again

    def __init__(self, theme: Theme, settings: QSettings | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.settings = settings
        self.maps = QComboBox()
        for name, text in ((MAP_TIERS, self.tr("Tier and heat")), (MAP_TOPIC, self.tr("Topic")),
                           (MAP_RECENCY, self.tr("Recency")), (MAP_AHEAD, self.tr("Read-ahead outcome"))):
            self.maps.addItem(text, name)
        self.maps.setToolTip(self.tr("What a cell's colour shows"))
        self.key = QLabel()
        self.key.setTextFormat(Qt.TextFormat.RichText)
        self.key.setWordWrap(True)
        self.tier_boxes = {code: QCheckBox(tier_name(code)) for code in TIERS}
        for box in self.tier_boxes.values():
            box.setChecked(True)
            box.setToolTip(self.tr("Unticked, the tier's experts are dimmed"))
        self.topics = QComboBox()
        self.topics.setToolTip(self.tr("Dim the experts whose strongest atlas topic is another"))
        self.status = QLabel("")

        top = QHBoxLayout()
        top.addWidget(QLabel(self.tr("Colour:")))
        top.addWidget(self.maps)
        top.addSpacing(8)
        top.addWidget(self.key, 1)
        filters = QHBoxLayout()
        filters.addWidget(QLabel(self.tr("Show:")))
        for box in self.tier_boxes.values():
            filters.addWidget(box)
        filters.addSpacing(8)
        filters.addWidget(self.topics)
        filters.addStretch(1)
        filters.addWidget(self.status)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(top)
        layout.addLayout(filters)

        self.theme = theme
        self.atlas: AtlasData | None = None
        self.entries: list[tuple[tuple[RGB, ...], str]] = []   # the key as shown: (swatch colours, left to right; words)
        self._wanted_topic = ""                           # the topic id chosen (kept while no atlas offers it)
        self._shown: tuple = ()                           # what the key was built from
        self._restore()
        self._fill_topics()
        self.maps.currentIndexChanged.connect(self._changed)
        for box in self.tier_boxes.values():
            box.toggled.connect(self._changed)
        self.topics.currentIndexChanged.connect(self._topic_chosen)

    # --- the choice ---------------------------------------------------------------------------

    @property
    def colour_map(self) -> str:
        """The map shown (a name of colours.MAPS)."""
        return str(self.maps.currentData())

    def set_colour_map(self, name: str) -> None:
        """Show map `name` (ValueError for a name no map has)."""
        if name not in MAPS:
            raise ValueError(f"no colour map {name!r}: choose one of {', '.join(MAPS)}")
        self.maps.setCurrentIndex(self.maps.findData(name))

    @property
    def shown_tiers(self) -> frozenset[int]:
        """The tier codes whose experts are drawn undimmed."""
        return frozenset(code for code, box in self.tier_boxes.items() if box.isChecked())

    @property
    def filtering(self) -> bool:
        """Whether a filter leaves anything out (a tier unticked, one topic chosen)."""
        return len(self.shown_tiers) < len(TIERS) or self.topic() is not None

    def topic(self) -> int | None:
        """The atlas topic (an index into its topics) whose experts alone are undimmed; None: all topics."""
        tid = self.topics.currentData()
        if not tid or self.atlas is None or tid not in self.atlas.topics:
            return None
        return self.atlas.topics.index(tid)

    def set_atlas(self, atlas: AtlasData | None) -> None:
        """Offer the topics of a new atlas in the topic filter (the one chosen stays chosen if it has it)."""
        if atlas is not self.atlas:
            self.atlas = atlas
            self._fill_topics()

    # --- the key ------------------------------------------------------------------------------

    def set_theme(self, theme: Theme) -> None:
        """Recolour the key."""
        self.theme = theme
        self._shown = ()

    def show_key(self, topics: tuple[int, ...], counted: bool) -> None:
        """The key of the map shown: `topics` those some expert of the grid has as its strongest (the Topic map's),
        `counted` whether the frames carry per-expert counters (Recency and Read-ahead outcome need them)."""
        shown = (self.colour_map, self.theme, self.atlas, topics, counted)
        if shown == self._shown:
            return
        self._shown = shown
        self.entries = self._entries(topics, counted)
        parts = []
        for colours, text in self.entries:
            # an entry never breaks across lines ("brighter =" / "routed more lately"); lines break between entries
            words = escape(text).replace(" ", "&nbsp;")
            width = "&nbsp;" * (4 // max(len(colours), 1))      # a swatch of two colours is as wide as one of one
            swatch = "".join(f'<span style="background-color: rgb{tuple(rgb)};">{width}</span>' for rgb in colours)
            parts.append(f"{swatch}&nbsp;{words}" if colours else words)
        self.key.setText("&nbsp;&nbsp; ".join(parts))

    def _entries(self, topics: tuple[int, ...], counted: bool) -> list[tuple[tuple[RGB, ...], str]]:
        theme, name = self.theme, self.colour_map
        heat = ((), self.tr("brighter = routed more lately"))
        if name == MAP_TOPIC:
            if self.atlas is None:
                keys = [((theme.unused,), self.tr("no atlas topic")), ((), self.tr("no atlas yet: compute one in the "
                                                                                  "Atlas tab"))]
            else:
                keys = [((theme.topic(t),), self.atlas.titles[t]) for t in topics]
                keys += [((theme.unused,), self.tr("no atlas topic")), heat]
        elif name in (MAP_RECENCY, MAP_AHEAD):
            if name == MAP_RECENCY:
                keys = [((ramp_colour(RECENCY, 1.0),), self.tr("chosen by the latest token")),
                        ((ramp_colour(RECENCY, 0.5),), self.tr("a while ago")),
                        ((ramp_colour(RECENCY, 0.0),), self.tr("longest unchosen")),
                        ((theme.unused,), self.tr("never chosen")),
                        ((), self.tr("brighter = chosen more recently (log scale)"))]
            else:
                keys = [((ramp_colour(AHEAD, 1.0),), self.tr("reads ahead all used")),
                        ((ramp_colour(AHEAD, 0.5),), self.tr("half used")),
                        ((ramp_colour(AHEAD, 0.0),), self.tr("all wasted")),
                        ((theme.unused,), self.tr("no reads ahead"))]
            if not counted:
                keys.append(((), self.tr("no expert cache counters: its experts are not streamed")))
        else:   # each tier cold, then hot: what its cells look like
            keys = [((tier_colour(theme, code, 0.0), tier_colour(theme, code, 1.0)), tier_name(code)) for code in TIERS]
            keys.append(heat)
        return keys + [((theme.flash,), self.tr("current token")),
                       ((theme.phases["io_wait"],), self.tr("read from disk (replay)"))]

    # --- internals ----------------------------------------------------------------------------

    def _restore(self) -> None:
        """The choice kept in the settings, if any (no `changed`: nothing is drawn yet)."""
        s = self.settings
        if s is None:
            return
        name = str(s.value(KEY_MAP, MAP_TIERS))
        self.maps.setCurrentIndex(max(0, self.maps.findData(name)))
        tiers = s.value(KEY_TIERS)
        if tiers is not None:
            shown = {int(t) for t in str(tiers).split() if t.lstrip("-").isdigit()}
            for code, box in self.tier_boxes.items():
                box.setChecked(code in shown)
        self._wanted_topic = str(s.value(KEY_TOPIC, "") or "")

    def _save(self) -> None:
        s = self.settings
        if s is None:
            return
        s.setValue(KEY_MAP, self.colour_map)
        s.setValue(KEY_TIERS, " ".join(str(code) for code in TIERS if code in self.shown_tiers))
        s.setValue(KEY_TOPIC, self._wanted_topic)

    def _fill_topics(self) -> None:
        """The topic filter's items: all topics, then the atlas's (disabled without an atlas)."""
        self.topics.blockSignals(True)
        self.topics.clear()
        self.topics.addItem(self.tr("all topics"), "")
        atlas = self.atlas
        if atlas is not None:
            for tid, title in zip(atlas.topics, atlas.titles):
                self.topics.addItem(title, tid)
        self.topics.setCurrentIndex(max(0, self.topics.findData(self._wanted_topic)))
        self.topics.setEnabled(atlas is not None and len(atlas.topics) > 0)
        self.topics.blockSignals(False)

    def _topic_chosen(self, index: int) -> None:
        self._wanted_topic = str(self.topics.currentData() or "")
        self._changed()

    def _changed(self, *args: object) -> None:
        self._save()
        self.changed.emit()
