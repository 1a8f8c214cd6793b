"""Presets, the settings dialog and the shortcuts page (pytest-qt, offscreen): a preset fills the chat's fields,
the user's own are kept atomically for the next run, the settings persist and take effect (models folder, compute
threads, new chats' sampling, theme), and every listed shortcut is a bound key that works."""

from __future__ import annotations

import json

import pytest

from support.qt import *  # noqa: F403 - the GUI fixtures (no_leftovers is autouse)
from support.qt import LOAD_TIMEOUT_MS, test_settings


def _fields(chat) -> tuple[float, float, float]:
    return chat.temperature.value(), chat.top_p.value(), chat.repeat_penalty.value()


def test_a_built_in_preset_fills_the_sampling_and_greedy_is_one_of_them(qtbot, make_window):
    chat = make_window(app_defaults=True).chat
    picker = chat.preset_picker
    assert [picker.combo.itemData(i) for i in range(picker.combo.count())] == [None, "Default", "Greedy", "Creative"]
    assert picker.combo.currentData() == "Default"      # the app's defaults are the Default preset
    chat.system_toggle.setChecked(True)
    chat.system_edit.setPlainText("Answer in French.")
    picker.choose("Greedy")
    assert _fields(chat) == (0.0, 1.0, 1.0) and chat.greedy.isChecked()
    assert chat.system_edit.toPlainText() == "Answer in French."        # a built-in leaves the system prompt
    s = chat.conversation.sampling
    assert (s.temperature, s.top_p, s.repetition_penalty) == (0.0, 1.0, 1.0)
    picker.choose("Creative")
    assert _fields(chat) == pytest.approx((1.0, 0.95, 1.05)) and not chat.greedy.isChecked()
    chat.top_p.setValue(0.5)                            # the fields no longer hold a preset
    assert picker.combo.currentData() is None and picker.combo.currentText() == "Custom"
    assert not picker.delete_button.isEnabled()
    chat.top_p.setValue(0.95)                           # and once they do again, it is named
    assert picker.combo.currentData() == "Creative"
    chat.new_conversation()                             # the choice became the default of new chats
    assert chat.conversation.sampling.temperature == pytest.approx(1.0)


def test_the_users_presets_carry_the_system_prompt_and_are_kept_for_the_next_run(qtbot, make_window, tmp_path):
    ini = tmp_path / "kept.ini"
    chat = make_window(settings_file=ini, app_defaults=True).chat
    picker = chat.preset_picker
    chat.system_edit.setPlainText("You are terse.")
    chat.temperature.setValue(0.3)
    dlg = picker.ask_name()                              # Save… asks for a name, without blocking
    dlg.setTextValue("  Terse   answers ")
    dlg.accept()
    saved = json.loads((tmp_path / "kept.presets.json").read_text())
    assert saved["format"] == "colibri-presets" and saved["presets"] == [
        {"name": "Terse answers", "temperature": 0.3, "top_p": 0.9, "repetition_penalty": 1.1,
         "system": "You are terse."}]
    assert picker.combo.currentData() == "Terse answers" and picker.delete_button.isEnabled()
    assert not list(tmp_path.glob("*.tmp*"))             # written atomically: no temporary file left
    assert picker.save_as("greedy") is None and "built-in preset" in chat.status.text()
    chat.window().close()

    chat = make_window(settings_file=ini, app_defaults=True).chat
    picker = chat.preset_picker
    chat.system_edit.setPlainText("")
    picker.choose("Terse answers")
    assert chat.system_edit.toPlainText() == "You are terse." and chat.system_edit.isVisible()
    assert _fields(chat) == pytest.approx((0.3, 0.9, 1.1))
    chat.temperature.setValue(0.4)
    assert picker.save_as("terse ANSWERS") is not None   # the same name, any case, replaces it
    assert [p["temperature"] for p in json.loads((tmp_path / "kept.presets.json").read_text())["presets"]] == [0.4]
    qtbot.mouseClick(picker.delete_button, _left())
    assert picker.store.find("Terse answers") is None and picker.combo.findData("Terse answers") == -1
    assert json.loads((tmp_path / "kept.presets.json").read_text())["presets"] == []


