"""The window's dialogs and menus (pytest-qt, offscreen): file dialogs start in the models folder; Convert
names its output from the source and refuses a container; "Get a model" knows a model is loaded; a pull's
error wraps; the status line elides; the About box; View > Theme and the sliders kept in QSettings."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import QSettings
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QApplication, QFileDialog, QLabel

from app.service.local import LoadOptions, SettingsChange
from support.qt import *  # noqa: F403 - the GUI fixtures (no_leftovers is autouse)
from support.qt import LOAD_TIMEOUT_MS
from ui.models import output_name


@pytest.fixture
def models_folder(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "my-models"
    monkeypatch.setenv("COLIBRI_MODELS_DIR", str(folder))
    folder.mkdir()
    return folder


def test_open_dialogs_start_in_the_models_folder(qtbot, make_window, models_folder, monkeypatch):
    asked = []
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda parent, title, start="": asked.append(start) or "")
    monkeypatch.setattr(QFileDialog, "getOpenFileName",
                        lambda parent, title, start="", filt="": asked.append(start) or ("", ""))
    window = make_window()
    window.models.open_folder.trigger()
    window.models.open_gguf.trigger()
    dialog = window.models.show_convert()
    dialog._browse()
    assert asked == [str(models_folder)] * 3


@pytest.mark.parametrize("source, bits, name", [
    ("/m/SmolLM2-135M-Instruct.Q4_1.gguf", 4, "SmolLM2-135M-Instruct-q4"),
    ("/m/tiny-chat-moe-q4", 4, "tiny-chat-moe-q4"),
    ("/m/Qwen3-30B-A3B-FP8", 8, "Qwen3-30B-A3B-q8"),
    ("/m/Mixtral-8x7B-v0.1", 3, "Mixtral-8x7B-v0.1-q3"),
    ("/m/model-bf16", 4, "model-q4"),
])
def test_convert_proposes_one_q_suffix_from_the_source_name(source, bits, name):
    assert output_name(source, bits) == name


def test_convert_refuses_to_quantize_a_container_again_and_says_what_to_convert(qtbot, make_window, models,
                                                                                 models_folder):
    src, container = models
    window = make_window(container)                 # the loaded model is a container: not offered as a source
    dialog = window.models.show_convert()
    assert dialog.source.text() == ""
    qtbot.waitExposed(dialog)
    width = dialog.width()
    dialog.source.setText(str(container))
    assert not dialog.start_button.isEnabled()
    assert "quantized already" in dialog.error.text() and "Hugging Face folder or GGUF" in dialog.error.text()
    # all of its three lines show, above the buttons (a fresh clone's dialog drew them in the room of one)
    qtbot.waitUntil(lambda: dialog.error.height() >= dialog.error.heightForWidth(dialog.error.width()), timeout=3000)
    assert dialog.error.geometry().bottom() < dialog.start_button.mapTo(dialog, dialog.start_button.rect().topLeft()).y()
    assert dialog.width() == width
    dialog.start()                                  # even if asked: no job starts
    assert dialog.job is None
    dialog.source.setText(str(src))                 # its source converts, named from it
    assert dialog.start_button.isEnabled() and dialog.error.text() == ""
    assert dialog.output.text() == str(models_folder / "tiny-chat-moe-q4")
    dialog.reject()


def test_get_a_model_with_a_model_loaded_does_not_say_no_model_yet(qtbot, make_window, models, models_folder):
    window = make_window()
    first = window.show_first_run()
    intro = first.findChild(type(first.error), "firstRunIntro")
    assert "No model yet" in intro.text()
    first.reject()
    window = make_window(models[1])
    dlg = window.show_first_run()
    intro = dlg.findChild(type(dlg.error), "firstRunIntro")
    assert "No model yet" not in intro.text() and window.info.name in intro.text()
    assert dlg.windowTitle() == "Get a model"
    assert dlg.demo_button.isEnabled()                   # another model is loaded: the demo is still on offer
    dlg.reject()


def test_get_a_model_with_the_demo_loaded_does_not_offer_to_prepare_it(qtbot, make_window, models, tmp_path):
    import shutil

    from app.hub.pull import DEFAULT_MODEL, DERIVED

    demo = shutil.copytree(models[1], tmp_path / DERIVED[DEFAULT_MODEL].folder)   # where the first run puts it
    window = make_window(demo)
    dlg = window.show_first_run()
    assert not dlg.demo_button.isEnabled()
    assert any("demo model is the one loaded" in label.text() for label in dlg.findChildren(type(dlg.error)))
    dlg.reject()


def test_an_offline_pulls_error_wraps_inside_the_dialog(qtbot, make_window, models_folder):
    window = make_window()
    dlg = window.show_first_run()
    qtbot.waitExposed(dlg)
    message = ("It did not work: the Hugging Face hub cannot be reached (offline?): https://huggingface.co/api/models/"
               "HuggingFaceTB/SmolLM2-135M-Instruct/revision/main/tree/with/a/long/path; connect to the internet, "
               "or open a model folder or GGUF file you already have")
    width = dlg.width()
    dlg.show_error(message)
    qtbot.waitUntil(lambda: dlg.error.height() >= dlg.error.heightForWidth(dlg.error.width()), timeout=3000)
    error, close = dlg.error.geometry(), dlg.close_button.geometry()
    assert error.bottom() < close.top()             # below the choices, above the buttons: nothing drawn over
    assert error.right() <= dlg.width()             # wrapped, not cut at the dialog's edge
    assert dlg.error.text().replace("\u200b", "") == message
    assert dlg.width() == width                      # it grows taller, not narrower (it fell from 520 to ~300 px)
    dlg.reject()


def test_the_status_line_elides_its_model_name_instead_of_cutting_it(qtbot, make_window):
    window = make_window()
    window.resize(1280, 720)
    long = "a-model-with-a-very-long-name-" * 12 + " · mixtral · experts stream from disk"
    window.model_label.setText(long)
    qtbot.waitUntil(lambda: window.model_label.width() < window.width(), timeout=3000)
    shown = window.model_label.elided()
    assert shown.endswith("…") and len(shown) > 20  # most of it shows, then an ellipsis, not "D"
    assert window.model_label.toolTip() == long     # and the whole text is one hover away


def test_the_chat_status_keeps_one_line_and_names_the_model_in_its_tooltip_at_1280x720(qtbot, make_window, models,
                                                                                     monkeypatch):
    # beside the buttons it was cut to "St"; wrapped under them, "... · smollm2-135m-" / "moe-e8-q4" pushed the input
    # up a line (the walkthrough at 1440x900 and 1280x720)
    from engine.events import DoneEvent, GenerationStats

    window = make_window(models[1])
    window.resize(1280, 720)
    chat, status = window.chat, window.chat.status
    qtbot.waitUntil(lambda: window.width() == 1280 and status.width() >= chat.transcript.width() - 20, timeout=3000)

    def layout() -> tuple[int, int]:
        """The status line's height and where the input sits in the chat."""
        chat.layout().activate()                        # laid out now, not at some later event
        return status.height(), chat.input.mapTo(chat, chat.input.rect().topLeft()).y()

    before = layout()
    assert before[0] == status.sizeHint().height() < 2 * status.fontMetrics().lineSpacing()
    # the answer's end as the engine reports it, stopped after 261 tokens (no decoding: the layout is under test)
    monkeypatch.setattr(window.bridge.service, "generate", lambda **_kw: 4242)
    assert chat.send("Write a Python function that checks for primes")
    stats = GenerationStats(prompt_tokens=40, generated_tokens=261, prompt_s=0.3, decode_s=17.8, ttft_s=0.86)
    window.bridge.generation.emit(4242, DoneEvent("cancelled", tuple(range(261)), "def is_prime(n):", stats))
    name = window.info.name
    shown, tip = status.text(), status.toolTip()
    assert shown.startswith("Stopped: TTFT 0.86 s") and "261 tokens · stopped" in shown and name not in shown
    assert tip == f"{shown} · {name}"                  # the whole line, the model too, one hover away
    assert layout() == before
    long = "Stopped: TTFT 12.69 s · 12.0 tok/s · 318 tokens · stopped: it repeated itself " + "and more " * 20
    chat._set_status(long)
    assert status.elided().endswith("…") and status.toolTip() == long
    assert layout() == before                           # the input never moves for the status
    chat._set_status("就绪：" + name)                    # nor for a status in Chinese, in a taller fallback font
    assert layout() == before
    assert status.mapTo(chat, status.rect().bottomLeft()).y() <= chat.height()


