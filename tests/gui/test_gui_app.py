"""The main window (pytest-qt, offscreen): a model that fails to load shows a dialog and the app
stays up; a slider change reaches the engine and the Overview's budget follows; a model held
whole says why its budget is fixed; layout, recent models and theme; converting behind a
cancellable progress dialog; `colibri gui` without a display."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from app.service.local import TIER_CACHED, TIER_DISK, SettingsChange
from engine.events import DoneEvent
from support.qt import *  # noqa: F403 - the GUI fixtures (no_leftovers is autouse)
from support.qt import EVENT_TIMEOUT_MS, LOAD_TIMEOUT_MS, ask, wait_until


def _broken(tmp_path):
    """A model folder whose config.json is not JSON."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    return broken


def test_a_model_that_fails_to_load_shows_its_error_and_the_app_stays_up(qtbot, make_window, models, tmp_path):
    window = make_window()
    assert not window.chat.send_button.isEnabled() and "open a model" in window.chat.send_button.toolTip()
    with qtbot.waitSignal(window.bridge.loadFailed, timeout=LOAD_TIMEOUT_MS):
        window.open_model(str(_broken(tmp_path)))
    box = window.error_dialog
    assert box is not None and box.isVisible() and "config.json" in box.text()
    assert window.info is None and not window.controls.budget.slider.isEnabled()
    box.accept()
    qtbot.waitUntil(lambda: window.error_dialog is None)
    with qtbot.waitSignal(window.bridge.modelLoaded, timeout=LOAD_TIMEOUT_MS):   # the engine is still there
        window.open_model(str(models[0]))
    assert window.info.name == models[0].name and window.chat.info is window.info
    assert window.models.recent.paths()[0] == str(models[0])


def test_a_model_that_cannot_open_leaves_the_one_in_use_loaded(qtbot, make_window, models, tmp_path):
    # the walkthrough's first complaint: the working model was unloaded before the new one was known to open
    window = make_window()
    with qtbot.waitSignal(window.bridge.modelLoaded, timeout=LOAD_TIMEOUT_MS):
        window.open_model(str(models[0]))
    info, line = window.info, window.model_label.text()
    with qtbot.waitSignal(window.bridge.loadFailed, timeout=LOAD_TIMEOUT_MS):
        window.open_model(str(_broken(tmp_path)))
    box = window.error_dialog
    assert box is not None and "config.json" in box.text() and f"{info.name} is still loaded" in box.text()
    assert window.info == info and window.chat.info == info and window.model_label.text() == line
    window.chat.input.setPlainText("Hello")                                       # and it takes a question
    assert window.chat.send_button.isEnabled()
    box.accept()


def test_a_load_can_be_cancelled_from_the_status_bar(qtbot, make_window, models, monkeypatch):
    from app.service.engine_thread import EngineThread

    # a warm tiny model loads in milliseconds, sooner than a click: the load waits at its start for the click
    clicked, plan = threading.Event(), EngineThread._plan_load
    monkeypatch.setattr(EngineThread, "_plan_load", lambda self, *a: (clicked.wait(LOAD_TIMEOUT_MS / 1000),
                                                                      plan(self, *a))[1])
    window = make_window()
    with qtbot.waitSignal(window.bridge.loadFailed, timeout=LOAD_TIMEOUT_MS) as failed:
        window.open_model(str(models[0]))
        assert window.load_cancel.isVisible()
        window.load_cancel.click()              # before the engine is done: the load stops at its next step
        clicked.set()
    assert failed.args[0].cancelled and window.error_dialog is None
    assert "cancelled" in window.model_label.text() and window.load_bar.isHidden()