def test_an_unreadable_presets_file_is_kept_and_never_overwritten(qtbot, make_window, tmp_path):
    broken = tmp_path / "broken.presets.json"
    broken.write_text("{not json")
    chat = make_window(settings_file=tmp_path / "broken.ini", app_defaults=True).chat
    assert chat.preset_picker.combo.count() == 4         # the built-ins still work
    assert chat.preset_picker.save_as("Mine") is None
    assert "could not be read" in chat.status.text() and "move it away" in chat.status.text()
    assert broken.read_text() == "{not json"


def _left():
    from PySide6.QtCore import Qt

    return Qt.MouseButton.LeftButton


def test_the_settings_persist_and_take_effect(qtbot, make_window, tmp_path, monkeypatch):
    from PySide6.QtCore import QSettings
    from PySide6.QtGui import QPalette
    from PySide6.QtWidgets import QApplication, QDialogButtonBox

    from ui.models import start_folder
    from ui.settings_dialog import compute_threads, models_folder
    from ui.theme import apply_theme

    ini, folder = tmp_path / "settings.ini", tmp_path / "my models"
    folder.mkdir()
    window = make_window(settings_file=ini, app_defaults=True)
    dlg = window.show_settings()
    assert dlg.isVisible() and dlg.threads.value() == 0 and dlg.threads.text() == "automatic"
    dlg.folder.setText(str(folder))
    dlg.threads.setValue(1)
    dlg.greedy.setChecked(True)
    dlg.top_p.setValue(0.8)
    dlg.stop_loops.setChecked(False)
    dlg.theme.setCurrentIndex(dlg.theme.findData("dark"))
    try:
        qtbot.mouseClick(dlg.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Ok), _left())
        assert not dlg.isVisible() and window.settings_dialog is None
        kept = QSettings(str(ini), QSettings.Format.IniFormat)
        assert kept.value("paths/models") == str(folder) and int(kept.value("engine/threads")) == 1
        assert kept.value("view/theme") == "dark" and window.theme_actions["dark"].isChecked()
        assert QApplication.instance().palette().color(QPalette.ColorRole.Window).lightness() < 128
        # the empty chat shown and new ones take the sampling; dialogs start in the folder
        chat = window.chat
        assert chat.greedy.isChecked() and chat.top_p.value() == pytest.approx(0.8)
        assert not chat.stop_loops.isChecked()
        assert models_folder(window.settings) == folder and start_folder(window.settings) == str(folder)
        convert = window.models.show_convert()
        assert convert.out_dir == folder
        convert.reject()
        first_run = window.show_first_run()
        assert first_run.models_dir == folder
        first_run.reject()
        # the compute threads go to the engine with the next model opened
        asked = []
        monkeypatch.setattr(window.bridge.service, "load", lambda path, options: asked.append(options) or 99)
        window.open_model(str(tmp_path / "some-model"))
        assert asked[-1].threads == 1
        window.cancel_load()
        window.close()
        again = make_window(settings_file=ini, app_defaults=True)      # the next run keeps them all
        assert compute_threads(again.settings) == 1 and again.chat.greedy.isChecked()
        assert again.theme_actions["dark"].isChecked()
        cancelled = again.show_settings()
        assert cancelled.folder.text() == str(folder) and cancelled.threads.value() == 1
        cancelled.threads.setValue(0)
        cancelled.reject()                                  # Cancel keeps what was there
        assert compute_threads(again.settings) == 1
    finally:
        apply_theme(QApplication.instance(), "system")


