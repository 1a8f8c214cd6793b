"""The desktop app: QApplication setup and the main window (chat in the middle, conversations and
controls on the left, the inspector on the right), its layout saved between runs.

The window talks to the engine only through its `Bridge` (which owns the `EngineService`):
requests go out through the service, events and snapshots come back as queued signals. With a
`RemoteService` (`colibri gui --remote URL`) the same window chats with a Colibri server on another
machine and its inspector watches that server; what only makes sense here (opening or converting
a model, the memory sliders, computing an atlas) is disabled, saying why.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication, QSettings, Qt
from PySide6.QtGui import QAction, QActionGroup, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QDockWidget,
    QLabel,
    QMainWindow,
    QMenu,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QWidget,
)

from app.conversations import ConversationStore
from app.service.local import LoadFailed, LoadOptions, ModelInfo, ModelLoaded, SettingsApplied
from app.service.remote import ConnectionChanged, RemoteService
from engine.errors import ColibriError
from ui.bridge import Bridge, ServiceFactory
from ui.chat import ChatPanel
from ui.chat_options import is_demo
from ui.controls import ControlsPanel
from ui.conversation_list import ConversationList
from ui.first_run import FirstRunDialog, bundled_models_dir
from ui.library import LibraryDialog
from ui.models import ModelActions
from ui.settings_dialog import AppSettings, SettingsDialog, ShortcutsDialog, compute_threads, models_folder
from ui.theme import THEMES, app_icon, apply_theme, theme_name
from ui.widgets import ElidedLabel, InspectorPlaceholder

log = logging.getLogger(__name__)

try:  # the inspector is built apart; the window works without it
    from ui.inspector import Inspector
except ImportError as _exc:  # pragma: no cover - only while ui.inspector is missing
    Inspector = None
    _INSPECTOR_MISSING = str(_exc)

APP_NAME = "Colibri"
ORGANIZATION = "colibri"
THEME_KEY = "view/theme"
LICENCE = ("Apache-2.0", "https://www.apache.org/licenses/LICENSE-2.0")
LINKS = (("Qt for Python (PySide6), LGPL-3.0", "https://doc.qt.io/qtforpython-6/"),
         ("pyqtgraph, MIT", "https://www.pyqtgraph.org/"),
         ("numba, BSD-2-Clause", "https://numba.pydata.org/"),
         (QT_TRANSLATE_NOOP("About", "The demo model: SmolLM2-135M-Instruct, Apache-2.0"),
          "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct"))


def configure(app: QApplication) -> None:
    """Names (for QSettings and the desktop), the icon and the theme."""
    app.setApplicationName(APP_NAME)
    app.setApplicationDisplayName(APP_NAME)
    app.setOrganizationName(ORGANIZATION)
    app.setDesktopFileName("colibri")
    app.setWindowIcon(app_icon())
    apply_theme(app)


class MainWindow(QMainWindow):
    """Chat, conversations, controls and the inspector around one engine service."""

    def __init__(self, settings: QSettings | None = None, conversations: ConversationStore | None = None,
                 load_options: LoadOptions = LoadOptions(), service: ServiceFactory | None = None,
                 options_for: Callable[[str], LoadOptions] | None = None, asked: frozenset[str] | None = None):
        super().__init__()
        self.setObjectName("mainWindow")
        self.setWindowTitle(APP_NAME)
        self.setWindowIcon(app_icon())
        self.settings = settings if settings is not None else QSettings()
        self.store = conversations if conversations is not None else ConversationStore()
        self.load_options = load_options
        self.options_for = options_for      # a model's own options (its colibri.toml), else load_options for all
        self._loading_options = load_options    # those of the load in progress, or of the model loaded
        self.asked = asked          # live settings the command line set (None: those the load options set)
        self.info: ModelInfo | None = None
        self.error_dialog: QMessageBox | None = None    # the last error shown (tests look at it)
        self.first_run: FirstRunDialog | None = None     # the "no model yet" choices, while shown
        self.settings_dialog: SettingsDialog | None = None
        self.shortcuts_dialog: ShortcutsDialog | None = None
        self.library: LibraryDialog | None = None
        self._drafting_chosen = False                    # the load options' drafting mode was shown once
        self._load_request: int | None = None
        self._atlas_request: int | None = None
        self._connection_lost = False                    # a remote telemetry stream dropped since the last connect
        self._closed = False

        self.bridge = Bridge(self, service)
        self.remote: RemoteService | None = self.bridge.remote   # a server on another machine, or None (local)
        self.chat = ChatPanel(self.bridge, self.store, settings=self.settings,     # sampling defaults live there
                              overflow=None if self.remote is not None else load_options.overflow,
                              remote=self.remote.url if self.remote is not None else None)
        self.conversations = ConversationList()
        self.controls = ControlsPanel(settings=self.settings)
        self.inspector = (Inspector(settings=self.settings) if Inspector is not None
                          else InspectorPlaceholder(_INSPECTOR_MISSING))
        self.models = ModelActions(self, self.settings)
        self.setCentralWidget(self.chat)
        self.setDockNestingEnabled(True)
        left, right = Qt.DockWidgetArea.LeftDockWidgetArea, Qt.DockWidgetArea.RightDockWidgetArea
        self._dock("Conversations", self.tr("Conversations"), self.conversations, left)
        self._dock("Controls", self.tr("Controls"), self.controls, left)
        self._dock("Inspector", self.tr("Inspector"), self.inspector, right)
        self._build_menus()
        self._build_status()
        self._wire()
        if self.remote is not None:
            self._remote_mode()
        self._refresh_conversations()
        self.chat.set_model(None)
        self._restore_layout()

    # --- building ---

    def _dock(self, name: str, title: str, widget: QWidget, area: Qt.DockWidgetArea) -> QDockWidget:
        """A dock titled title; its object name (kept in the saved layout) is "dock" + name, whatever the language."""
        dock = QDockWidget(title, self)
        dock.setObjectName(f"dock{name}")
        dock.setWidget(widget)
        dock.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable
                         | QDockWidget.DockWidgetFeature.DockWidgetClosable
                         | QDockWidget.DockWidgetFeature.DockWidgetFloatable)
        self.addDockWidget(area, dock)
        return dock

    def _build_menus(self) -> None:
        file = self.menuBar().addMenu(self.tr("&File"))
        file.addAction(self.models.open_folder)
        file.addAction(self.models.open_gguf)
        file.addMenu(self.models.recent_menu)
        self.library_action = QAction(self.tr("Model library…"), self, shortcut=QKeySequence("Ctrl+L"))
        self.library_action.triggered.connect(lambda: self.show_library())
        file.addAction(self.library_action)
        self.get_model = get_model = QAction(self.tr("Get a model…"), self)
        get_model.triggered.connect(lambda: self.show_first_run())
        file.addAction(get_model)
        file.addSeparator()
        file.addAction(self.models.convert)
        file.addSeparator()
        self.export_action = QAction(self.tr("Export conversation…"), self)
        self.export_action.triggered.connect(lambda: self.chat.export_conversation())
        file.addAction(self.export_action)
        file.addSeparator()
        self.settings_action = QAction(self.tr("Settings…"), self, shortcut=QKeySequence("Ctrl+,"))
        self.settings_action.triggered.connect(lambda: self.show_settings())
        file.addAction(self.settings_action)
        file.addSeparator()
        quit_action = QAction(self.tr("Quit"), self, shortcut=QKeySequence.StandardKey.Quit)
        quit_action.triggered.connect(self.close)
        file.addAction(quit_action)
        chat = self.menuBar().addMenu(self.tr("&Chat"))
        new = QAction(self.tr("New chat"), self, shortcut=QKeySequence.StandardKey.New)
        new.triggered.connect(self._new_conversation)
        chat.addAction(new)
        self.chat_actions = {"new": new}
        for key, text, keys, slot in (
                ("send", self.tr("Send"), "Ctrl+Return", lambda: self.chat.send()),
                ("stop", self.tr("Stop the answer"), "Ctrl+.", self.chat.stop),
                ("regenerate", self.tr("Regenerate the last answer"), "Ctrl+R", lambda: self.chat.regenerate()),
                ("search", self.tr("Search conversations"), "Ctrl+F", self.focus_search)):
            action = QAction(text, self, shortcut=QKeySequence(keys))
            action.triggered.connect(slot)
            chat.addAction(action)
            self.chat_actions[key] = action
        view = self.menuBar().addMenu(self.tr("&View"))
        for dock in self.findChildren(QDockWidget):
            view.addAction(dock.toggleViewAction())
        view.addSeparator()
        self._build_theme_menu(view.addMenu(self.tr("Theme")))
        help_menu = self.menuBar().addMenu(self.tr("&Help"))
        shortcuts = QAction(self.tr("Keyboard shortcuts"), self, shortcut=QKeySequence("F1"))
        shortcuts.triggered.connect(lambda: self.show_shortcuts())
        help_menu.addAction(shortcuts)
        about = QAction(self.tr("About Colibri"), self)
        about.triggered.connect(self._about)
        help_menu.addAction(about)

    def _build_theme_menu(self, menu: QMenu) -> None:
        """System, Light and Dark, one checked; the choice is saved and applied at once (and at the next start)."""
        saved = str(self.settings.value(THEME_KEY, "system"))
        saved = saved if saved in THEMES else "system"
        group = QActionGroup(self)
        group.setExclusive(True)
        self.theme_actions: dict[str, QAction] = {}
        for choice in THEMES:
            action = QAction(theme_name(choice), self, checkable=True)
            action.setChecked(choice == saved)
            action.triggered.connect(lambda _=False, choice=choice: self.set_theme(choice))
            group.addAction(action)
            menu.addAction(action)
            self.theme_actions[choice] = action
        self.set_theme(saved)

    def set_theme(self, choice: str) -> None:
        """Apply theme `choice` ("system", "light" or "dark") to the app and remember it."""
        app = QApplication.instance()
        if isinstance(app, QApplication):
            apply_theme(app, choice)
        self.theme_actions[choice].setChecked(True)
        self.settings.setValue(THEME_KEY, choice)

    def focus_search(self) -> None:
        """Show the conversations and put the cursor in their search box (Ctrl+F)."""
        dock = self.findChild(QDockWidget, "dockConversations")
        if dock is not None:
            dock.show()
            dock.raise_()
        self.conversations.search.setFocus()
        self.conversations.search.selectAll()

    def show_settings(self) -> SettingsDialog:
        """The settings dialog (non-blocking); OK applies and keeps what it holds."""
        if self.settings_dialog is not None:
            self.settings_dialog.reject()
        dlg = self.settings_dialog = SettingsDialog(AppSettings.load(self.settings), self)
        dlg.accepted_settings.connect(self.apply_settings)
        dlg.finished.connect(lambda _r: self._settings_closed(dlg))
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dlg.open()
        return dlg

    def apply_settings(self, chosen: AppSettings) -> None:
        """Keep the settings and apply them: the theme and new chats' sampling now; the models folder in the next
        dialog; the compute threads from the next model opened."""
        threads_before = compute_threads(self.settings)
        chosen.save(self.settings)
        self.set_theme(chosen.theme)
        self.chat.set_defaults(chosen.defaults)
        if self.info is not None and compute_threads(self.settings) != threads_before:
            self.model_label.setText(self.tr("{label} · compute threads change when a model is next opened")
                                     .format(label=self.model_label.text()))

    def _settings_closed(self, dlg: SettingsDialog) -> None:
        if self.settings_dialog is dlg:
            self.settings_dialog = None

    def show_library(self) -> LibraryDialog | None:
        """File ▸ Model library (non-blocking): the models folder's models, to open, convert, reveal or delete.
        None for a remote window: the server's machine holds its models."""
        if self.remote is not None:
            return None
        if self.library is not None:
            self.library.reject()
        current = str(self.info.path) if self.info is not None else None
        dlg = self.library = LibraryDialog(models_folder(self.settings), current, self)
        dlg.openRequested.connect(self.open_model)
        dlg.convertRequested.connect(lambda path: self.models.show_convert(path))
        dlg.finished.connect(lambda _r: setattr(self, "library", None) if self.library is dlg else None)
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dlg.open()
        return dlg

    def show_shortcuts(self) -> ShortcutsDialog:
        """Help ▸ Keyboard shortcuts (non-blocking): the window's actions with their keys, and the input's."""
        if self.shortcuts_dialog is not None:
            self.shortcuts_dialog.reject()
        actions = [a for menu in self.menuBar().findChildren(QMenu) for a in menu.actions()]
        dlg = self.shortcuts_dialog = ShortcutsDialog(dict.fromkeys(actions), self)
        dlg.finished.connect(lambda _r: setattr(self, "shortcuts_dialog", None) if self.shortcuts_dialog is dlg
                             else None)
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dlg.open()
        return dlg

    def _build_status(self) -> None:
        self.model_label = ElidedLabel(self.tr("No model"))
        self.model_label.setObjectName("modelLabel")
        self.load_bar = QProgressBar()
        self.load_bar.setRange(0, 1000)
        self.load_bar.setMaximumWidth(220)
        self.load_bar.setTextVisible(True)
        self.load_cancel = QPushButton(self.tr("Cancel"))
        self.load_cancel.clicked.connect(self.cancel_load)
        self.connection_label = QLabel()        # a remote server's telemetry stream: connected, or lost and why
        self.connection_label.setObjectName("connectionLabel")
        self.connection_label.hide()
        bar = self.statusBar()
        bar.addWidget(self.model_label, 1)
        bar.addPermanentWidget(self.connection_label)
        bar.addPermanentWidget(self.load_bar)
        bar.addPermanentWidget(self.load_cancel)
        self.load_bar.hide()
        self.load_cancel.hide()

    def _wire(self) -> None:
        b = self.bridge
        b.loadProgress.connect(self._on_load_progress)
        b.modelLoaded.connect(self._on_loaded)
        b.loadFailed.connect(self._on_load_failed)
        b.settingsApplied.connect(self._on_settings)
        b.snapshot.connect(self.inspector.set_snapshot)
        b.tiers.connect(self.inspector.set_tiers)
        b.cacheTrace.connect(self.inspector.set_cache_trace)
        b.expertCounts.connect(self.inspector.set_expert_counts)
        b.atlasProgress.connect(self._on_atlas_progress)
        b.atlasReady.connect(self._on_atlas_ready)
        b.atlasFailed.connect(self._on_atlas_failed)
        b.connection.connect(self._on_connection)
        self.controls.changeRequested.connect(b.service.update_settings)
        self.inspector.atlasRequested.connect(self.compute_atlas)
        self.inspector.atlasCancelRequested.connect(self._cancel_atlas)
        self.models.openRequested.connect(self.open_model)
        self.models.converted.connect(self.open_model)
        self.chat.conversationsChanged.connect(self._refresh_conversations)
        self.chat.generatingChanged.connect(self.inspector.set_generating)
        self.inspector.set_generating(self.chat.generating)
        self.conversations.selected.connect(self._open_conversation)
        self.conversations.newRequested.connect(self._new_conversation)
        self.conversations.deleteRequested.connect(self._delete_conversation)
        self.conversations.renameRequested.connect(self.chat.rename_conversation)
        self.conversations.exportRequested.connect(self.chat.export_conversation)

    def _remote_mode(self) -> None:
        """Disable what only makes sense for a model on this machine, each saying why."""
        url = self.remote.url
        why = self.tr("the model is served by {url}; open, pull or convert models on that machine").format(url=url)
        for action in (self.models.open_folder, self.models.open_gguf, self.models.convert, self.get_model,
                       self.models.recent_menu.menuAction(), self.library_action):
            action.setEnabled(False)
            action.setToolTip(why)
            action.setStatusTip(why)
        for menu in self.findChildren(QMenu):
            menu.setToolTipsVisible(True)
        self.connection_label.show()
        self.connection_label.setText(self.tr("Connecting to {url}…").format(url=url))
        self._remote_atlas_offer()

    def _remote_atlas_offer(self) -> None:
        """A remote model's atlas comes from the server: no button to compute one here."""
        atlas = getattr(self.inspector, "atlas", None)
        button = getattr(atlas, "compute_button", None)
        if self.remote is None or button is None:
            return
        button.setEnabled(False)
        button.setToolTip(self.tr("the atlas of a served model is computed where it runs: `colibri atlas MODEL` on "
                                  "the machine of {url}, then reconnect").format(url=self.remote.url))

    def _on_connection(self, event: ConnectionChanged) -> None:
        """The remote telemetry stream was lost or regained: say so; once back, read again what the server serves
        (it may have restarted with another model), unless an answer is being written."""
        label = self.connection_label
        label.setToolTip(event.message)
        if event.connected:
            label.setText(self.tr("● live: {url}").format(url=event.url))
            label.setStyleSheet("")
            back = self.info is None or self._connection_lost
            if back and self._load_request is None and not self.chat.generating:
                self._connection_lost = False
                self.open_model(event.url)
        else:
            self._connection_lost = True
            label.setText(f"⚠ {event.message}")
            label.setStyleSheet("color: palette(bright-text);")
            log.warning("%s", event.message)

    # --- models ---

    def open_model(self, path: str, options: LoadOptions | None = None) -> int:
        """Load a model (folder, .gguf, container or pulled name) through the service (remote: connect), with
        `options`, else those `colibri gui PATH` would use (PATH's colibri.toml under the command line's flags);
        a settings file that cannot be read is shown and the model in use stays (-1)."""
        if options is None and self.options_for is not None and self.remote is None:
            try:
                options = self.options_for(path)
            except ColibriError as exc:
                self.show_error(self.tr("The model could not be loaded"), str(exc))
                return -1
        self.chat.stop()
        options = options or self.load_options
        self._loading_options = options
        threads = compute_threads(self.settings)
        if threads is not None and options.threads is None and self.remote is None:   # the settings dialog's
            options = replace(options, threads=threads)
        self._load_request = self.bridge.service.load(path, options)
        self.chat.set_model(None)
        self.controls.set_model(None)
        if self.remote is not None:
            self.model_label.setText(self.tr("Connecting to {url}…").format(url=self.remote.url))
        else:
            self.model_label.setText(self.tr("Loading {name}…").format(name=Path(path).name))
        self.load_bar.setValue(0)
        self.load_bar.show()
        self.load_cancel.show()
        return self._load_request

    def show_first_run(self, models_dir: Path | None = None, bundle: Path | None = None) -> FirstRunDialog | None:
        """Offer the demo model, a folder or GGUF, or a pull by name (non-blocking); the choice opens.
        None for a remote window: the server chooses the model."""
        if self.remote is not None:
            return None
        if self.first_run is not None:
            self.first_run.reject()
            self.first_run.deleteLater()
        models_dir = models_dir if models_dir is not None else models_folder(self.settings)
        dlg = self.first_run = FirstRunDialog(models_dir, bundle if bundle is not None else bundled_models_dir(),
                                              self, current=self.info.name if self.info is not None else None,
                                              demo_loaded=self.info is not None and is_demo(self.info))
        dlg.openRequested.connect(self.open_model)
        dlg.openFolderRequested.connect(self.models.open_folder.trigger)
        dlg.openGgufRequested.connect(self.models.open_gguf.trigger)
        dlg.open()
        return dlg

    def prepare_model(self, name: str, models_dir: Path | None = None) -> FirstRunDialog | None:
        """Prepare the catalogue model NAME (pulled or made, then its kernels compiled) behind the first-run
        dialog's progress, and open it when it is ready (`colibri gui smollm2-moe` on a fresh machine)."""
        dlg = self.show_first_run(models_dir)
        if dlg is not None:
            dlg.start_pull(name)
        return dlg

    def cancel_load(self) -> None:
        """Stop the load in progress."""
        if self._load_request is not None:
            self.bridge.service.cancel(self._load_request)

    def compute_atlas(self) -> None:
        """Compute the loaded model's atlas (the inspector asked)."""
        if self.info is None:
            self.show_error(self.tr("No model"), self.tr("Open a Mixture-of-Experts model before computing its atlas."))
            return
        self._atlas_request = self.bridge.service.compute_atlas()
        self.inspector.set_atlas_progress(0.0)

    def _cancel_atlas(self) -> None:
        if self._atlas_request is not None:
            self.bridge.service.cancel(self._atlas_request)

    def _on_load_progress(self, request: int, fraction: float, message: str) -> None:
        if request == self._load_request:
            self.load_bar.setValue(int(fraction * 1000))
            self.load_bar.setFormat(message)

    def _on_loaded(self, event: ModelLoaded) -> None:
        if event.request != self._load_request:
            return
        self._end_load()
        info = self.info = event.info
        self.chat.set_model(info)
        if not self._drafting_chosen and self.remote is None:     # `colibri gui --speculative [mtp]` shows it chosen
            self._drafting_chosen = True
            self.chat.drafting.set_mode(self.load_options.speculative)
        self.controls.set_model(info)
        if self.remote is None:   # the sliders as the user left them, where this model allows, but what this load set
            self.controls.restore_remembered(self._given_settings())
        self.inspector.set_model_info(info.n_layers, info.n_experts, info.settings.memory_budget)
        try:
            self.inspector.set_atlas(dict(event.atlas) if event.atlas is not None else None)
        except ValueError as exc:
            log.warning("the atlas of %s is not shown: %s", info.name, exc)
        how = self._how(info)
        if self.remote is not None:
            self._remote_atlas_offer()
            self.model_label.setText(self.tr("{name} · {architecture} · {how} · served by {url}").format(
                name=info.name, architecture=info.architecture, how=how, url=self.remote.url))
            log.info("connected to %s serving %s (%s, %s)", self.remote.url, info.name, info.architecture, how)
            self.setWindowTitle(f"{info.name} @ {self.remote.endpoint.host} — {APP_NAME}")
            return
        self.models.add_recent(info.path)
        self.model_label.setText(self._model_line(info))
        log.info("loaded %s (%s, %s)", info.path, info.architecture, how)
        self.setWindowTitle(f"{info.name} — {APP_NAME}")

    def _on_load_failed(self, event: LoadFailed) -> None:
        if event.request != self._load_request:
            return
        self._end_load()
        if event.kept is not None and self.remote is None:
            self._kept(event)
            return
        self.info = None
        self.chat.set_model(None)
        self.controls.set_model(None)
        self.inspector.set_model_info(0, 0, None)
        self._inspector_forgets()
        self._remote_atlas_offer()
        self.setWindowTitle(APP_NAME)
        if event.cancelled:
            self.model_label.setText(self.tr("Loading cancelled"))
        elif self.remote is not None:
            log.warning("no connection: %s", event.message)
            self.model_label.setText(self.tr("Not connected to {url} (retrying in the background)").format(
                url=self.remote.url))
            self.show_error(self.tr("The server cannot be reached"), event.message)
        else:
            log.warning("the model did not load: %s", event.message)
            self.model_label.setText(self.tr("No model (the last one failed to load)"))
            self.show_error(self.tr("The model could not be loaded"), event.message)

    def _kept(self, event: LoadFailed) -> None:
        """A model that could not open left the one in use loaded: it answers again, and the error says so."""
        info = self.info = event.kept
        self.chat.set_model(info)
        self.controls.set_model(info)
        self.model_label.setText(self._model_line(info))
        if event.cancelled:
            return
        log.warning("the model did not load, %s stays: %s", info.name, event.message)
        self.show_error(self.tr("The model could not be loaded"),
                        self.tr("{why}\n\n{name} is still loaded.").format(why=event.message, name=info.name))

    def _how(self, info: ModelInfo) -> str:
        """How the model's weights are held, in words."""
        return {"experts": self.tr("experts stream from disk"), "layers": self.tr("layers stream from disk")}.get(
            info.streaming, self.tr("held in memory"))

    def _model_line(self, info: ModelInfo) -> str:
        """The status bar's line for a loaded local model."""
        return f"{info.name} · {info.architecture} · {self._how(info)}"

    def _given_settings(self) -> frozenset[str]:
        """The live settings the remembered sliders yield to: those the command line set by flag or variable
        (`asked`), else (no command line: tests, the self-test) all that this load's options set."""
        if self.asked is not None:
            return self.asked
        o, default = self._loading_options, LoadOptions()
        given = {"memory_budget": o.max_memory is not None, "context_length": o.context_length is not None,
                 "prefetch_depth": o.prefetch_depth != default.prefetch_depth,
                 "io_threads": o.io_threads != default.io_threads}
        return frozenset(name for name, set_ in given.items() if set_)

    def _inspector_forgets(self) -> None:
        """No model is loaded: the inspector drops the last one's heat, tiers and current token."""
        self.inspector.forget_model()

    def _end_load(self) -> None:
        self._load_request = None
        self.load_bar.hide()
        self.load_cancel.hide()

    def _on_settings(self, applied: SettingsApplied) -> None:
        self.controls.show_applied(applied)
        if applied.info is not None:
            self.info = applied.info
            s = applied.info.settings
            self.inspector.set_model_info(applied.info.n_layers, applied.info.n_experts, s.memory_budget)
            self._remote_atlas_offer()

    def _on_atlas_progress(self, request: int, fraction: float, message: str) -> None:
        if request == self._atlas_request:
            self.inspector.set_atlas_progress(fraction)

    def _on_atlas_ready(self, event) -> None:
        self._atlas_request = None
        self.inspector.set_atlas_progress(None)
        try:
            self.inspector.set_atlas(dict(event.atlas))
        except ValueError as exc:
            self.show_error(self.tr("The atlas cannot be shown"), str(exc))

    def _on_atlas_failed(self, event) -> None:
        self._atlas_request = None
        self.inspector.set_atlas_progress(None)
        if not event.cancelled:
            self.show_error(self.tr("The atlas could not be computed"), event.message)

    def show_error(self, title: str, message: str) -> QMessageBox:
        """A non-blocking error dialog (the app stays up and responsive)."""
        box = QMessageBox(QMessageBox.Icon.Critical, title, message, QMessageBox.StandardButton.Ok, self)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.error_dialog = box
        box.finished.connect(lambda _r, box=box: self._dialog_closed(box))
        box.open()
        return box

    def _dialog_closed(self, box: QMessageBox) -> None:
        if self.error_dialog is box:
            self.error_dialog = None

    # --- conversations ---

    def _refresh_conversations(self) -> None:
        self.conversations.set_conversations(self.store.list(), self.chat.conversation.id)

    def _open_conversation(self, conversation_id: str) -> None:
        try:
            conv = self.store.load(conversation_id)
        except (OSError, ValueError) as exc:
            self.show_error(self.tr("The conversation cannot be opened"), str(exc))
            return
        self.chat.open_conversation(conv)
        self._refresh_conversations()

    def _new_conversation(self) -> None:
        self.chat.new_conversation()
        self._refresh_conversations()

    def _delete_conversation(self, conversation_id: str) -> None:
        self.store.delete(conversation_id)
        if conversation_id == self.chat.conversation.id:
            self.chat.new_conversation()
        self._refresh_conversations()

    # --- layout and closing ---

    def _restore_layout(self) -> None:
        geometry = self.settings.value("window/geometry")
        state = self.settings.value("window/state")
        if geometry is not None:
            self.restoreGeometry(geometry)
        else:
            self.resize(1440, 900)
        if state is not None:
            self.restoreState(state)
        else:  # first run: the chat gets the most room, the inspector a good share
            docks = {d.objectName(): d for d in self.findChildren(QDockWidget)}
            self.resizeDocks([docks["dockConversations"], docks["dockInspector"]], [230, 620],
                             Qt.Orientation.Horizontal)
            self.resizeDocks([docks["dockConversations"], docks["dockControls"]], [420, 300],
                             Qt.Orientation.Vertical)

    def save_layout(self) -> None:
        """Keep the window's geometry and dock layout for the next run."""
        self.settings.setValue("window/geometry", self.saveGeometry())
        self.settings.setValue("window/state", self.saveState())
        self.settings.sync()

    def shutdown(self) -> None:
        """Save the layout, stop every timer and worker, close the engine; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.save_layout()
        self.chat.close_views()
        self.controls.close_views()
        self.inspector.close_views()
        self.models.shutdown()
        for dlg in (self.settings_dialog, self.shortcuts_dialog, self.library):
            if dlg is not None:
                dlg.reject()
        if self.first_run is not None:
            self.first_run.cancel_job()
        self.bridge.close()

    def closeEvent(self, event: QCloseEvent) -> None:
        self.shutdown()
        super().closeEvent(event)

    def _about(self) -> QMessageBox:
        """The About box: what Colibri is, its version and licence, and links (non-blocking)."""
        from app import __version__

        links = "".join(f'<li><a href="{url}">{QCoreApplication.translate("About", name)}</a></li>'
                        for name, url in LINKS)
        licence = f'<a href="{LICENCE[1]}">{LICENCE[0]}</a>'
        text = (f"<h3>Colibri {__version__}</h3>"
                + "<p>{}</p>".format(self.tr("Colibri runs language models, above all Mixture-of-Experts models, on "
                                             "computers whose memory cannot hold them, streaming experts from disk "
                                             "under a memory budget."))
                + "<p>{}</p>".format(self.tr("Licence: {licence}.").format(licence=licence))
                + "<p>{}</p><ul>{}</ul>".format(self.tr("Built on:"), links))
        box = QMessageBox(QMessageBox.Icon.NoIcon, self.tr("About Colibri"), text, QMessageBox.StandardButton.Ok,
                          self)
        box.setObjectName("aboutBox")
        box.setIconPixmap(app_icon().pixmap(64, 64))
        box.setTextFormat(Qt.TextFormat.RichText)
        box.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.about_box = box
        box.open()
        return box
