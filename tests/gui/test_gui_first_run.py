"""First run of the desktop app (pytest-qt): with no model to open it offers the demo, a folder or GGUF,
or a pull by name; the pull runs behind a progress dialog that cancels, and what it made opens.
The pull itself is replaced by a fake here (the real one is tested in test_pull.py)."""

from __future__ import annotations

import threading
import time

import pytest

from app.hub import pull as pulls
from app.hub.progress import Note, Progress, render
from support.qt import *  # noqa: F403 - the GUI fixtures (no_leftovers is autouse)
from support.qt import EVENT_TIMEOUT_MS, LOAD_TIMEOUT_MS
from ui import first_run


def preparing_with(monkeypatch, fake) -> None:
    """The first run's preparation done here by `fake` (a pull's signature) instead of by `colibri warm` in a
    child process."""
    monkeypatch.setattr(first_run, "prepare", lambda name, root, report: fake(name, root, report, True))


def test_with_no_model_anywhere_the_first_run_choices_are_offered(qtbot, make_window, tmp_path, monkeypatch):
    from ui.startup import startup_model

    monkeypatch.setenv("COLIBRI_MODELS_DIR", str(tmp_path / "models"))
    window = make_window()
    assert startup_model(None, window) is None
    dlg = window.show_first_run()
    assert dlg.isVisible() and dlg.demo_button.isEnabled()
    assert dlg.bundle is None   # not a packaged app: the demo's source is downloaded when asked
    with qtbot.waitSignal(dlg.finished):
        dlg.close_button.click()
    assert not dlg.isVisible()


def test_a_prepared_demo_or_a_recent_model_opens_without_asking(make_window, tmp_path, monkeypatch, models):
    from ui.startup import startup_model

    monkeypatch.setenv("COLIBRI_MODELS_DIR", str(tmp_path / "models"))
    window = make_window()
    demo = tmp_path / "models" / pulls.DERIVED[pulls.DEFAULT_MODEL].folder
    demo.mkdir(parents=True)
    (demo / "config.json").write_text("{}")
    assert startup_model(None, window) == str(demo)
    window.models.add_recent(models[0])
    assert startup_model(None, window) == str(models[0])
    assert startup_model("given", window) == "given"


def test_the_demo_is_prepared_behind_a_progress_dialog_and_opens(qtbot, make_window, models, tmp_path, monkeypatch):
    calls, shown = [], threading.Event()

    def fake_pull(name, models_dir=None, progress=None, warm_ahead=False):
        calls.append((name, models_dir, warm_ahead))
        for percent in (0, 40, 100):
            progress(Progress("write", percent, 100, "writing experts", model=name))
            time.sleep(0.05)
        progress(Note("compiling kernels on a small stand-in of the model (15 s so far)"))
        shown.wait(EVENT_TIMEOUT_MS / 1e3)
        return models[0]

    preparing_with(monkeypatch, fake_pull)
    window = make_window()
    dlg = window.show_first_run(models_dir=tmp_path / "models")
    lines = []
    with qtbot.waitSignal(window.bridge.modelLoaded, timeout=LOAD_TIMEOUT_MS):
        dlg.demo_button.click()
        dlg.job.progress.connect(lambda event: lines.append(render(event)))
        assert dlg.progress_dialog is not None and dlg.progress_dialog.isVisible()
        assert not dlg.demo_button.isEnabled()
        # a wait after a finished stage shows as busy, not as a full bar
        qtbot.waitUntil(lambda: "stand-in" in dlg.progress_dialog.labelText(), timeout=EVENT_TIMEOUT_MS)
        assert dlg.progress_dialog.maximum() == 0
        assert "5 to 15 minutes" in dlg.progress_dialog.labelText()     # the estimate the dialog covers
        shown.set()
    assert calls == [(pulls.DEFAULT_MODEL, tmp_path / "models", True)]
    assert any("writing experts" in line for line in lines), lines
    assert window.info.name == models[0].name and not dlg.isVisible() and dlg.progress_dialog is None
    assert not dlg.job.running


