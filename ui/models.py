"""Models: open a folder or a GGUF file, the recent models, and converting one into a container.

File dialogs start in the models folder (the one chosen in the settings dialog, else app.config.paths.models_dir).
The conversion dialog proposes `NAME-q<bits>` from the source's name without its own quantization suffix, and
refuses a Colibri container as a source: it is quantized already, and its source is what to convert again.

A conversion (app.hub.convert) runs on a worker thread behind a progress dialog, which shows the
conversion's typed events (app.hub.progress); Cancel raises from the conversion's progress callback
at its next event, so it stops between tensors (the partial output resumes next time). The worker
is always joined before the dialog goes away.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication, QObject, QSettings, Qt, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (
    QButtonGroup,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMenu,
    QProgressDialog,
    QPushButton,
    QRadioButton,
    QSpinBox,
    QWidget,
)

from app.hub.convert import ConvertSettings, convert
from app.hub.progress import HubEvent, Progress, Report, render
from engine.errors import ColibriError
from ui.widgets import say_wrapped

RECENT_KEY = "models/recent"
MAX_RECENT = 8
# a quantization suffix of a model's name: "-q4", ".Q4_K_M", "-fp16", "-bf16", "-int8" ...
_QUANT_SUFFIX = re.compile(r"[-_.](q\d+(_[a-z0-9]+)*|i?q\d_[a-z0-9_]+|f16|bf16|fp16|f32|fp32|fp8|int4|int8)$", re.I)


def start_folder(settings: QSettings | None = None) -> str:
    """Where file dialogs start: the models folder (the settings' choice, else Colibri's) when it exists, else the
    home folder."""
    from ui.settings_dialog import models_folder

    folder = models_folder(settings)
    return str(folder if folder.is_dir() else Path.home())


def output_name(source: str, bits: int) -> str:
    """The container's name for a source: its name without extension or quantization suffix, then `-q<bits>`."""
    name = Path(source.strip()).name
    name = name[:-5] if name.lower().endswith(".gguf") else name
    while (stripped := _QUANT_SUFFIX.sub("", name)) != name and stripped:
        name = stripped
    return f"{name}-q{bits}"


def requantize_error(src: Path) -> str | None:
    """Why `src` cannot be converted, when it is a Colibri container already; None otherwise."""
    from engine.formats.container import is_container

    if src.is_dir() and is_container(src):
        return QCoreApplication.translate(
            "ConvertDialog", "{name} is a Colibri container: it is quantized already, and quantizing it again would "
            "lose more precision. Convert the model it was made from (its Hugging Face folder or GGUF) instead."
        ).format(name=src.name)
    return None


class RecentModels:
    """Recently opened models, the latest first, kept in QSettings."""

    def __init__(self, settings: QSettings):
        self.settings = settings

    def paths(self) -> list[str]:
        """The recent models that still exist."""
        value = self.settings.value(RECENT_KEY, [])
        items = [value] if isinstance(value, str) else list(value or [])
        return [p for p in items if Path(p).exists()]

    def add(self, path: str | Path) -> None:
        """Put path first."""
        path = str(Path(path))
        items = [path] + [p for p in self.paths() if p != path]
        self.settings.setValue(RECENT_KEY, items[:MAX_RECENT])


class JobCancelled(Exception):
    """Raised from a job's progress callback to stop it at its next event."""


@dataclass(frozen=True)
class JobEnded:
    """How a job ended: the model's path, or a message (and whether it was cancelled)."""

    path: str | None
    message: str = ""
    cancelled: bool = False


