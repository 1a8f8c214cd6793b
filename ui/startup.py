"""Starting the app: what model to open first, and the run loop of `colibri gui` and `make run`."""

from __future__ import annotations

import logging
import signal
import sys
from typing import Callable

from PySide6.QtCore import QSettings, Qt, QTimer
from PySide6.QtWidgets import QApplication

from app.service.local import LoadOptions
from app.service.remote import Endpoint, RemoteService
from ui.app import MainWindow, configure
from ui.bridge import ServiceFactory
from ui.first_run import prepared_at_start, prepared_default
from ui.language import chosen_language, install_translation
from ui.selftest import SelfTest, SelfTestRun
from ui.settings_dialog import models_folder

log = logging.getLogger(__name__)


def startup_model(model: str | None, window: MainWindow) -> str | None:
    """What to open at start: MODEL, else the most recent model, else the demo model once prepared."""
    if model:
        return model
    recent = next(iter(window.models.recent.paths()), None)
    if recent:
        return recent
    demo = prepared_default(models_folder(window.settings))     # where the first-run dialog prepared it
    return str(demo) if demo is not None else None


def open_at_start(window: MainWindow, model: str | None, first_run: bool = True) -> None:
    """Open what `startup_model` chooses; a catalogue name (`make run`'s smollm2-moe) is prepared first in the
    window, with its progress shown, so that on a fresh machine the window opens at once and the first answer
    waits for no compile; nothing to open offers the first-run choices (unless `first_run` is False: the
    self-test)."""
    target = window.remote.url if window.remote is not None else startup_model(model, window)
    if target and window.remote is None and prepared_at_start(target):
        window.prepare_model(target)
    elif target:
        window.open_model(target)
    elif first_run:
        window.show_first_run()


def remote_service(url: str, api_key: str | None = None) -> ServiceFactory:
    """The factory of a window on the Colibri server at url (ColibriError now for an address that cannot be one)."""
    Endpoint.parse(url)
    return lambda on_event: RemoteService(url, api_key, on_event=on_event)


def run(model: str | None, options: LoadOptions = LoadOptions(), self_test: SelfTest | None = None,
        remote: str | None = None, api_key: str | None = None, language: str | None = None,
        options_for: Callable[[str], LoadOptions] | None = None, asked: frozenset[str] | None = None) -> int:
    """Open the app (loading MODEL, else the most recent model, else offering the first-run choices) and run it
    until the window closes; with remote, on the Colibri server at that URL instead of a model here; with
    self_test, load (or connect), answer once, print the report and quit. language ("system", "en", "zh_CN")
    overrides the one chosen in the settings for this run. options_for(path) gives the options of each model
    opened (its colibri.toml read as `colibri gui MODEL` reads it); without it every model gets `options`. asked
    names the live settings the command line set by flag or variable: only those win over remembered sliders."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    service = remote_service(remote, api_key) if remote else None
    app = QApplication.instance() or QApplication(sys.argv[:1])
    configure(app)
    shown = install_translation(app, chosen_language(QSettings(), language))    # before the first widget is built
    log.info("user interface language: %s", shown)
    window = MainWindow(load_options=options, service=service, options_for=options_for, asked=asked)
    window.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    window.show()
    check = SelfTestRun(window, self_test) if self_test is not None else None
    open_at_start(window, model, first_run=check is None)
    # Ctrl-C in the terminal closes the window: Python sees the signal when the timer wakes it
    signal.signal(signal.SIGINT, lambda *_: window.close())
    wake = QTimer()
    wake.timeout.connect(lambda: None)
    wake.start(250)
    try:
        code = app.exec()
        return check.exit_code if check is not None else code
    finally:
        wake.stop()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