def test_the_settings_show_the_whole_models_folder(qtbot, make_window, monkeypatch):
    # the walkthrough's 382 px dialog showed its default folder as "/tmp/walk-home/.local/s..."
    from PySide6.QtWidgets import QStyle, QStyleOptionFrame

    default = "/tmp/walk-home/.local/share/colibri/models"      # paths only shown, never made
    monkeypatch.setenv("COLIBRI_MODELS_DIR", default)
    window = make_window()
    window.resize(1280, 720)
    dlg = window.show_settings()
    qtbot.waitExposed(dlg)
    field = dlg.folder

    def room() -> int:
        """The px the field has for its text (QLineEdit draws it 2 px inside its contents rect, each side)."""
        opt = QStyleOptionFrame()
        field.initStyleOption(opt)
        inside = field.style().subElementRect(QStyle.SubElement.SE_LineEditContents, opt, field)
        return inside.width() - field.textMargins().left() - field.textMargins().right() - 4

    assert field.text() == "" and field.placeholderText() == default
    qtbot.waitUntil(lambda: room() >= field.fontMetrics().horizontalAdvance(default), timeout=3000)
    assert default in field.toolTip()
    longer = "/home/someone/Documents/language models for colibri/converted this week"
    field.setText(longer)
    qtbot.waitUntil(lambda: room() >= field.fontMetrics().horizontalAdvance(longer), timeout=3000)
    assert field.toolTip().startswith(longer + "\n")
    # a path wider than the screen: the field stops at 2/3 of it, the path whole in the tooltip
    field.setText("/very" * 200)
    screen = dlg.screen().availableGeometry().width()
    qtbot.waitUntil(lambda: dlg.width() >= field.minimumWidth() > screen // 2, timeout=3000)
    assert dlg.width() <= screen and field.toolTip().startswith("/very" * 200)
    dlg.reject()


def test_the_engine_runs_with_the_compute_threads_chosen(qtbot, make_window, models, tmp_path):
    import app.config.settings as config

    ini = tmp_path / "threads.ini"
    settings = test_settings(ini)
    settings.setValue("engine/threads", 1)
    settings.sync()
    before = config._process_threads
    try:
        window = make_window(models[1], settings_file=ini)
        assert window.info is not None and config._process_threads == 1
        window.settings.setValue("engine/threads", 99)      # more than numba started with: refused, saying so
        with qtbot.waitSignal(window.bridge.loadFailed, timeout=LOAD_TIMEOUT_MS):
            window.open_model(str(models[1]))
        assert "threads = 99" in window.error_dialog.text() and "NUMBA_NUM_THREADS" in window.error_dialog.text()
        window.error_dialog.close()
    finally:
        if before is not None:
            config.apply_threads(before, "default")


def test_the_shortcuts_page_lists_every_bound_key_and_they_work(qtbot, make_window):
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QApplication

    window = make_window()
    page = window.show_shortcuts()
    rows = dict((what, keys) for what, keys in page.rows())
    for what, keys in (("New chat", "Ctrl+N"), ("Send", "Ctrl+Return"), ("Stop the answer", "Ctrl+."),
                       ("Regenerate the last answer", "Ctrl+R"), ("Search conversations", "Ctrl+F"),
                       ("Settings", "Ctrl+,"), ("Keyboard shortcuts", "F1"), ("Open model folder", "Ctrl+O"),
                       ("Send the question", "Enter"), ("New line in the question", "Shift+Enter")):
        assert rows.get(what) == keys, (what, rows)
    page.close()
    window.activateWindow()
    window.chat.input.setFocus()
    qtbot.waitUntil(lambda: QApplication.focusWidget() is window.chat.input)
    qtbot.keyClick(window.chat.input, Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: QApplication.focusWidget() is window.conversations.search)
    qtbot.keyClick(window.conversations.search, Qt.Key.Key_Comma, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: window.settings_dialog is not None and window.settings_dialog.isVisible())
    window.settings_dialog.reject()
    qtbot.keyClick(window.chat.input, Qt.Key.Key_F1)
    qtbot.waitUntil(lambda: window.shortcuts_dialog is not None and window.shortcuts_dialog.isVisible())
    window.shortcuts_dialog.reject()

