"""An expert's story, beside the Brain grid: what the expert cache has done with the selected expert (requests, hits,
reads, read-ahead guesses used and wasted, tier changes with their token), its share of its layer's steps, and its
atlas topic when an atlas is present. Read from the store's counters (`engine.offload.story.ExpertCounts`).
"""

from __future__ import annotations

from PySide6.QtCore import QCoreApplication, Qt, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QToolButton, QVBoxLayout, QWidget

from engine.offload.story import ExpertCounts
from ui.inspector.common import describe_expert, fmt_percent, layer_expert, tier_name
from ui.inspector.data import AtlasData

SHOWN_CHANGES = 8       # the latest tier changes listed


def story_text(counts: ExpertCounts | None, layer: int, expert: int, tier: int | None,
               atlas: AtlasData | None) -> str:
    """The panel's lines for one expert (counters unknown: says so)."""
    lines = [QCoreApplication.translate("StoryPanel", "tier now: {tier}").format(
        tier=tier_name(tier) if tier is not None else QCoreApplication.translate("StoryPanel", "not reported"))]
    if counts is None or not (layer < counts.hits.shape[0] and expert < counts.hits.shape[1]):
        lines.append(QCoreApplication.translate("StoryPanel", "no expert cache counters: its experts are not streamed"))
    else:
        s = counts.story(layer, expert)
        steps = int(counts.steps[layer])
        lines += [
            QCoreApplication.translate("StoryPanel", "chosen by {n} of the layer's {steps} steps ({share})").format(
                n=s.requests, steps=steps, share=fmt_percent(s.share)),
            QCoreApplication.translate("StoryPanel", "served from memory {hits}, waited for disk {misses}").format(
                hits=s.hits, misses=s.misses),
            QCoreApplication.translate("StoryPanel", "reads from disk: {n}").format(n=s.reads),
            QCoreApplication.translate("StoryPanel", "read ahead: {used} used, {wasted} wasted").format(
                used=s.ahead_used, wasted=s.ahead_wasted)]
        if s.changes:
            latest = ", ".join(f"{token}: {tier_name(t)}" for token, t in s.changes[-SHOWN_CHANGES:])
            if len(s.changes) > SHOWN_CHANGES:
                lines.append(QCoreApplication.translate(
                    "StoryPanel", "tier changes at token (latest {shown} of {n}): {changes}").format(
                    shown=SHOWN_CHANGES, n=len(s.changes), changes=latest))
            else:
                lines.append(QCoreApplication.translate("StoryPanel", "tier changes at token: {changes}").format(
                    changes=latest))
        else:
            lines.append(QCoreApplication.translate("StoryPanel", "tier changes: none kept"))
    if atlas is None:
        lines.append(QCoreApplication.translate("StoryPanel", "atlas: none yet (compute it in the Atlas tab)"))
    else:
        lines.append(describe_expert(atlas, layer, expert))
        near = atlas.affinities(layer, expert)
        if near:
            lines.append(QCoreApplication.translate("StoryPanel", "topic affinities: {topics}").format(
                topics=", ".join(f"{title} {fmt_percent(share)}" for title, share in near)))
    return "\n".join(lines)


class StoryPanel(QFrame):
    """The story of the selected expert; `closed` when the user dismisses it."""

    closed = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.title = QLabel("")
        self.title.setStyleSheet("font-weight: bold;")
        close = QToolButton()
        close.setText("×")
        close.setToolTip(self.tr("close the expert's story"))
        close.clicked.connect(self._close)
        head = QHBoxLayout()
        head.addWidget(self.title, 1)
        head.addWidget(close)
        self.body = QLabel("")
        self.body.setWordWrap(True)
        self.body.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.body.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout = QVBoxLayout(self)
        layout.addLayout(head)
        layout.addWidget(self.body, 1)
        self.setFixedWidth(260)
        self.setVisible(False)

    def show_story(self, layer: int, expert: int, text: str) -> None:
        """Show one expert's lines."""
        self.title.setText(layer_expert(layer, expert))
        if self.body.text() != text:
            self.body.setText(text)
        self.setVisible(True)

    def _close(self) -> None:
        self.setVisible(False)
        self.closed.emit()