def test_a_slider_change_reaches_the_engine_and_the_overview_budget_follows(qtbot, window):
    info = window.info
    least, full = info.budget_range
    assert info.settings.memory_budget == full and window.controls.budget.slider.isEnabled()
    budgets = []
    real = window.inspector.set_model_info
    window.inspector.set_model_info = lambda n_layers, n_experts, budget: (budgets.append(budget),
                                                                          real(n_layers, n_experts, budget))
    slider = window.controls.budget.slider
    with qtbot.waitSignal(window.bridge.settingsApplied, timeout=30_000) as applied:
        slider.setValue(slider.minimum())          # applied once the slider rests (debounced)
    settings = applied.args[0].info.settings
    assert applied.args[0].problems == () and settings.memory_budget == least
    assert window.bridge.service.info.settings.memory_budget == settings.memory_budget   # the engine has it
    assert budgets[-1] == settings.memory_budget                                       # and so does the inspector
    overview = getattr(window.inspector, "overview", None)
    if overview is not None and hasattr(overview, "budget_bar"):
        from ui.inspector.common import fmt_bytes

        qtbot.waitUntil(lambda: fmt_bytes(settings.memory_budget) in overview.budget_bar.format(), timeout=EVENT_TIMEOUT_MS)
    # a smaller budget moves experts to disk: the next answer reads them back
    snaps, grids = [], []
    window.bridge.snapshot.connect(snaps.append)
    window.bridge.tiers.connect(grids.append)
    done = []
    window.bridge.generation.connect(lambda r, e: isinstance(e, DoneEvent) and done.append(e))
    window.chat.max_tokens.setValue(30)
    window.chat.send("Read experts from disk")
    qtbot.waitUntil(lambda: bool(done and snaps) and snaps[-1].gauges.get("budget") == settings.memory_budget,
                    timeout=LOAD_TIMEOUT_MS)
    assert snaps[-1].hits["disk"] > 0 and snaps[-1].bytes_read > 0
    assert grids and {TIER_DISK} <= set(grids[-1].ravel().tolist()) and (grids[-1] != TIER_DISK).any()
    assert TIER_CACHED in grids[-1] or (grids[-1] > TIER_DISK).any()


def test_settings_the_engine_refuses_are_shown_and_the_sliders_go_back(qtbot, window):
    controls = window.controls
    with qtbot.waitSignal(window.bridge.settingsApplied, timeout=30_000) as applied:
        controls.changeRequested.emit(SettingsChange(memory_budget=1000))
    assert "too small" in controls.problem.text()
    assert controls.budget.slider.value() == controls.position_of(applied.args[0].info.settings.memory_budget)
    assert controls.budget.slider.value() == controls.budget.slider.maximum()
    with qtbot.waitSignal(window.bridge.settingsApplied, timeout=30_000) as applied:
        controls.prefetch.slider.setValue(3)
        controls.apply()
    assert applied.args[0].info.settings.prefetch_depth == 3 and controls.problem.text() == ""


def test_a_model_held_whole_disables_its_budget_with_the_reason(qtbot, make_window, models):
    window = make_window(models[0])
    budget = window.controls.budget
    assert not budget.slider.isEnabled() and "held whole" in budget.slider.toolTip()
    assert not window.controls.prefetch.slider.isEnabled()
    assert window.controls.context.slider.isEnabled()
    with qtbot.waitSignal(window.bridge.settingsApplied, timeout=30_000) as applied:
        window.controls.context.slider.setValue(0)
        window.controls.apply()
    assert applied.args[0].info.settings.context_length == 256


def test_a_model_held_whole_puts_the_budget_slider_at_its_end_after_a_budgeted_one(qtbot, make_window, models):
    # the walkthrough opened a GGUF after the demo at 540 MB: "whole model" under a slider left halfway
    window = make_window(models[1])
    slider = window.controls.budget.slider
    with qtbot.waitSignal(window.bridge.settingsApplied, timeout=30_000):
        slider.setValue(slider.minimum())
    assert slider.value() == slider.minimum() < slider.maximum()
    with qtbot.waitSignal(window.bridge.modelLoaded, timeout=LOAD_TIMEOUT_MS):
        window.open_model(str(models[0]))
    assert not slider.isEnabled() and slider.value() == slider.maximum()
    assert window.controls.budget.value_label.text() == "whole model" and "held whole" in slider.toolTip()


