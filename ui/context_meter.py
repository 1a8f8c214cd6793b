"""The context-used indicator under the chat: tokens of the context the conversation takes (its prompt and the
last answer, as the engine counted them) of the context length in force, with a thin bar that turns amber
past WARN_AT. Its tooltip says what happens when the context fills, which depends on the KV overflow policy
the model was opened with (engine.kv)."""

from __future__ import annotations

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPaintEvent, QPalette
from PySide6.QtWidgets import QHBoxLayout, QLabel, QSizePolicy, QWidget

WARN_AT = 0.8                       # past this share of the context the bar turns amber
AMBER = QColor(230, 150, 20)        # reads as a warning on the light and the dark palette alike

# what the engine does when the context fills, per KV overflow policy (None: a server decides); shown translated
WHEN_FULL = {
    "error": QT_TRANSLATE_NOOP("ContextMeter", "When it is full, the answer stops there and a question that no "
                               "longer fits is refused: start a new chat, or raise Context length in Controls."),
    "slide": QT_TRANSLATE_NOOP("ContextMeter", "When it is full, the oldest tokens are dropped to make room: the "
                               "model forgets the start of the conversation."),
    "retain": QT_TRANSLATE_NOOP("ContextMeter", "When it is full, the engine keeps the first tokens, the latest ones "
                                "and those that drew the most attention, and drops the rest: the model forgets parts "
                                "of the conversation."),
    None: QT_TRANSLATE_NOOP("ContextMeter", "When it is full, the server decides: by default it stops the answer and "
                            "refuses a question that no longer fits."),
}


class _Bar(QWidget):
    """A thin horizontal bar: the used share of the context, in the accent or, past WARN_AT, amber."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.fraction = 0.0
        self.setFixedHeight(5)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:
        return QSize(120, 5)

    def color(self) -> QColor:
        """The fill's colour."""
        return AMBER if self.fraction > WARN_AT else self.palette().color(QPalette.ColorRole.Highlight)

    def paintEvent(self, event: QPaintEvent) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        p.setPen(Qt.PenStyle.NoPen)
        r = QRectF(self.rect())
        p.setBrush(self.palette().color(QPalette.ColorRole.Mid))
        p.drawRoundedRect(r, 2, 2)
        if self.fraction > 0:
            p.setBrush(self.color())
            p.drawRoundedRect(QRectF(r.x(), r.y(), r.width() * min(1.0, self.fraction), r.height()), 2, 2)
        p.end()


class ContextMeter(QWidget):
    """'Context 1,234 / 4,096' and a bar; used None reads as not counted yet, total None as no model."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.used: int | None = None
        self.total: int | None = None
        self.overflow: str | None = "error"
        self.label = QLabel()
        self.label.setObjectName("contextLabel")
        self.bar = _Bar()
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.label)
        layout.addWidget(self.bar, 1, Qt.AlignmentFlag.AlignVCenter)
        self._show()

    @property
    def fraction(self) -> float:
        """The used share of the context (0 when either is unknown)."""
        return self.used / self.total if self.used is not None and self.total else 0.0

    @property
    def warning(self) -> bool:
        """Whether the context is nearly full (the bar is amber)."""
        return self.fraction > WARN_AT

    def set_total(self, total: int | None) -> None:
        """The context length in force (None: no model)."""
        self.total = total
        self._show()

    def set_used(self, used: int | None) -> None:
        """Tokens the conversation takes (None: not counted yet)."""
        self.used = used
        self._show()

    def set_overflow(self, overflow: str | None) -> None:
        """The KV overflow policy the model runs with ("error", "slide", "retain"; None: a server's)."""
        self.overflow = overflow
        self._show()

    def _show(self) -> None:
        if self.total is None:
            self.label.setText(self.tr("Context: no model"))
        else:
            used = "—" if self.used is None else f"{self.used:,}"
            self.label.setText(self.tr("Context {used} / {total}").format(used=used, total=f"{self.total:,}"))
        self.bar.fraction = self.fraction
        self.bar.update()
        if self.total is None:
            tip = self.tr("The context the conversation takes, once a model is open.")
        elif self.used is None:
            tip = self.tr("The context holds {total} tokens; this conversation's share is counted when its next "
                          "answer is written.").format(total=f"{self.total:,}")
        else:
            tip = self.tr("This conversation takes {used} of the {total} tokens of the context ({share}): the prompt "
                          "and the last answer, as the engine counted them.").format(
                used=f"{self.used:,}", total=f"{self.total:,}", share=f"{self.fraction:.0%}")
        when_full = QCoreApplication.translate("ContextMeter", WHEN_FULL.get(self.overflow, WHEN_FULL[None]))
        self.setToolTip(f"{tip}\n{when_full}")