def test_a_step_that_reports_nothing_shows_a_busy_bar_until_it_measures_again(qtbot, make_window, models, tmp_path,
                                                                             monkeypatch):
    # the walkthrough's first run sat at a still 5% for three minutes while the first calibration chat compiled
    go_on, done = threading.Event(), threading.Event()

    def fake_pull(name, models_dir=None, progress=None, warm_ahead=False):
        progress(Progress("upcycle", 0.05, 1.0, "calibration chats: code", model=name))
        progress(Progress("upcycle", 0.05, 1.0, "calibration chats: code (10 s so far)", model=name, waiting=True))
        go_on.wait(EVENT_TIMEOUT_MS / 1e3)
        progress(Progress("upcycle", 0.52, 1.0, "calibration chats: poetry", model=name))
        done.wait(EVENT_TIMEOUT_MS / 1e3)
        return models[0]

    preparing_with(monkeypatch, fake_pull)
    window = make_window()
    dlg = window.show_first_run(models_dir=tmp_path / "models")
    with qtbot.waitSignal(window.bridge.modelLoaded, timeout=LOAD_TIMEOUT_MS):
        dlg.demo_button.click()
        bar = dlg.progress_dialog
        qtbot.waitUntil(lambda: "10 s so far" in bar.labelText(), timeout=EVENT_TIMEOUT_MS)
        assert bar.maximum() == 0 and "5% calibration chats" in bar.labelText()   # moving, and where it stands
        go_on.set()
        qtbot.waitUntil(lambda: "poetry" in bar.labelText(), timeout=EVENT_TIMEOUT_MS)
        assert (bar.maximum(), bar.value()) == (100, 52)
        done.set()


def test_a_catalogue_name_given_at_start_is_prepared_in_the_window_then_opens(qtbot, make_window, models, tmp_path,
                                                                                monkeypatch):
    from ui.first_run import prepared_at_start
    from ui.startup import open_at_start

    monkeypatch.setenv("COLIBRI_MODELS_DIR", str(tmp_path / "models"))
    calls = []

    def fake_pull(name, models_dir=None, progress=None, warm_ahead=False):
        calls.append(name)
        progress(Progress("upcycle", 0.5, 1.0, "routers: layer 3/30", model=name))
        return models[0]

    preparing_with(monkeypatch, fake_pull)
    assert prepared_at_start(pulls.DEFAULT_MODEL) and not prepared_at_start(str(models[0]))
    window = make_window()
    # `make run` is `colibri gui smollm2-moe`: on a fresh machine the window shows the preparation, then the model
    with qtbot.waitSignal(window.bridge.modelLoaded, timeout=LOAD_TIMEOUT_MS):
        open_at_start(window, pulls.DEFAULT_MODEL)
        assert window.first_run is not None and window.first_run.progress_dialog is not None
    assert calls == [pulls.DEFAULT_MODEL]
    assert window.info.name == models[0].name and not window.first_run.isVisible()


def test_cancelling_the_preparation_stops_the_worker_and_says_so(qtbot, make_window, tmp_path, monkeypatch):
    started = threading.Event()

    def endless_pull(name, models_dir=None, progress=None, warm_ahead=False):
        started.set()
        while True:     # the real preparation reports as it goes; Cancel raises from the progress callback
            progress(Progress("upcycle", 0.1, 1.0, "calibrating", model=name))
            time.sleep(0.02)

    preparing_with(monkeypatch, endless_pull)
    window = make_window()
    dlg = window.show_first_run(models_dir=tmp_path / "models")
    job = dlg.start_pull(pulls.DEFAULT_MODEL)
    assert started.wait(EVENT_TIMEOUT_MS / 1e3)
    qtbot.waitUntil(lambda: dlg.progress_dialog.value() == 10, timeout=EVENT_TIMEOUT_MS)    # the bar follows the events
    assert "calibrating" in dlg.progress_dialog.labelText()
    with qtbot.waitSignal(job.failed, timeout=EVENT_TIMEOUT_MS) as failed:
        dlg.progress_dialog.canceled.emit()     # what its Cancel button does
    assert failed.args[1] is True and "Cancelled" in dlg.error.text()
    assert not job.running and dlg.progress_dialog is None and dlg.demo_button.isEnabled()
    assert window.info is None
    dlg.reject()


def test_a_failed_pull_by_name_shows_why_and_the_dialog_stays(qtbot, make_window, tmp_path, monkeypatch):
    from engine.errors import ColibriError

    def failing_pull(name, models_dir=None, progress=None, warm_ahead=False):
        raise ColibriError(f"{name}: the hub cannot be reached; pull it where there is a network")

    preparing_with(monkeypatch, failing_pull)
    window = make_window()
    dlg = window.show_first_run(models_dir=tmp_path / "models")
    dlg.pull_button.click()
    assert "type a model name" in dlg.error.text() and dlg.job is None
    dlg.name_edit.setText("org/model")
    dlg.pull_button.click()
    job = dlg.job
    qtbot.waitUntil(lambda: not job.running and "hub cannot be reached" in dlg.error.text(), timeout=EVENT_TIMEOUT_MS)
    assert dlg.isVisible() and dlg.demo_button.isEnabled()
    dlg.reject()


def test_the_gguf_shipped_in_the_bundle_seeds_the_models_folder(tmp_path):
    from ui.first_run import seed_from_bundle

    bundle, root = tmp_path / "bundle", tmp_path / "models"
    name = "smollm2-135m"
    gguf = bundle / name / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF fake")
    assert seed_from_bundle(bundle, root)
    assert pulls.pulled_alias(name, root) == root / name / gguf.name   # the pull finds it: no download
    assert not seed_from_bundle(bundle, root)                           # once only
    assert not seed_from_bundle(None, root)