def test_the_layout_and_recent_models_are_kept_between_runs(qtbot, make_window, models, tmp_path):
    from PySide6.QtWidgets import QDockWidget

    first = make_window(models[0])
    for name in ("dockControls", "dockInspector"):   # (the offscreen screen is 800 px wide: make room)
        first.findChild(QDockWidget, name).hide()
    qtbot.wait(50)                                  # the window's minimum size follows the hidden docks
    first.resize(760, 560)
    qtbot.waitUntil(lambda: first.width() == 760)
    first.close()
    second = make_window()
    assert (second.width(), second.height()) == (760, 560)
    assert second.findChild(QDockWidget, "dockControls").isHidden()
    assert second.findChild(QDockWidget, "dockInspector").isHidden()
    assert second.findChild(QDockWidget, "dockConversations").isVisible()
    assert second.models.recent.paths() == [str(models[0])]


def test_the_theme_follows_the_system_scheme(qtbot, make_window):
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QPalette
    from PySide6.QtWidgets import QApplication

    from ui.theme import follow_scheme

    window = make_window()
    app = QApplication.instance()
    assert app.style().name().lower() == "fusion" and not app.windowIcon().isNull()
    try:
        follow_scheme(app, Qt.ColorScheme.Dark)
        qtbot.waitUntil(lambda: window.palette().color(QPalette.ColorRole.Window).lightness() < 128)
        assert window.chat.transcript.palette().color(QPalette.ColorRole.Base).lightness() < 128
        follow_scheme(app, Qt.ColorScheme.Light)
        qtbot.waitUntil(lambda: window.palette().color(QPalette.ColorRole.Window).lightness() > 128)
    finally:
        follow_scheme(app, app.styleHints().colorScheme())


def test_an_unchecked_box_has_a_visible_edge_in_the_dark_theme(qtbot, make_window):
    # the walkthrough's unchecked "Greedy" and "Compare answers" were dark squares on the dark background
    from PySide6.QtGui import QColor
    from PySide6.QtWidgets import QApplication, QStyle, QStyleOptionButton

    from ui.theme import apply_theme

    window = make_window()
    chat, app = window.chat, QApplication.instance()
    box = chat.greedy
    box.setChecked(False)

    def edge_and_background() -> tuple[QColor, QColor]:
        """The indicator's left edge, and the background 2 px above it, as the chat panel draws them."""
        opt = QStyleOptionButton()
        box.initStyleOption(opt)
        r = box.style().subElementRect(QStyle.SubElement.SE_CheckBoxIndicator, opt, box)
        image = chat.grab().toImage()
        left, middle = box.mapTo(chat, r.topLeft()), box.mapTo(chat, r.center())
        return QColor(image.pixel(left.x(), middle.y())), QColor(image.pixel(middle.x(), left.y() - 2))

    try:
        for choice in ("dark", "light", "dark"):        # and back: the light theme keeps Fusion's own edge
            window.theme_actions[choice].trigger()
            # the app's palette reaches the widgets with the next events
            qtbot.waitUntil(lambda: (chat.palette().color(chat.backgroundRole()).lightness() < 128) == (choice == "dark"),
                            timeout=3000)
            edge, background = edge_and_background()
            assert (background.lightness() < 128) == (choice == "dark")
            assert abs(edge.lightness() - background.lightness()) >= 40, (choice, edge.getRgb(), background.getRgb())
    finally:
        apply_theme(app, "system")


def test_convert_runs_behind_a_progress_dialog_and_opens_the_result(qtbot, make_window, models, tmp_path):
    window = make_window()
    dialog = window.models.show_convert(str(models[0]))
    dialog.output.setText(str(tmp_path / "converted"))
    with qtbot.waitSignal(window.bridge.modelLoaded, timeout=LOAD_TIMEOUT_MS):
        qtbot.mouseClick(dialog.start_button, _left())   # converted, then opened
    assert (tmp_path / "converted" / "manifest.json").is_file()
    assert window.info.streaming == "experts" and not dialog.isVisible()


