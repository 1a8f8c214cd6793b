"""The settings dialog (the models folder, compute threads, the sampling new chats start with, the theme, the
language) and the keyboard shortcuts page.

Settings live in the app's QSettings. The models folder is where the open and convert dialogs start and where the
first-run dialog pulls to (unset: app.config.paths.models_dir); the compute threads go to the engine with the
next model opened (`LoadOptions.threads`; automatic: the process's own, `--threads`); the language (ui.language)
at the next start. The shortcuts page lists
the window's actions with their keys as they are bound, so that it cannot drift from them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QCoreApplication, QSettings, Qt, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QStyle,
    QStyleOptionFrame,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from ui.chat_options import ChatDefaults
from ui.language import LANGUAGE_KEY, LANGUAGES, chosen_language, language_name
from ui.theme import THEMES, theme_name

MODELS_KEY = "paths/models"
THREADS_KEY = "engine/threads"          # 0: automatic (the process's count)
LINE_EDIT_MARGIN = 2                    # px: QLineEdit's own space each side of its text, inside the contents rect


def models_folder(settings: QSettings | None) -> Path:
    """The models folder: the one chosen in the settings, else Colibri's (`$COLIBRI_MODELS_DIR` or the user data
    folder's `models`)."""
    chosen = str(settings.value(MODELS_KEY, "") or "") if settings is not None else ""
    if chosen:
        return Path(chosen).expanduser()
    from app.config.paths import models_dir

    return models_dir()


def compute_threads(settings: QSettings | None) -> int | None:
    """The compute threads chosen for the engine; None: automatic."""
    value = int(settings.value(THREADS_KEY, 0, type=int)) if settings is not None else 0
    return value if value > 0 else None


def most_threads() -> int:
    """The most compute threads the engine can be given: those numba started with."""
    import numba

    return int(numba.config.NUMBA_NUM_THREADS)


@dataclass(frozen=True)
class AppSettings:
    """What the settings dialog edits."""

    models_folder: str              # "" : Colibri's default folder
    threads: int                    # 0: automatic
    defaults: ChatDefaults
    theme: str
    language: str = "system"        # ui.language.LANGUAGES; applied at the next start

    @classmethod
    def load(cls, settings: QSettings) -> AppSettings:
        """The settings saved (the app's own where none are)."""
        theme = str(settings.value("view/theme", "system"))
        return cls(str(settings.value(MODELS_KEY, "") or ""), int(settings.value(THREADS_KEY, 0, type=int)),
                   ChatDefaults.load(settings), theme if theme in THEMES else "system", chosen_language(settings))

    def save(self, settings: QSettings) -> None:
        """Keep them (the theme and the chat's defaults are kept by those who apply them)."""
        settings.setValue(MODELS_KEY, self.models_folder)
        settings.setValue(THREADS_KEY, self.threads)
        settings.setValue(LANGUAGE_KEY, self.language)
        settings.sync()


