"""The list of saved conversations: pick one, start a new one, search, rename, export or delete one.

A search box filters the list by title and text (every word must occur). A double-click on a title, or Rename
in its context menu, edits it in place; the list is not rebuilt while a title is being edited, so a refresh
(an answer ending in the background) waits until the edit ends. `export_dialog` asks where to export one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QCoreApplication, QPoint, QStandardPaths, Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.conversations import Conversation

_ID = Qt.ItemDataRole.UserRole


def when(t: float, now: float | None = None) -> str:
    """'just now', '5 min ago', '3 h ago', or the date."""
    age = (time.time() if now is None else now) - t
    if age < 60:
        return QCoreApplication.translate("ConversationList", "just now")
    if age < 3600:
        return QCoreApplication.translate("ConversationList", "{n} min ago").format(n=int(age // 60))
    if age < 86400:
        return QCoreApplication.translate("ConversationList", "{n} h ago").format(n=int(age // 3600))
    return time.strftime("%Y-%m-%d", time.localtime(t))


def export_dialog(parent: QWidget, title: str, chosen: Callable[[str], None]) -> QFileDialog:
    """A save dialog (not yet shown) for a conversation's export: Markdown or JSON, named after its title, in the
    user's documents folder (home when there is none); `chosen` gets the path once accepted."""
    docs = Path(QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation))
    start = docs if docs.is_dir() else Path.home()
    name = " ".join("".join(c if c.isalnum() or c in " -_" else " " for c in title).split()) or "conversation"
    dlg = QFileDialog(parent, QCoreApplication.translate("ConversationList", "Export conversation"),
                      str(start / f"{name}.md"), "Markdown (*.md);;JSON (*.json)")
    dlg.setAcceptMode(QFileDialog.AcceptMode.AcceptSave)
    dlg.setFileMode(QFileDialog.FileMode.AnyFile)
    dlg.setDefaultSuffix("md")
    dlg.filterSelected.connect(lambda f: dlg.setDefaultSuffix("json" if "json" in f else "md"))
    dlg.fileSelected.connect(chosen)
    dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    return dlg


class ConversationList(QWidget):
    """Saved conversations, the latest first."""

    selected = Signal(str)          # a conversation id
    newRequested = Signal()
    deleteRequested = Signal(str)
    renameRequested = Signal(str, str)  # id, new title
    exportRequested = Signal(str)       # id

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self._conversations: dict[str, Conversation] = {}
        self._current: str | None = None
        self._pending: tuple[list[Conversation], str | None] | None = None     # a refresh held during an edit
        self.new_button = QPushButton(self.tr("New chat"))
        self.new_button.clicked.connect(self.newRequested)
        self.search = QLineEdit()
        self.search.setPlaceholderText(self.tr("Search titles and text"))
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self._filter)
        self.list = QListWidget()
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setUniformItemSizes(True)
        self.list.setEditTriggers(QAbstractItemView.EditTrigger.DoubleClicked
                                  | QAbstractItemView.EditTrigger.EditKeyPressed)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._menu)
        self.list.itemActivated.connect(self._pick)
        self.list.itemClicked.connect(self._pick)
        self.list.itemChanged.connect(self._renamed)
        self.list.itemDelegate().closeEditor.connect(lambda *_: self._edit_ended())
        self.no_match = QLabel(self.tr("No conversation matches."))
        self.no_match.setEnabled(False)     # drawn muted
        self.no_match.hide()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.addWidget(self.new_button)
        layout.addWidget(self.search)
        layout.addWidget(self.list, 1)
        layout.addWidget(self.no_match)

    def set_conversations(self, conversations: list[Conversation], current: str | None) -> None:
        """Show these conversations, `current` selected (after the title being edited, if one is)."""
        if self.editing:
            self._pending = (conversations, current)
            return
        self._pending = None
        shown = [(self.list.item(i).data(_ID), self.list.item(i).text()) for i in range(self.list.count())]
        same = list(self._conversations.values()) == conversations and shown == [(c.id, c.title) for c in conversations]
        self._conversations = {c.id: c for c in conversations}
        self._current = current
        self.list.blockSignals(True)
        if same:    # only the selection moves: the items stay, so a double-click that opened one can still rename it
            self.list.clearSelection()
            item = self.item(current) if current is not None else None
            if item is not None:
                item.setSelected(True)
                self.list.setCurrentItem(item)
            self.list.blockSignals(False)
            return
        self.list.clear()
        for conv in conversations:
            item = QListWidgetItem(conv.title)
            item.setData(_ID, conv.id)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            item.setToolTip(self.tr("{title}\n{n} messages, {when}\ndouble-click to rename").format(
                title=conv.title, n=len(conv.turns), when=when(conv.updated)))
            self.list.addItem(item)
            if conv.id == current:
                item.setSelected(True)
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)
        self._filter(self.search.text())

    def ids(self) -> list[str]:
        """The ids shown, in order (those the search hides left out)."""
        items = (self.list.item(i) for i in range(self.list.count()))
        return [item.data(_ID) for item in items if not item.isHidden()]

    def item(self, conversation_id: str) -> QListWidgetItem | None:
        """The item of a conversation, if listed."""
        return next((self.list.item(i) for i in range(self.list.count())
                     if self.list.item(i).data(_ID) == conversation_id), None)

    @property
    def editing(self) -> bool:
        """Whether a title is being edited."""
        return self.list.state() == QAbstractItemView.State.EditingState

    def rename(self, conversation_id: str) -> None:
        """Edit a conversation's title in place (Enter keeps it, Escape leaves it as it was)."""
        item = self.item(conversation_id)
        if item is not None:
            self.list.setCurrentItem(item)
            self.list.editItem(item)

    def _filter(self, query: str) -> None:
        shown = 0
        for i in range(self.list.count()):
            item = self.list.item(i)
            conv = self._conversations.get(item.data(_ID))
            hide = conv is not None and not conv.matches(query)
            item.setHidden(hide)
            shown += not hide
        self.no_match.setVisible(shown == 0 and bool(query.strip()))

    def _pick(self, item: QListWidgetItem) -> None:
        if item.data(_ID) != self._current:     # the open one stays as it is (a double-click may be renaming it)
            self.selected.emit(item.data(_ID))

    def _renamed(self, item: QListWidgetItem) -> None:
        conv = self._conversations.get(item.data(_ID))
        if conv is not None and item.text() != conv.title:
            self.renameRequested.emit(conv.id, item.text())

    def _edit_ended(self) -> None:
        if self._pending is not None:
            self.set_conversations(*self._pending)

    def _menu(self, pos: QPoint) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        menu = QMenu(self)
        rename = menu.addAction(self.tr("Rename"))
        export = menu.addAction(self.tr("Export…"))
        menu.addSeparator()
        delete = menu.addAction(self.tr("Delete"))
        chosen = menu.exec(self.list.mapToGlobal(pos))
        if chosen is rename:
            self.rename(item.data(_ID))
        elif chosen is export:
            self.exportRequested.emit(item.data(_ID))
        elif chosen is delete:
            self.deleteRequested.emit(item.data(_ID))