def test_a_conversion_can_be_cancelled(qtbot, make_window, models, tmp_path, monkeypatch):
    import ui.models

    window = make_window()
    started, release = threading.Event(), threading.Event()
    real = ui.models.convert

    def held(*args, **kwargs):                  # waits until Cancel was pressed, then converts for real
        started.set()
        release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(ui.models, "convert", held)
    dialog = window.models.show_convert(str(models[0]))
    dialog.output.setText(str(tmp_path / "never"))
    dialog.start()
    assert started.wait(30) and dialog.progress_dialog.isVisible()
    dialog.progress_dialog.canceled.emit()      # what its Cancel button does
    release.set()
    qtbot.waitUntil(lambda: "cancelled" in dialog.error.text(), timeout=LOAD_TIMEOUT_MS)
    assert dialog.progress_dialog is None and not dialog.job.running
    assert not (tmp_path / "never" / "manifest.json").exists()
    dialog.reject()


def _left():
    from PySide6.QtCore import Qt

    return Qt.MouseButton.LeftButton


# ---- `colibri gui` ---------------------------------------------------------------------------------


def test_display_problem_names_what_is_missing():
    from app.config.runtime import display_problem

    assert "DISPLAY" in display_problem({}, "linux") and "colibri chat" in display_problem({}, "linux")
    assert display_problem({"DISPLAY": ":0"}, "linux") is None
    assert display_problem({"WAYLAND_DISPLAY": "wayland-0"}, "linux") is None
    assert display_problem({"QT_QPA_PLATFORM": "offscreen"}, "linux") is None
    assert display_problem({}, "darwin") is None and display_problem({}, "win32") is None


@pytest.mark.parametrize("args, code", [(["gui", "--check-display"], 3), (["gui"], 2)])
def test_colibri_gui_without_a_display_exits_with_the_reason(args, code):
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    proc = subprocess.run([sys.executable, "-m", "app.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == code
    assert "no display" in proc.stderr and "colibri chat" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_colibri_gui_opens_the_model_and_closes_cleanly_on_ctrl_c(models, tmp_path):
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "XDG_CONFIG_HOME": str(tmp_path / "config"),
           "XDG_DATA_HOME": str(tmp_path / "data")}
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "gui", str(models[1]), "--ctx", "512"], env=env,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + LOAD_TIMEOUT_MS / 1000
        while not any("loaded" in line for line in lines) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any(f"loaded {models[1]}" in line for line in lines), lines
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
    assert not any("Traceback" in line for line in lines), "".join(lines)
    assert (tmp_path / "config" / "colibri" / "Colibri.conf").is_file()       # the layout was saved


def test_an_answer_reaches_the_cache_meter_the_story_and_the_replay(qtbot, window):
    """The bridge carries the expert cache's trace and counters: the Cache tab replays them, the Brain tells a
    clicked expert's story and replays the answer's tokens."""
    inspector = window.inspector
    traces, counts = [], []
    window.bridge.cacheTrace.connect(traces.append)
    window.bridge.expertCounts.connect(counts.append)
    done = ask(qtbot, window, "Which experts answer this?", max_tokens=12)
    assert done.finish_reason in ("stop", "length")
    wait_until(qtbot, lambda: bool(traces and traces[-1] is not None and traces[-1].steps and counts
                                   and counts[-1] is not None and len(counts[-1].routes.token)), 30_000)
    inspector.tabs.setCurrentWidget(inspector.cache)
    wait_until(qtbot, lambda: inspector.cache.replays > 0, 60_000)
    assert inspector.cache.figures["optimum"].text().endswith("%")
    inspector.tabs.setCurrentWidget(inspector.brain)
    wait_until(qtbot, lambda: len(inspector.brain.replay.tokens) > 0, EVENT_TIMEOUT_MS)
    layer, ids, _ = counts[-1].routes.of(int(counts[-1].routes.tokens()[-1]))[0]
    inspector.brain.set_selected((layer, ids[0]))
    assert inspector.brain.story.isVisible()
    assert f"layer {layer}, expert {ids[0]}" == inspector.brain.story.title.text()
    assert "served from memory" in inspector.brain.story.body.text()
