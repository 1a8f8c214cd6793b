"""First run: with no model to open, offer the demo model, a folder or GGUF of one's own, or a pull by name.

The demo is the derived MoE (`colibri pull smollm2-moe`: SmolLM2-135M upcycled into 8 experts,
then converted into a 4-bit container whose experts stream; made once). The packaged app
ships the SmolLM2 GGUF it is derived from in its `models/` folder, copied into the user's models
folder first, so no network is needed. A pull runs `colibri warm NAME` in a child process (`prepare`:
app.hub.pull.pull, then the warm-up that compiles the model's kernels, app.service.warm, so the first answer
does not wait for them; the compiler's memory leaves with the child) from a worker thread, behind a progress
dialog that shows the child's typed events (app.hub.progress); Cancel raises from the progress callback at its
next event (the upcycling reports at least every 5 s, the conversion every 64 tensors, the warm-up every
second), which kills the child, and the worker is always joined before the dialog goes away. Half-made models
are cleaned, or resumed, by the next pull.
"""

from __future__ import annotations

import html
import re
import shutil
import sys
from pathlib import Path

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication, QEvent, QObject, Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressDialog,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.hub import pull as pulls
from app.hub.progress import HubEvent, Log, Progress, Report, noting, render
from engine.errors import ColibriError
from ui.models import BackgroundJob
from ui.widgets import say_wrapped


def bundled_models_dir() -> Path | None:
    """The packaged app's `models/` folder (models shipped with it), or None when not running from a bundle."""
    bundle = getattr(sys, "_MEIPASS", None)
    if not getattr(sys, "frozen", False) or bundle is None:
        return None
    folder = Path(bundle) / "models"
    return folder if folder.is_dir() else None


def prepared_default(models_dir: Path | None = None) -> Path | None:
    """The demo model's folder if it has been prepared, else None."""
    try:
        return pulls.resolve_model(pulls.DEFAULT_MODEL, models_dir)
    except ColibriError:
        return None


def prepared_at_start(name: str) -> bool:
    """True when NAME, given at start, is one of the catalogue's small models (the demo, its source): the window
    prepares it behind the first-run dialog's progress, pulling or making it if it is not here yet and compiling
    its kernels if an update left Numba's cache cold (seconds when nothing is missing), then opens it."""
    return name in pulls.DERIVED or name in pulls.ALIASES


def _quiet(message: str) -> None:
    pass


def seed_from_bundle(bundle: Path | None, models_dir: Path, log: Log = _quiet) -> bool:
    """Copy the GGUFs shipped in bundle/<alias>/ into the models folder where missing; True if one was copied."""
    copied = False
    for name in pulls.ALIASES:
        src = bundle / name / Path(pulls.ALIASES[name].member).name if bundle else None
        dest = models_dir / name / Path(pulls.ALIASES[name].member).name
        if src is None or not src.is_file() or dest.is_file():
            continue
        log(QCoreApplication.translate("PullJob", "copying {name} ({size:.0f} MB) from the app into {folder}").format(
            name=src.name, size=src.stat().st_size / 1e6, folder=dest.parent))
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(f".{dest.name}.part")   # a killed copy leaves only a name the pull cleans up
        shutil.copyfile(src, part)
        part.replace(dest)
        copied = True
    return copied


def prepare(name: str, root: Path, report: Report) -> Path:
    """Pull or make model NAME into root and compile its kernels, in a child process (`colibri warm`: the
    upcycling's calibration and the warm-up compile kernels, and the compiler's memory must not stay in the app's),
    then find it here. A failed warm-up of a model that is here is only said: the first answer compiles what it
    lacks."""
    from app.config.catalog import find_model
    from app.service.warm import warm_up_apart

    try:
        warm_up_apart(name, report, models_dir=root)
    except ColibriError as exc:
        try:
            path = find_model(name, root)
        except ColibriError:
            raise exc from None
        noting(report)(QCoreApplication.translate(
            "PullJob", "the warm-up failed ({why}); the first answer will compile its kernels").format(why=exc))
        return path
    return find_model(name, root)


class PullJob(BackgroundJob):
    """`prepare(NAME)` on a worker thread, after seeding the models folder from the bundle: the model pulled or
    made, then its kernels compiled into Numba's cache, in a child process."""

    thread_name = "colibri-pull"
    cancelled_message = QT_TRANSLATE_NOOP("BackgroundJob", "cancelled; asking again starts over where it can")

    def __init__(self, name: str, models_dir: Path | None = None, bundle: Path | None = None,
                 parent: QObject | None = None):
        super().__init__(parent)
        self.name, self.models_dir, self.bundle = name, models_dir, bundle

    def _work(self, report: Report) -> Path:
        from app.config.paths import models_dir

        root = self.models_dir or models_dir()
        if self.name in pulls.DERIVED or self.name in pulls.ALIASES:
            seed_from_bundle(self.bundle, root, noting(report))
        return prepare(self.name, root, report)


