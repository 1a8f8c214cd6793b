"""Two answers' routing side by side, as a difference drawn on the Brain.

An answer is a run of consecutive decoded tokens in the recorded routing (`Routes.answers`: the prompt between two
answers leaves a gap). With "Compare" on, each cell shows how much more often answer A's tokens chose the expert than
answer B's (A's colour) or the reverse (B's colour), brighter the larger the difference; experts both chose equally
keep a faint mark, unused ones the background.
"""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import Signal
from PySide6.QtWidgets import QCheckBox, QComboBox, QHBoxLayout, QLabel, QSizePolicy, QWidget

from engine.offload.story import Routes
from ui.inspector.common import Theme, swatch_css
from ui.widgets import ElidedLabel

EQUAL_MARK = 0.25       # how far towards the foreground an expert both answers chose equally is drawn


def difference_rgba(theme: Theme, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[L, E, 4] uint8 of two usage grids [L, E] (shares 0..1): A's colour where A chose more, B's where B did."""
    bg = np.array(theme.background, np.float64)
    ca, cb = np.array(theme.phases["attention"], np.float64), np.array(theme.phases["sampling"], np.float64)
    fg = np.array(theme.foreground, np.float64)
    diff = a - b                                                                     # [L, E] -1..1
    both = np.minimum(a, b) > 0                                                      # [L, E]
    base = bg + (fg - bg) * EQUAL_MARK * both[..., None]                             # [L, E, 3]
    more_a, more_b = np.clip(diff, 0, 1)[..., None], np.clip(-diff, 0, 1)[..., None]
    level = np.sqrt(more_a + more_b)                 # small differences stay visible
    target = np.where(more_a > 0, ca, cb)                                            # [L, E, 3]
    rgb = base + (target - base) * level
    rgba = np.empty((*a.shape, 4), np.uint8)
    rgba[..., :3] = np.clip(np.round(rgb), 0, 255)
    rgba[..., 3] = 255
    return rgba


class CompareBar(QWidget):
    """"Compare" and the two answers compared; `changed` when any of them changes."""

    changed = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.on = QCheckBox(self.tr("Compare answers"))
        self.on.setToolTip(self.tr("draw two answers' routing on the Brain as a difference"))
        self.first, self.second = QComboBox(), QComboBox()
        for box in (self.first, self.second):
            # as wide as its longest answer: sized to the empty list it was first shown with, it showed "answer 2" alone
            box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)
            # and never squeezed below that by a narrow pane or a wider font: the summary beside them elides instead
            box.setSizePolicy(QSizePolicy.Policy.Fixed, QSizePolicy.Policy.Fixed)
        self.swatch_a, self.swatch_b = QLabel(), QLabel()
        self.summary = ElidedLabel("")   # one line at any width: a long difference widened the whole pane
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.on)
        for swatch, box, text in ((self.swatch_a, self.first, "A"), (self.swatch_b, self.second, "B")):
            swatch.setFixedSize(12, 12)
            layout.addWidget(swatch)
            layout.addWidget(QLabel(text))
            layout.addWidget(box)
        layout.addWidget(self.summary, 1)
        self.answers: list[tuple[int, int]] = []
        self.routes: Routes | None = None
        self._grids: tuple[object, tuple[np.ndarray, np.ndarray]] | None = None   # the last `grids`, by its inputs
        self.on.toggled.connect(self._changed)
        self.first.currentIndexChanged.connect(self._changed)
        self.second.currentIndexChanged.connect(self._changed)
        self._enable()

    @property
    def active(self) -> bool:
        """Whether the Brain draws the difference."""
        return self.on.isChecked() and self.first.currentIndex() >= 0 and self.second.currentIndex() >= 0

    def set_theme(self, theme: Theme) -> None:
        """The swatches in the answers' colours."""
        self.swatch_a.setStyleSheet(swatch_css(theme.phases["attention"]))
        self.swatch_b.setStyleSheet(swatch_css(theme.phases["sampling"]))

    def set_routes(self, routes: Routes | None) -> None:
        """The recorded routing: its answers fill the two lists (the choices kept while those answers remain)."""
        if routes is self.routes:
            return
        self.routes = routes
        answers = routes.answers() if routes is not None else []
        if answers != self.answers:
            chosen = [self._answer(box) for box in (self.first, self.second)]
            self.answers = answers
            for box, keep, default in ((self.first, chosen[0], -2), (self.second, chosen[1], -1)):
                box.blockSignals(True)
                box.clear()
                box.addItems([self.tr("answer {n}: tokens {first}-{last}").format(n=i + 1, first=f, last=la)
                              for i, (f, la) in enumerate(answers)])
                index = answers.index(keep) if keep in answers else max(len(answers) + default, 0)
                box.setCurrentIndex(index if answers else -1)
                box.blockSignals(False)
        self._enable()

    def grids(self, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """The usage grids [L, E] of answers A and B (worked out again only when the routing or a choice changed)."""
        routes, a, b = self.routes, self._answer(self.first), self._answer(self.second)
        if routes is None or a is None or b is None:
            raise ValueError("no two answers to compare: check `active` first")
        key = (id(routes), a, b, shape)
        if self._grids is None or self._grids[0] != key:
            self._grids = (key, (routes.usage(*a, shape), routes.usage(*b, shape)))
        return self._grids[1]

    def _answer(self, box: QComboBox) -> tuple[int, int] | None:
        i = box.currentIndex()
        return self.answers[i] if 0 <= i < len(self.answers) else None

    def _enable(self) -> None:
        self.on.setEnabled(len(self.answers) > 0)
        for box in (self.first, self.second):
            box.setEnabled(len(self.answers) > 0)

    def _changed(self, *args: object) -> None:
        self.changed.emit()