class BackgroundJob(QObject):
    """A long app-layer call (convert, pull) on a worker thread, reporting through queued signals.

    Subclasses give `_work(report)`, which returns the model's path and calls `report` with each
    app.hub.progress event; Cancel raises JobCancelled from `report` at the next event. The worker
    is joined with `wait`.
    """

    progress = Signal(object)       # a HubEvent (Note or Progress)
    finished = Signal(str)          # the model's path
    failed = Signal(str, bool)      # message, cancelled

    _relay = Signal(object)
    thread_name = "colibri-job"
    cancelled_message = QT_TRANSLATE_NOOP("BackgroundJob", "cancelled")    # shown translated

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._relay.connect(self._deliver, Qt.ConnectionType.QueuedConnection)

    def start(self) -> None:
        """Start the work."""
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        """Ask the work to stop at its next message."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        """Whether cancel() was called."""
        return self._cancel.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Join the worker; True when it has ended."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def running(self) -> bool:
        """Whether the worker is alive."""
        return self._thread is not None and self._thread.is_alive()

    def _work(self, report: Report) -> Path:
        raise NotImplementedError

    def _run(self) -> None:
        def report(event: HubEvent) -> None:
            if self._cancel.is_set():
                raise JobCancelled()
            self._relay.emit(event)

        try:
            path = self._work(report)
        except JobCancelled:
            self._relay.emit(JobEnded(None, self.cancelled_message, True))
        except ColibriError as exc:
            self._relay.emit(JobEnded(None, str(exc)))
        except Exception as exc:  # reported in the dialog, never a dead worker
            self._relay.emit(JobEnded(None, f"{type(exc).__name__}: {exc}"))
        else:
            self._relay.emit(JobEnded(str(path)))

    def _deliver(self, item: HubEvent | JobEnded) -> None:
        if not isinstance(item, JobEnded):
            self.progress.emit(item)
        elif item.path is not None:
            self.finished.emit(item.path)
        elif item.cancelled:
            self.failed.emit(QCoreApplication.translate("BackgroundJob", item.message), True)
        else:
            self.failed.emit(item.message, False)


class ConvertJob(BackgroundJob):
    """app.hub.convert.convert on a worker thread."""

    thread_name = "colibri-convert"
    cancelled_message = QT_TRANSLATE_NOOP("BackgroundJob", "the conversion was cancelled; running it again resumes it")

    def __init__(self, src: Path, out: Path, settings: ConvertSettings, parent: QObject | None = None):
        super().__init__(parent)
        self.src, self.out, self.settings = Path(src), Path(out), settings

    def _work(self, report: Report) -> Path:
        return convert(self.src, self.out, self.settings, progress=report)


class ConvertDialog(QDialog):
    """Choose a source, an output folder and a width or budget; then convert behind a cancellable progress dialog."""

    converted = Signal(str)         # the new container's path

    def __init__(self, source: str | None, out_dir: Path, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle(self.tr("Convert a model"))
        self.out_dir = out_dir      # the models folder: file dialogs start there too
        self.job: ConvertJob | None = None
        self.progress_dialog: QProgressDialog | None = None
        self.source = QLineEdit(source or "")
        self.source.setPlaceholderText(self.tr("a Hugging Face folder or a .gguf file"))
        self.output = QLineEdit()
        self.bits = QSpinBox(minimum=2, maximum=8, value=4)
        self.budget = QLineEdit()
        self.budget.setPlaceholderText(self.tr("e.g. 2GB: the planner picks each tensor's width"))
        self.by_bits, self.by_budget = QRadioButton(self.tr("One width")), QRadioButton(self.tr("Fit a budget"))
        self.by_bits.setChecked(True)
        group = QButtonGroup(self)
        group.addButton(self.by_bits)
        group.addButton(self.by_budget)
        self.error = QLabel()
        self.error.setWordWrap(True)
        self.error.setStyleSheet("color: palette(bright-text);")
        browse = QPushButton(self.tr("Browse…"))
        browse.clicked.connect(self._browse)
        src_row = QHBoxLayout()
        src_row.addWidget(self.source, 1)
        src_row.addWidget(browse)
        bits_row, budget_row = QHBoxLayout(), QHBoxLayout()
        bits_row.addWidget(self.by_bits)
        bits_row.addWidget(self.bits)
        bits_row.addWidget(QLabel(self.tr("bits")))
        bits_row.addStretch(1)
        budget_row.addWidget(self.by_budget)
        budget_row.addWidget(self.budget, 1)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.start_button = buttons.addButton(self.tr("Convert"), QDialogButtonBox.ButtonRole.AcceptRole)
        buttons.accepted.connect(self.start)
        buttons.rejected.connect(self.reject)
        form = QFormLayout(self)
        form.addRow(self.tr("Source"), src_row)
        form.addRow(self.tr("Output"), self.output)
        form.addRow(bits_row)
        form.addRow(budget_row)
        form.addRow(self.error)
        form.addRow(buttons)
        self.source.textChanged.connect(self._suggest_output)
        self.bits.valueChanged.connect(lambda _: self._suggest_output(self.source.text()))
        self._suggest_output(self.source.text())
        self.resize(560, self.sizeHint().height())

    def settings(self) -> ConvertSettings:
        """The conversion asked for; ColibriError naming a bad field."""
        if self.by_budget.isChecked():
            from app.config.sizes import parse_size

            return ConvertSettings(budget=parse_size(self.budget.text(), "budget"))
        return ConvertSettings(bits=self.bits.value())

    def start(self) -> None:
        """Check the fields and start the conversion."""
        src, out = Path(self.source.text().strip()).expanduser(), Path(self.output.text().strip()).expanduser()
        try:
            if not src.exists():
                raise ColibriError(self.tr("{path}: no such folder or file").format(path=src))
            why = requantize_error(src)
            if why:
                raise ColibriError(why)
            if not self.output.text().strip():
                raise ColibriError(self.tr("choose an output folder"))
            settings = self.settings()
        except ColibriError as exc:
            say_wrapped(self, self.error, str(exc))
            return
        say_wrapped(self, self.error, "")
        self.job = ConvertJob(src, out, settings, self)
        dlg = QProgressDialog(self.tr("Converting {name}…").format(name=src.name), self.tr("Cancel"), 0, 0, self)
        dlg.setWindowTitle(self.tr("Converting"))
        dlg.setWindowModality(Qt.WindowModality.WindowModal)
        dlg.setMinimumDuration(0)
        dlg.setAutoClose(False)
        dlg.setAutoReset(False)
        dlg.canceled.connect(self._cancel)
        self.progress_dialog = dlg
        self.job.progress.connect(self._step)
        self.job.finished.connect(self._done)
        self.job.failed.connect(self._failed)
        self.start_button.setEnabled(False)
        self.job.start()
        dlg.show()

    def cancel_job(self) -> None:
        """Cancel a running conversion and wait for its worker."""
        if self.job is not None:
            self.job.cancel()
            self.job.wait()

    def _cancel(self) -> None:
        if self.job is not None and self.job.running:
            self.job.cancel()
            if self.progress_dialog is not None:
                self.progress_dialog.setLabelText(self.tr("Cancelling at the next tensor…"))
                self.progress_dialog.show()   # QProgressDialog hides itself on cancel: keep it until the worker ends

    def _step(self, event: HubEvent) -> None:
        dlg = self.progress_dialog
        if dlg is None:
            return
        if isinstance(event, Progress):
            dlg.setRange(0, 100)
            dlg.setValue(int(100 * event.fraction))
        else:
            dlg.setRange(0, 0)      # news without a measure: a busy bar
        if not (self.job and self.job.cancelled):
            dlg.setLabelText(render(event).strip())

    def _end(self) -> None:
        if self.job is not None:
            self.job.wait()
        if self.progress_dialog is not None:
            self.progress_dialog.close()
            self.progress_dialog.deleteLater()
            self.progress_dialog = None
        self.start_button.setEnabled(True)

    def _done(self, path: str) -> None:
        self._end()
        self.converted.emit(path)
        self.accept()

    def _failed(self, message: str, cancelled: bool) -> None:
        self._end()
        self.error.setText(message)

    def reject(self) -> None:
        self.cancel_job()
        super().reject()

    def _browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, self.tr("Model folder to convert"), str(self.out_dir))
        if folder:
            self.source.setText(folder)

    def _suggest_output(self, src: str) -> None:
        if not src.strip():
            return
        why = requantize_error(Path(src.strip()).expanduser())
        say_wrapped(self, self.error, why or "")
        self.start_button.setEnabled(why is None)
        if why is None:
            self.output.setText(str(self.out_dir / output_name(src, self.bits.value())))


class ModelActions(QObject):
    """The File menu's model actions; `openRequested` carries a path to load."""

    openRequested = Signal(str)
    converted = Signal(str)

    def __init__(self, window: QWidget, settings: QSettings):
        super().__init__(window)
        self.window = window
        self.recent = RecentModels(settings)
        self.settings = settings
        self.current: str | None = None
        self.convert_dialog: ConvertDialog | None = None
        self.open_folder = QAction(self.tr("Open model folder…"), self, shortcut="Ctrl+O")
        self.open_gguf = QAction(self.tr("Open GGUF file…"), self, shortcut="Ctrl+Shift+O")
        self.convert = QAction(self.tr("Convert…"), self)
        self.open_folder.triggered.connect(self._open_folder)
        self.open_gguf.triggered.connect(self._open_gguf)
        self.convert.triggered.connect(lambda: self.show_convert())
        self.recent_menu = QMenu(self.tr("Recent models"), window)
        self.recent_menu.aboutToShow.connect(self._fill_recent)

    def add_recent(self, path: str | Path) -> None:
        """Remember a model that loaded."""
        self.current = str(path)
        self.recent.add(path)

    def show_convert(self, source: str | None = None) -> ConvertDialog:
        """Open the conversion dialog (non-blocking) for source, or the current model."""
        from ui.settings_dialog import models_folder

        if self.convert_dialog is not None:
            self.convert_dialog.cancel_job()
            self.convert_dialog.deleteLater()
        if source is None and self.current is not None and requantize_error(Path(self.current)) is None:
            source = self.current        # a container loaded now is no source: it is quantized already
        dlg = ConvertDialog(source, models_folder(self.settings), self.window)
        dlg.converted.connect(self.converted)
        self.convert_dialog = dlg
        dlg.open()
        return dlg

    def shutdown(self) -> None:
        """Cancel a conversion and join its worker (the window is closing)."""
        if self.convert_dialog is not None:
            self.convert_dialog.cancel_job()

    def _fill_recent(self) -> None:
        self.recent_menu.clear()
        paths = self.recent.paths()
        if not paths:
            self.recent_menu.addAction(self.tr("(none yet)")).setEnabled(False)
        for p in paths:
            action = self.recent_menu.addAction(Path(p).name)
            action.setToolTip(p)
            action.triggered.connect(lambda _=False, p=p: self.openRequested.emit(p))

    def _open_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(
            self.window, self.tr("Open a model folder (Hugging Face or container)"), start_folder(self.settings))
        if folder:
            self.openRequested.emit(folder)

    def _open_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self.window, self.tr("Open a GGUF file"), start_folder(self.settings),
                                              self.tr("GGUF models (*.gguf)"))
        if path:
            self.openRequested.emit(path)
