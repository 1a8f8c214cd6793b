"""Fixtures of the GUI tests: a main window on temporary settings and conversations, the tiny chat
models, and a check that fails any test leaving a thread, an active timer or a window behind.

Import them into a test module (`from support.qt import *`): pytest finds fixtures by name there.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path

import pytest

from engine.events import DoneEvent
from support.tiny_chat import tiny_models

__all__ = ["no_leftovers", "models", "make_window", "window", "wait_until", "test_settings"]   # fixtures and helpers

LOAD_TIMEOUT_MS = 180_000
# a worker thread's news reaching the window: a wait ends as soon as it comes, so a long limit costs nothing, and a
# loaded two-core machine took more than 10 s for four queued events
EVENT_TIMEOUT_MS = 60_000


@pytest.fixture(autouse=True)
def no_leftovers(qapp, monkeypatch):
    """Fail the test if it leaves a thread running, a timer active, or a top-level widget alive."""
    import shiboken6
    from PySide6.QtCore import QEvent, QTimer
    from PySide6.QtWidgets import QApplication, QDialog, QMainWindow

    timers: list[weakref.ref] = []
    init = QTimer.__init__

    def tracking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        timers.append(weakref.ref(self))

    monkeypatch.setattr(QTimer, "__init__", tracking_init)
    threads = set(threading.enumerate())
    # the collections below then scan only what the test made: a worker's whole heap, grown by the modules before,
    # took them seconds a test
    gc.freeze()
    yield
    monkeypatch.undo()
    try:
        for _ in range(3):  # deleteLater'd widgets go now, and Python-owned ones caught in reference cycles
            QApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
            QApplication.processEvents()
            gc.collect()
    finally:
        gc.unfreeze()
    deadline = time.monotonic() + 10
    while True:
        alive = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    active = [t for t in (r() for r in timers) if t is not None and shiboken6.isValid(t) and t.isActive()]
    # windows: anything shown, and main windows or dialogs even hidden (pyqtgraph's never-shown context
    # menus are parentless QMenus that live as long as the interpreter's garbage: not windows)
    widgets = [w for w in QApplication.topLevelWidgets() if shiboken6.isValid(w) and type(w).__name__ != "QTipLabel"
               and (w.isVisible() or isinstance(w, (QMainWindow, QDialog)))]
    left = [f"{type(w).__name__} {w.objectName() or w.windowTitle()!r} parent={type(w.parent()).__name__}"
            for w in widgets]
    timers_left = [(t.objectName(), t.interval(), type(t.parent()).__name__) for t in active]
    for t in active:
        t.stop()
    for w in widgets:
        w.close()
        w.deleteLater()
    QApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    assert not alive, f"threads left running: {alive}"
    assert not timers_left, f"timers left active: {timers_left}"
    assert not left, f"windows left open: {left}"


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """(Hugging Face folder, container) of the tiny chat MoE."""
    return tiny_models(tmp_path_factory.getbasetemp() / "tiny-chat")


def wait_until(qtbot, condition, timeout_ms: int = LOAD_TIMEOUT_MS) -> None:
    """Run the event loop until condition() holds."""
    qtbot.waitUntil(condition, timeout=timeout_ms)


@pytest.fixture
def make_window(qtbot, tmp_path):
    """make_window(model=None, settings_file=None, conversations=None, app_defaults=False) -> a shown MainWindow
    on temporary settings and conversations.

    With a model, it returns once the model has loaded. Every window is closed at teardown. Unless app_defaults,
    the chat starts greedy with loop stopping off (settings the user could choose), so that tests see exact,
    repeatable answers and skip the slow first compile of the sampled path; the app's own defaults (temperature
    0.7, top-p 0.9, Stop loops on) are what tests of those defaults ask for.
    """

    from app.conversations import ConversationStore
    from ui.app import MainWindow, configure

    configure(qtbot_app())
    made = []

    def make(model=None, settings_file: Path | None = None, conversations: Path | None = None,
             app_defaults: bool = False):
        settings = test_settings(settings_file or tmp_path / "colibri.ini", app_defaults)
        store = ConversationStore(conversations or tmp_path / "conversations")
        w = MainWindow(settings=settings, conversations=store)
        made.append(w)
        w.show()
        qtbot.waitExposed(w)
        if model is not None:
            with qtbot.waitSignal(w.bridge.modelLoaded, timeout=LOAD_TIMEOUT_MS):
                w.open_model(str(model))
        return w

    yield make
    for w in made:
        w.close()
        w.deleteLater()


def test_settings(path: Path, app_defaults: bool = False):
    """The QSettings of a test window at path: unless app_defaults, its chat starts greedy with loop stopping off
    (exact, repeatable answers, and no compile of the sampled path)."""
    from PySide6.QtCore import QSettings

    settings = QSettings(str(path), QSettings.Format.IniFormat)
    if not app_defaults:
        settings.setValue("chat/greedy", True)
        settings.setValue("chat/stop_loops", False)
    return settings


test_settings.__test__ = False      # a helper, not a test pytest should collect


def qtbot_app():
    from PySide6.QtWidgets import QApplication

    return QApplication.instance()


@pytest.fixture
def window(make_window, models):
    """A main window with the tiny container loaded (its experts stream)."""
    return make_window(models[1])


def ask(qtbot, window, text: str, max_tokens: int = 24) -> DoneEvent:
    """Send text through the input and the Send button; the answer's DoneEvent once the chat is idle again."""
    from PySide6.QtCore import Qt

    chat = window.chat
    chat.max_tokens.setValue(max_tokens)
    done: list[DoneEvent] = []
    chat.bridge.generation.connect(lambda _r, e: done.append(e) if isinstance(e, DoneEvent) else None)
    chat.input.setPlainText(text)
    with qtbot.waitSignal(chat.generatingChanged, check_params_cb=lambda busy: not busy, timeout=LOAD_TIMEOUT_MS):
        qtbot.mouseClick(chat.send_button, Qt.MouseButton.LeftButton)
    return done[-1]


def click_link(qtbot, view, href: str) -> None:
    """A real mouse click in the middle of the link to href in the transcript."""
    from PySide6.QtCore import QPoint, Qt
    from PySide6.QtGui import QTextCursor

    block = view.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            if fragment.charFormat().isAnchor() and fragment.charFormat().anchorHref() == href:
                cursor = QTextCursor(view.document())
                cursor.setPosition(fragment.position() + fragment.length() // 2)
                view.setTextCursor(cursor)
                view.ensureCursorVisible()
                qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton,
                                 pos=view.cursorRect(cursor).center() + QPoint(1, 0))
                return
            it += 1
        block = block.next()
    raise AssertionError(f"no link to {href} in the transcript")