class SettingsDialog(QDialog):
    """Edit AppSettings; OK emits `accepted_settings` with what the fields hold."""

    accepted_settings = Signal(object)      # AppSettings

    def __init__(self, current: AppSettings, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("settingsDialog")
        self.setWindowTitle(self.tr("Settings"))
        self.folder = QLineEdit(current.models_folder)
        self.folder.setPlaceholderText(str(models_folder(None)))
        self._folder_note = self.tr("where models are opened, converted and downloaded to (empty: Colibri's own "
                                    "folder)")
        self.folder.textChanged.connect(self._fit_folder)
        self._fit_folder()
        browse = QPushButton(self.tr("Browse…"))
        browse.clicked.connect(self._browse)
        self.folder_dialog: QFileDialog | None = None
        folder_row = QHBoxLayout()
        folder_row.addWidget(self.folder, 1)
        folder_row.addWidget(browse)
        self.threads = QSpinBox(minimum=0, maximum=most_threads(), value=min(current.threads, most_threads()))
        self.threads.setSpecialValueText(self.tr("automatic"))
        self.threads.setToolTip(self.tr("compute threads of the engine (automatic: the physical cores, or "
                                        "--threads); used from the next model opened"))
        d = current.defaults
        self.temperature = QDoubleSpinBox(minimum=0.05, maximum=2.0, singleStep=0.1, decimals=2, value=d.temperature)
        self.greedy = QCheckBox(self.tr("Greedy (temperature 0)"))
        self.greedy.setChecked(d.greedy)
        self.top_p = QDoubleSpinBox(minimum=0.05, maximum=1.0, singleStep=0.05, decimals=2, value=d.top_p)
        self.penalty = QDoubleSpinBox(minimum=1.0, maximum=2.0, singleStep=0.05, decimals=2,
                                      value=d.repetition_penalty)
        self.stop_loops = QCheckBox(self.tr("Stop answers that repeat themselves"))
        self.stop_loops.setChecked(d.stop_loops)
        self.greedy.toggled.connect(lambda on: self.temperature.setEnabled(not on))
        self.temperature.setEnabled(not d.greedy)
        self.theme = QComboBox()
        for choice in THEMES:
            self.theme.addItem(theme_name(choice), choice)
        self.theme.setCurrentIndex(self.theme.findData(current.theme))
        self.language = QComboBox()
        for choice in LANGUAGES:
            self.language.addItem(language_name(choice), choice)
        self.language.setCurrentIndex(self.language.findData(current.language))
        self.language.setToolTip(self.tr("the language of the window; System follows the system's language"))
        self.restart_note = QLabel(self.tr("The language changes when Colibri is next started."))
        self.restart_note.setWordWrap(True)
        self.restart_note.setVisible(False)
        self.language.currentIndexChanged.connect(
            lambda _i: self.restart_note.setVisible(self.language.currentData() != current.language))
        note = QLabel(self.tr("New chats start with this sampling; the chat's own fields change it for one chat."))
        note.setWordWrap(True)
        form = QFormLayout()
        form.addRow(self.tr("Models folder"), folder_row)
        form.addRow(self.tr("Compute threads"), self.threads)
        form.addRow(self.tr("Temperature"), self.temperature)
        form.addRow("", self.greedy)
        form.addRow(self.tr("Top-p"), self.top_p)
        form.addRow(self.tr("Repeat penalty"), self.penalty)
        form.addRow("", self.stop_loops)
        form.addRow("", note)
        form.addRow(self.tr("Theme"), self.theme)
        form.addRow(self.tr("Language"), self.language)
        form.addRow("", self.restart_note)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(buttons)

    def values(self) -> AppSettings:
        """What the fields hold."""
        folder = self.folder.text().strip()
        defaults = ChatDefaults(self.temperature.value(), self.top_p.value(), self.penalty.value(),
                                self.greedy.isChecked(), self.stop_loops.isChecked())
        return AppSettings(folder, self.threads.value(), defaults, str(self.theme.currentData()),
                           str(self.language.currentData()))

    def accept(self) -> None:
        self.accepted_settings.emit(self.values())
        super().accept()

    def done(self, result: int) -> None:
        if self.folder_dialog is not None:
            self.folder_dialog.reject()
        super().done(result)

    def _fit_folder(self) -> None:
        """Widen the folder field to show its whole path (or the default one it shows greyed), at most 2/3 of the
        screen; the path leads its tooltip too. The dialog's own width elided the default to "/tmp/walk-home/.lo…"."""
        path = self.folder.text() or self.folder.placeholderText()
        opt = QStyleOptionFrame()
        self.folder.initStyleOption(opt)
        inside = self.style().subElementRect(QStyle.SubElement.SE_LineEditContents, opt, self.folder)
        margins = self.folder.textMargins()
        frame = opt.rect.width() - inside.width() + margins.left() + margins.right() + 2 * LINE_EDIT_MARGIN
        screen = self.screen().availableGeometry().width() if self.screen() is not None else 1280
        width = min(self.folder.fontMetrics().horizontalAdvance(path) + frame + 1, 2 * screen // 3)
        self.folder.setMinimumWidth(max(width, self.folder.sizeHint().width()))
        self.folder.setToolTip(f"{path}\n{self._folder_note}")

    def _browse(self) -> None:
        dlg = self.folder_dialog = QFileDialog(self, self.tr("Models folder"), self.folder.text() or
                                               str(models_folder(None)))
        dlg.setFileMode(QFileDialog.FileMode.Directory)
        dlg.setOption(QFileDialog.Option.ShowDirsOnly)
        dlg.fileSelected.connect(self.folder.setText)
        dlg.finished.connect(lambda _r: setattr(self, "folder_dialog", None))
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dlg.open()


def input_keys() -> list[tuple[str, str]]:
    """The keys of the chat's input, which are no actions: (what, key), the keys named as Qt names them in the
    language of the UI."""
    return [(QCoreApplication.translate("Shortcuts", "Send the question"),
             QCoreApplication.translate("Shortcuts", "Enter")),
            (QCoreApplication.translate("Shortcuts", "New line in the question"),
             QCoreApplication.translate("Shortcuts", "Shift+Enter")),
            (QCoreApplication.translate("Shortcuts", "Stop the answer, or leave the question being edited"),
             QCoreApplication.translate("Shortcuts", "Escape"))]


class ShortcutsDialog(QDialog):
    """Help ▸ Keyboard shortcuts: every action of the window that has a key, and the chat input's keys."""

    def __init__(self, actions: Iterable[QAction], parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("shortcutsDialog")
        self.setWindowTitle(self.tr("Keyboard shortcuts"))
        rows = [(a.text().replace("&", "").rstrip("…"), a.shortcut().toString(QKeySequence.SequenceFormat.NativeText))
                for a in actions if not a.shortcut().isEmpty()]
        rows += input_keys()
        self.table = QTableWidget(len(rows), 2)
        self.table.setHorizontalHeaderLabels([self.tr("Action"), self.tr("Keys")])
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        for i, (what, key) in enumerate(rows):
            self.table.setItem(i, 0, QTableWidgetItem(what))
            self.table.setItem(i, 1, QTableWidgetItem(key))
        self.table.resizeColumnsToContents()
        self.table.horizontalHeader().setStretchLastSection(True)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(self.table)
        layout.addWidget(buttons)
        self.resize(460, 420)

    def rows(self) -> list[tuple[str, str]]:
        """(what, keys) as listed."""
        return [(self.table.item(i, 0).text(), self.table.item(i, 1).text()) for i in range(self.table.rowCount())]