PROGRESS_WIDTH = 520    # px: the preparation's progress dialog, whose lines wrap within it


class FirstRunDialog(QDialog):
    """No model yet: prepare the demo, open a folder or GGUF, or pull a model by name."""

    openRequested = Signal(str)     # a model to open (prepared, pulled or chosen)
    openFolderRequested = Signal()
    openGgufRequested = Signal()

    def __init__(self, models_dir: Path | None = None, bundle: Path | None = None, parent: QWidget | None = None,
                 current: str | None = None, demo_loaded: bool = False):
        super().__init__(parent)
        self.setObjectName("firstRun")
        self.setWindowTitle(self.tr("Welcome to Colibri") if current is None else self.tr("Get a model"))
        self.models_dir, self.bundle = models_dir, bundle
        self.job: PullJob | None = None
        self.progress_dialog: QProgressDialog | None = None
        self._expect = ""     # how long the preparation takes, under each of its lines (the demo's)
        intro = QLabel(self.tr("<b>No model yet.</b> Colibri needs a language model to chat with.") if current is None
                       else self.tr("<b>Get another model.</b> {name} stays loaded until the new one opens.").format(
                           name=html.escape(current)))
        intro.setObjectName("firstRunIntro")
        intro.setWordWrap(True)
        self.demo_button = QPushButton(self.tr("Prepare the demo model"))
        self.demo_button.setDefault(True)
        if demo_loaded:     # offering to prepare what is in use would only open it again
            self.demo_button.setEnabled(False)
            self.demo_button.setDefault(False)
            demo_note = QLabel(self.tr("The demo model is the one loaded now."))
        else:
            source = (self.tr("Shipped with the app: no download.") if bundle is not None
                      else self.tr("Downloads about 100 MB."))
            demo_note = QLabel(" ".join((self.tr("SmolLM2-135M turned into an 8-expert Mixture-of-Experts stored at 4 "
                                                 "bits, whose experts stream from disk."), self._estimate(), source)))
        self.folder_button = QPushButton(self.tr("Open a model folder…"))
        self.gguf_button = QPushButton(self.tr("Open a GGUF file…"))
        self.name_edit = QLineEdit()
        self.name_edit.setPlaceholderText(self.tr("a Hugging Face repo (org/name) or smollm2-135m"))
        self.pull_button = QPushButton(self.tr("Pull"))
        self.error = QLabel()
        self.error.setObjectName("firstRunError")
        self.error.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.close_button = QPushButton(self.tr("Not now"))
        for label in (demo_note, self.error):
            label.setWordWrap(True)
        opens, pull_row, bottom = QHBoxLayout(), QHBoxLayout(), QHBoxLayout()
        opens.addWidget(self.folder_button)
        opens.addWidget(self.gguf_button)
        pull_row.addWidget(self.name_edit, 1)
        pull_row.addWidget(self.pull_button)
        bottom.addStretch(1)
        bottom.addWidget(self.close_button)
        layout = QVBoxLayout(self)
        for item in (intro, self.demo_button, demo_note, QLabel(self.tr("Or a model of your own:")), opens,
                     QLabel(self.tr("Or pull one by name:")), pull_row, self.error, bottom):
            (layout.addLayout if isinstance(item, QHBoxLayout) else layout.addWidget)(item)
        self.demo_button.clicked.connect(lambda: self.start_pull(pulls.DEFAULT_MODEL))
        self.pull_button.clicked.connect(lambda: self.start_pull(self.name_edit.text().strip()))
        self.name_edit.installEventFilter(self)     # Enter there pulls the name, and only that (eventFilter)
        self.folder_button.clicked.connect(lambda: self._choose(self.openFolderRequested))
        self.gguf_button.clicked.connect(lambda: self._choose(self.openGgufRequested))
        self.close_button.clicked.connect(self.reject)
        self.resize(520, self.sizeHint().height())

    def _estimate(self) -> str:
        """How long preparing a made model (the demo) takes, said once for the welcome text and the progress lines."""
        return self.tr("Once: 5 to 15 minutes on a small two-core machine.")

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        # Enter in the name field pulls that name and goes no further: the dialog would click its default button
        # too, the demo's (with no name typed) or, once the pull disables the field and focus moves on, "Not now",
        # which closed the dialog and cancelled the pull
        if (watched is self.name_edit and event.type() == QEvent.Type.KeyPress
                and isinstance(event, QKeyEvent) and event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)):
            self.start_pull(self.name_edit.text().strip())
            return True
        return super().eventFilter(watched, event)

    def start_pull(self, name: str) -> PullJob | None:
        """Pull (or prepare) model NAME behind a cancellable progress dialog; the dialog closes once it opens."""
        if not name:
            self.error.setText(self.tr("type a model name first"))
            return None
        if self.job is not None and self.job.running:
            return self.job
        self.error.clear()
        self.job = PullJob(name, self.models_dir, self.bundle, self)
        # the welcome text's estimate is under this dialog: it goes with every line (made models only)
        self._expect = "\n" + self._estimate() if name in pulls.DERIVED else ""
        dlg = QProgressDialog(self.tr("Getting {name}…").format(name=name) + self._expect, self.tr("Cancel"), 0, 0,
                              self)
        dlg.setObjectName("firstRunProgress")
        # the pull's lines run to 150 characters: a label that wraps, in a dialog as wide as this one, else
        # QProgressDialog grows to each line's width and is drawn past the screen's edge
        label = QLabel(dlg.labelText())
        label.setWordWrap(True)
        dlg.setLabel(label)
        dlg.setFixedWidth(max(self.width(), PROGRESS_WIDTH))
        dlg.setWindowTitle(self.tr("Preparing the model"))
        dlg.setWindowModality(Qt.WindowModality.WindowModal)
        dlg.setMinimumDuration(0)
        dlg.setAutoClose(False)
        dlg.setAutoReset(False)
        dlg.canceled.connect(self._cancel)
        self.progress_dialog = dlg
        self.job.progress.connect(self._step)
        self.job.finished.connect(self._done)
        self.job.failed.connect(self._failed)
        self._set_busy(True)
        self.job.start()
        dlg.show()
        return self.job

    def cancel_job(self) -> None:
        """Cancel a running pull and wait for its worker."""
        if self.job is not None:
            self.job.cancel()
            self.job.wait()

    def reject(self) -> None:
        self.cancel_job()
        self._close_progress()
        super().reject()

    def _choose(self, signal) -> None:
        self.accept()
        signal.emit()

    def _cancel(self) -> None:
        if self.job is not None and self.job.running:
            self.job.cancel()
            if self.progress_dialog is not None:
                self.progress_dialog.setLabelText(self.tr("Cancelling at the next step…"))
                self.progress_dialog.show()   # QProgressDialog hides itself on cancel: keep it until the worker ends

    def _step(self, event: HubEvent) -> None:
        dlg = self.progress_dialog
        if dlg is None or (self.job is not None and self.job.cancelled):
            return
        if isinstance(event, Progress) and event.waiting:
            # a step that reports nothing (the first chat's compile) is minutes at one fraction: a moving busy bar,
            # the fraction reached stays in the line's "NN%"
            dlg.setRange(0, 0)
        elif isinstance(event, Progress):
            dlg.setRange(0, 100)
            dlg.setValue(round(100 * event.fraction))
        elif dlg.maximum() > 0 and dlg.value() >= dlg.maximum():
            # news after a finished stage is a wait with no measure (the stand-in's compile): a busy bar, not a full one
            dlg.setRange(0, 0)
        dlg.setLabelText(render(event).strip() + self._expect)

    def _close_progress(self) -> None:
        if self.progress_dialog is not None:
            self.progress_dialog.close()
            self.progress_dialog.deleteLater()
            self.progress_dialog = None

    def _end(self) -> None:
        if self.job is not None:
            self.job.wait()
        self._close_progress()
        self._set_busy(False)

    def _done(self, path: str) -> None:
        self._end()
        self.accept()
        self.openRequested.emit(path)

    def _failed(self, message: str, cancelled: bool) -> None:
        self._end()
        self.show_error((self.tr("Cancelled: {why}") if cancelled else self.tr("It did not work: {why}")).format(
            why=message))

    def show_error(self, message: str) -> None:
        """Say what went wrong below the choices, wrapped, the dialog growing to hold it (never drawn over them)."""
        # a long URL or path has no space to wrap at: offer a break after each of its slashes
        say_wrapped(self, self.error, re.sub(r"\S{48,}", lambda m: m.group().replace("/", "/\u200b"), message))

    def _set_busy(self, busy: bool) -> None:
        for w in (self.demo_button, self.pull_button, self.folder_button, self.gguf_button, self.name_edit):
            w.setEnabled(not busy)