def test_a_long_progress_line_wraps_inside_a_dialog_that_keeps_its_width(qtbot, make_window, tmp_path, monkeypatch):
    # on a fresh clone the dialog grew to its longest line and ran past a 1440 px screen's right edge
    from PySide6.QtWidgets import QLabel

    from app.hub.progress import Note
    from engine.errors import ColibriError

    shown, release = threading.Event(), threading.Event()
    line = ("preparing smollm2-moe-bf16 once: smollm2-135m upcycled into a Mixtral-style MoE of 8 experts per layer "
            "(minutes: the first run also compiles its kernels) ...")

    def slow_pull(name, models_dir=None, progress=None, warm_ahead=False):
        progress(Note(line, model=name))
        shown.set()
        release.wait(EVENT_TIMEOUT_MS / 1e3)
        raise ColibriError("stopped by the test")

    preparing_with(monkeypatch, slow_pull)
    window = make_window()
    dlg = window.show_first_run(models_dir=tmp_path / "models")
    job = dlg.start_pull(pulls.DEFAULT_MODEL)
    assert shown.wait(EVENT_TIMEOUT_MS / 1e3)
    progress = dlg.progress_dialog
    width = progress.width()
    qtbot.waitUntil(lambda: line in progress.labelText(), timeout=EVENT_TIMEOUT_MS)
    label = progress.findChild(QLabel)
    assert progress.width() == width <= max(dlg.width(), 520)
    assert label.wordWrap() and label.height() >= label.heightForWidth(label.width())  # every wrapped line shows
    with qtbot.waitSignal(job.failed, timeout=EVENT_TIMEOUT_MS):
        release.set()
    dlg.reject()


def test_enter_in_the_name_field_pulls_that_name_and_nothing_else(qtbot, make_window, tmp_path, monkeypatch):
    # under X11, Enter there started the pull, disabling the field; focus went to "Not now", which became the
    # default button and took the same key press: the dialog closed and cancelled the pull
    from PySide6.QtCore import Qt

    from engine.errors import ColibriError

    names, release = [], threading.Event()

    def slow_pull(name, models_dir=None, progress=None, warm_ahead=False):
        names.append(name)
        release.wait(EVENT_TIMEOUT_MS / 1e3)
        raise ColibriError("offline")

    preparing_with(monkeypatch, slow_pull)
    window = make_window()
    dlg = window.show_first_run(models_dir=tmp_path / "models")
    qtbot.waitExposed(dlg)
    dlg.activateWindow()
    dlg.name_edit.setFocus()
    qtbot.keyClick(dlg.name_edit, Qt.Key.Key_Return)          # no name yet: says so, and prepares no demo
    assert "type a model name" in dlg.error.text() and dlg.job is None and dlg.isVisible()
    dlg.close_button.setDefault(True)                          # what focus arriving on "Not now" does
    dlg.name_edit.setText("org/model")
    qtbot.keyClick(dlg.name_edit, Qt.Key.Key_Return)
    job = dlg.job
    assert dlg.isVisible() and job is not None and job.running and not job.cancelled
    with qtbot.waitSignal(job.failed, timeout=EVENT_TIMEOUT_MS) as failed:
        release.set()
    assert failed.args[1] is False and names == ["org/model"] and dlg.isVisible()
    dlg.reject()


def test_prepare_runs_the_child_and_finds_the_model_here(tmp_path, monkeypatch):
    # `colibri warm --events --models-dir ROOT NAME` in a child; the model it left is then found in this process
    from app.service import warm
    from engine.errors import ColibriError

    model = tmp_path / "models" / "tiny"
    asked, lines = [], []

    def child(name, report, models_dir=None):
        asked.append((name, models_dir))
        model.mkdir(parents=True, exist_ok=True)
        report(Progress("warm", 1, 3, "warm-up: a greedy answer"))

    monkeypatch.setattr(warm, "warm_up_apart", child)
    assert first_run.prepare(str(model), tmp_path / "models", lines.append) == model
    assert asked == [(str(model), tmp_path / "models")] and lines[0].message == "warm-up: a greedy answer"

    def failing(name, report, models_dir=None):
        raise ColibriError("the warm-up stopped: out of memory")

    monkeypatch.setattr(warm, "warm_up_apart", failing)
    lines.clear()
    assert first_run.prepare(str(model), tmp_path / "models", lines.append) == model     # here: the warm-up only
    assert "the first answer will compile its kernels" in lines[-1].message
    with pytest.raises(ColibriError, match="out of memory"):                            # not here: the pull failed
        first_run.prepare(str(tmp_path / "nowhere"), tmp_path / "models", lines.append)