def test_the_about_box_names_version_licence_and_links(qtbot, make_window):
    from app import __version__

    window = make_window()
    box = window._about()
    text = box.text()
    assert f"Colibri {__version__}" in text and "Apache-2.0" in text
    assert text.count("<a href=\"https://") >= 3
    label = next(w for w in box.findChildren(QLabel) if "Apache-2.0" in w.text())
    assert label.openExternalLinks()                # a click opens the link in the browser
    box.close()


def test_the_theme_is_chosen_from_the_view_menu_and_kept(qtbot, make_window, tmp_path):
    settings_file = tmp_path / "kept.ini"
    app = QApplication.instance()
    window = make_window(settings_file=settings_file)
    assert window.theme_actions["system"].isChecked()
    try:
        window.theme_actions["dark"].trigger()
        assert app.palette().color(QPalette.ColorRole.Window).lightness() < 128
        assert QSettings(str(settings_file), QSettings.Format.IniFormat).value("view/theme") == "dark"
        window.close()
        again = make_window(settings_file=settings_file)   # the next start takes it
        assert again.theme_actions["dark"].isChecked()
        assert app.palette().color(QPalette.ColorRole.Window).lightness() < 128
        again.theme_actions["light"].trigger()
        assert app.palette().color(QPalette.ColorRole.Window).lightness() >= 128
    finally:
        from ui.theme import apply_theme

        apply_theme(app, "system")


