"""File ▸ Model library: the models folder as a table (name, family, parameters, bits, size on disk, kind, atlas),
with Open, Convert, Reveal and Delete (app.library reads and deletes; this only shows and asks).

Delete asks first (non-blocking) and refuses the model loaded now. Reveal opens the model's folder in the system's
file manager.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QCoreApplication, Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QDialogButtonBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QMessageBox,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.config.sizes import format_size
from app.library import CONTAINER, ModelEntry, delete_model, scan
from engine.errors import ColibriError

_ENTRY = Qt.ItemDataRole.UserRole


def format_params(n: int | None) -> str:
    """'135 M', '1.7 B', '–' when not known."""
    if n is None:
        return "–"
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            value = n / size
            return f"{value:.3g} {unit}"
    return str(n)


def reveal(path: Path) -> bool:
    """Show path's folder in the system's file manager."""
    return QDesktopServices.openUrl(QUrl.fromLocalFile(str(path if path.is_dir() else path.parent)))


class LibraryDialog(QDialog):
    """The models of one folder; `openRequested` and `convertRequested` carry a model's path."""

    openRequested = Signal(str)
    convertRequested = Signal(str)

    def __init__(self, folder: Path, current: str | None = None, parent: QWidget | None = None):
        """current: the path of the model loaded now (it cannot be deleted)."""
        super().__init__(parent)
        self.setObjectName("libraryDialog")
        self.setWindowTitle(self.tr("Model library"))
        self.folder, self.current = folder, current
        self.entries: list[ModelEntry] = []
        self.confirm: QMessageBox | None = None     # Delete's question, while open
        self.heading = QLabel()
        self.heading.setWordWrap(True)
        self.heading.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        headers = [self.tr("Name"), self.tr("Family"), self.tr("Parameters"), self.tr("Bits"), self.tr("Size"),
                   self.tr("Kind"), self.tr("Atlas")]
        self.table = QTableWidget(0, len(headers))
        self.table.setHorizontalHeaderLabels(headers)
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)   # names are long
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.table.itemDoubleClicked.connect(lambda _item: self.open_selected())
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.open_button = QPushButton(self.tr("Open"))
        self.convert_button = QPushButton(self.tr("Convert…"))
        self.reveal_button = QPushButton(self.tr("Reveal"))
        self.delete_button = QPushButton(self.tr("Delete…"))
        self.refresh_button = QPushButton(self.tr("Refresh"))
        self.open_button.clicked.connect(self.open_selected)
        self.convert_button.clicked.connect(self.convert_selected)
        self.reveal_button.clicked.connect(self.reveal_selected)
        self.delete_button.clicked.connect(lambda: self.ask_delete())
        self.refresh_button.clicked.connect(self.refresh)
        row = QHBoxLayout()
        for b in (self.open_button, self.convert_button, self.reveal_button, self.delete_button):
            row.addWidget(b)
        row.addStretch(1)
        row.addWidget(self.refresh_button)
        close = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        close.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(self.heading)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.status)
        layout.addLayout(row)
        layout.addWidget(close)
        self.resize(820, 420)
        self.refresh()

    def refresh(self) -> None:
        """Read the folder again."""
        self.entries = scan(self.folder)
        self.heading.setText(self.tr("{n} model(s) in {folder} (File ▸ Settings changes the folder)").format(
            n=len(self.entries), folder=self.folder))
        self.table.setRowCount(len(self.entries))
        yes, no = self.tr("yes"), "–"
        kinds = {CONTAINER: self.tr("container")}     # the others are names: Hugging Face, GGUF
        for i, e in enumerate(self.entries):
            cells = (e.name, e.family, format_params(e.params), f"{e.bits:.2f}" if e.bits is not None else "–",
                     format_size(e.size), kinds.get(e.kind, e.kind), yes if e.atlas else no)
            for j, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setData(_ENTRY, i)
                item.setToolTip(e.problem or str(e.path))
                self.table.setItem(i, j, item)
        for column in range(1, self.table.columnCount()):
            self.table.resizeColumnToContents(column)
        self._update_buttons()

    def selected(self) -> ModelEntry | None:
        """The model selected, if one is."""
        rows = self.table.selectionModel().selectedRows()
        return self.entries[rows[0].row()] if rows else None

    def select(self, name: str) -> ModelEntry:
        """Select the model called name (KeyError when there is none)."""
        for i, e in enumerate(self.entries):
            if e.name == name:
                self.table.selectRow(i)
                return e
        raise KeyError(name)

    def open_selected(self) -> None:
        """Open the model selected (the dialog closes)."""
        e = self.selected()
        if e is not None:
            self.openRequested.emit(str(e.path))
            self.accept()

    def convert_selected(self) -> None:
        """Convert the model selected (a container is refused by the conversion dialog, saying why)."""
        e = self.selected()
        if e is not None:
            self.convertRequested.emit(str(e.path))

    def reveal_selected(self) -> None:
        """Show the selected model's folder in the file manager."""
        e = self.selected()
        if e is not None and not reveal(e.path):
            self.status.setText(self.tr("No file manager answered: the model is in {path}").format(path=e.path))

    def ask_delete(self) -> QMessageBox | None:
        """Ask before deleting the model selected (non-blocking); None, saying why, when it cannot be deleted."""
        e = self.selected()
        if e is None:
            return None
        if self.current is not None and Path(self.current).resolve() == e.path.resolve():
            self.status.setText(self.tr("{name} is the model loaded now: open another before deleting it").format(
                name=e.name))
            return None
        box = self.confirm = QMessageBox(QMessageBox.Icon.Warning, self.tr("Delete a model"), self.tr(
            "Delete {name} ({size}) from the disk? This cannot be undone.").format(name=e.name, size=format_size(
                e.size)), QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel, self)
        box.setDefaultButton(QMessageBox.StandardButton.Cancel)
        box.finished.connect(lambda result: self._answered(box, e, result))
        box.open()
        return box

    def done(self, result: int) -> None:
        if self.confirm is not None:
            self.confirm.reject()
        super().done(result)

    def _answered(self, box: QMessageBox, entry: ModelEntry, result: int) -> None:
        if self.confirm is box:
            self.confirm = None
        box.deleteLater()
        if result != QMessageBox.StandardButton.Yes:
            return
        try:
            delete_model(entry, self.folder)
        except (OSError, ColibriError) as exc:
            self.status.setText(self.tr("{name} was not deleted: {why}").format(name=entry.name, why=exc))
            return
        self.status.setText(self.tr("Deleted {name}").format(name=entry.name))
        self.refresh()

    def _update_buttons(self) -> None:
        e = self.selected()
        self.open_button.setEnabled(e is not None and e.problem is None)
        self.reveal_button.setEnabled(e is not None)
        self.delete_button.setEnabled(e is not None)
        self.convert_button.setEnabled(e is not None and e.kind != CONTAINER)
        self.convert_button.setToolTip("" if e is None or e.kind != CONTAINER else QCoreApplication.translate(
            "LibraryDialog", "a container is quantized already: convert the model it was made from"))
