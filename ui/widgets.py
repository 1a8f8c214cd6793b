"""Small widgets of the main window: a status label that elides, the stand-in for a missing inspector, and a
dialog's wrapped message that makes room for itself."""

from __future__ import annotations

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QPainter, QPaintEvent
from PySide6.QtWidgets import QLabel, QWidget


def say_wrapped(dialog: QWidget, label: QLabel, text: str) -> None:
    """Show TEXT in LABEL (a word-wrapped line of DIALOG's layout), the dialog growing taller at its width to hold
    every line: never drawn over its neighbours, and never narrowed as adjustSize would (to about 300 px)."""
    label.setText(text)
    label.setMinimumHeight(label.heightForWidth(max(label.width(), dialog.width() - 40)) if text else 0)
    width = dialog.width()
    layout = dialog.layout()
    dialog.resize(width, max(dialog.height(), dialog.heightForWidth(width), dialog.minimumSizeHint().height()))
    if layout is not None:
        layout.activate()       # now, not at the next event: until then the old spacing overlapped the buttons


TALL_TEXT = "Ag中"      # Latin ascenders and descenders, and a CJK character from whichever font has it


class ElidedLabel(QLabel):
    """A one-line label that elides its text to the width it gets (the whole text in its tooltip), so a status
    line never shows a cut word and never pushes its neighbours away."""

    def setText(self, text: str) -> None:
        super().setText(text)
        self.setToolTip(text)

    def sizeHint(self) -> QSize:
        # as tall for any text: a Chinese one (drawn in a taller fallback font) made the line, and all below it, move
        hint, m = super().sizeHint(), self.contentsMargins()
        tallest = self.fontMetrics().boundingRect(TALL_TEXT).height() + m.top() + m.bottom() + 2 * self.margin()
        return QSize(hint.width(), max(hint.height(), tallest))

    def minimumSizeHint(self) -> QSize:
        return QSize(self.fontMetrics().horizontalAdvance("…") * 4, self.sizeHint().height())

    def elided(self) -> str:
        """The text as drawn at the current width."""
        return self.fontMetrics().elidedText(self.text(), Qt.TextElideMode.ElideRight, self.contentsRect().width())

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        try:
            painter.setPen(self.palette().color(self.foregroundRole()))
            painter.drawText(self.contentsRect(), int(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter),
                             self.elided())
        finally:
            painter.end()


class InspectorPlaceholder(QLabel):
    """Stands in for ui.inspector.Inspector when it cannot be imported."""

    atlasRequested = Signal()
    atlasCancelRequested = Signal()

    def __init__(self, reason: str):
        super().__init__()
        self.setText(self.tr("The inspector is not available ({why}).").format(why=reason))
        self.setWordWrap(True)
        self.setAlignment(Qt.AlignmentFlag.AlignCenter)

    def set_snapshot(self, snapshot) -> None: ...
    def set_generating(self, active: bool) -> None: ...
    def set_model_info(self, n_layers: int, n_experts: int, budget_bytes: int | None) -> None: ...
    def set_tiers(self, tiers) -> None: ...
    def set_cache_trace(self, trace) -> None: ...
    def set_expert_counts(self, counts) -> None: ...
    def set_atlas(self, atlas) -> None: ...
    def set_atlas_progress(self, fraction) -> None: ...
    def close_views(self) -> None: ...
    def forget_model(self) -> None: ...