def test_the_sliders_are_remembered_for_the_next_model(qtbot, make_window, models, tmp_path):
    settings_file = tmp_path / "kept.ini"
    window = make_window(models[1], settings_file=settings_file)
    with qtbot.waitSignal(window.bridge.settingsApplied, timeout=30_000) as applied:
        window.controls.changeRequested.emit(SettingsChange(prefetch_depth=3, io_threads=4))
    assert applied.args[0].problems == ()
    window.close()
    again = make_window(settings_file=settings_file)
    with qtbot.waitSignal(again.bridge.settingsApplied, timeout=LOAD_TIMEOUT_MS) as applied:
        again.open_model(str(models[1]))
    settings = applied.args[0].info.settings
    assert (settings.prefetch_depth, settings.io_threads) == (3, 4)
    assert again.controls.prefetch.slider.value() == 3 and again.controls.io_threads.slider.value() == 4


def remembered(path: Path, **controls: int) -> Path:
    """A settings file holding the sliders' remembered positions (as a window's last run left them)."""
    kept = QSettings(str(path), QSettings.Format.IniFormat)
    for name, value in controls.items():
        kept.setValue(f"controls/{name}", value)
    kept.sync()
    return path


def with_settings(container: Path, tmp_path: Path, toml: str) -> Path:
    """A copy of the tiny container (its experts stream) with a colibri.toml of its own."""
    import shutil

    folder = Path(shutil.copytree(container, tmp_path / "with-settings"))
    (folder / "colibri.toml").write_text(toml, encoding="utf-8")
    return folder


def test_settings_given_for_a_load_win_over_remembered_ones(qtbot, make_window, models, tmp_path):
    settings_file = remembered(tmp_path / "kept.ini", prefetch_depth=3, io_threads=4)
    window = make_window(settings_file=settings_file)
    window.load_options = LoadOptions(io_threads=1)   # as `colibri gui --io-threads 1` would
    with qtbot.waitSignal(window.bridge.settingsApplied, timeout=LOAD_TIMEOUT_MS) as applied:
        window.open_model(str(models[1]))
    settings = applied.args[0].info.settings
    assert (settings.prefetch_depth, settings.io_threads) == (3, 1)


def test_a_model_opened_from_the_app_reads_its_colibri_toml(qtbot, make_window, models, tmp_path, monkeypatch):
    # `colibri gui` then File > Open: the model gets what `colibri gui MODEL` would give it (its colibri.toml under
    # the command line's flags), not the options of the model the app started with
    from app.commands.gui import _options_for

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))       # no user file of this machine
    folder = with_settings(models[1], tmp_path, "prefetch_depth = 2\nio_threads = 3\n")
    window = make_window()
    window.options_for = _options_for(["gui", "--io-threads", "1"])
    with qtbot.waitSignal(window.bridge.modelLoaded, timeout=LOAD_TIMEOUT_MS) as loaded:
        window.open_model(str(folder))
    settings = loaded.args[0].info.settings
    assert (settings.prefetch_depth, settings.io_threads) == (2, 1)         # the file's, under the flag

    (folder / "colibri.toml").write_text("prefetch_depth = = 2\n", encoding="utf-8")
    assert window.open_model(str(folder)) == -1                             # refused before unloading anything
    assert window.info is not None and window.info.path == folder and window.chat.isEnabled()
    assert "not valid TOML" in window.error_dialog.text() + window.error_dialog.informativeText()


def test_remembered_sliders_win_over_a_models_file_and_yield_to_flags(qtbot, make_window, models, tmp_path,
                                                                      monkeypatch):
    # the walkthrough moved the demo's budget, restarted, and found its colibri.toml's budget again: a slider the
    # user moved is kept over a settings file, and only the command line's own flags and variables beat it
    from app.commands.gui import _asked, _options_for

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    folder = with_settings(models[1], tmp_path, "prefetch_depth = 2\nio_threads = 3\n")
    settings_file = remembered(tmp_path / "kept.ini", prefetch_depth=3, io_threads=4)
    window = make_window(settings_file=settings_file)
    argv = ["gui", "--io-threads", "1"]
    window.options_for, window.asked = _options_for(argv), _asked(argv)
    assert window.asked == frozenset({"io_threads"})
    with qtbot.waitSignal(window.bridge.settingsApplied, timeout=LOAD_TIMEOUT_MS) as applied:
        window.open_model(str(folder))
    settings = applied.args[0].info.settings
    assert (settings.prefetch_depth, settings.io_threads) == (3, 1)       # remembered over the file; the flag over both
