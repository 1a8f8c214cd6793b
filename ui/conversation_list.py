"""The list of saved conversations: pick one, start a new one, delete one."""

from __future__ import annotations

import time

from PySide6.QtCore import QPoint, Qt, Signal
from PySide6.QtWidgets import QListWidget, QListWidgetItem, QMenu, QPushButton, QVBoxLayout, QWidget

from app.conversations import Conversation

_ID = Qt.ItemDataRole.UserRole


def when(t: float, now: float | None = None) -> str:
    """'just now', '5 min ago', '3 h ago', or the date."""
    age = (time.time() if now is None else now) - t
    if age < 60:
        return "just now"
    if age < 3600:
        return f"{int(age // 60)} min ago"
    if age < 86400:
        return f"{int(age // 3600)} h ago"
    return time.strftime("%Y-%m-%d", time.localtime(t))


class ConversationList(QWidget):
    """Saved conversations, the latest first."""

    selected = Signal(str)          # a conversation id
    newRequested = Signal()
    deleteRequested = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.new_button = QPushButton("New chat")
        self.new_button.clicked.connect(self.newRequested)
        self.list = QListWidget()
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setUniformItemSizes(True)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._menu)
        self.list.itemActivated.connect(self._pick)
        self.list.itemClicked.connect(self._pick)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.addWidget(self.new_button)
        layout.addWidget(self.list, 1)

    def set_conversations(self, conversations: list[Conversation], current: str | None) -> None:
        """Show these conversations, `current` selected."""
        self.list.blockSignals(True)
        self.list.clear()
        for conv in conversations:
            item = QListWidgetItem(conv.title)
            item.setData(_ID, conv.id)
            item.setToolTip(f"{conv.title}\n{len(conv.turns)} messages, {when(conv.updated)}")
            self.list.addItem(item)
            if conv.id == current:
                item.setSelected(True)
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)

    def ids(self) -> list[str]:
        """The ids shown, in order."""
        return [self.list.item(i).data(_ID) for i in range(self.list.count())]

    def _pick(self, item: QListWidgetItem) -> None:
        self.selected.emit(item.data(_ID))

    def _menu(self, pos: QPoint) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        menu = QMenu(self)
        delete = menu.addAction("Delete")
        if menu.exec(self.list.mapToGlobal(pos)) is delete:
            self.deleteRequested.emit(item.data(_ID))
