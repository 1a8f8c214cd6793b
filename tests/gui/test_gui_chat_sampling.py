"""The chat's sampling defaults and loop stopping (pytest-qt, offscreen): the app's defaults suit small models
and are remembered, Greedy is one click away, an answer that loops is stopped and the transcript says so, and
the demo model is named for what it is."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.events import DoneEvent, TokenEvent
from engine.generation.loops import find_loop
from support.qt import *  # noqa: F403 - the GUI fixtures (no_leftovers is autouse)
from support.qt import LOAD_TIMEOUT_MS
from support.server import paced


def _left():
    from PySide6.QtCore import Qt

    return Qt.MouseButton.LeftButton


def test_a_new_chat_starts_with_the_defaults_small_models_want(make_window):
    chat = make_window(app_defaults=True).chat
    assert (chat.temperature.value(), chat.top_p.value(), chat.repeat_penalty.value()) == pytest.approx((0.7, 0.9, 1.1))
    assert not chat.greedy.isChecked() and chat.stop_loops.isChecked()
    s = chat.conversation.sampling
    assert (s.temperature, s.top_p, s.repetition_penalty) == pytest.approx((0.7, 0.9, 1.1))


def test_tests_windows_start_greedy_without_loop_stopping(make_window):
    chat = make_window().chat
    assert chat.greedy.isChecked() and chat.temperature.value() == 0 and not chat.stop_loops.isChecked()
    assert chat.conversation.sampling.temperature == 0


def test_greedy_is_one_click_away_and_gives_the_temperature_back(qtbot, make_window):
    chat = make_window(app_defaults=True).chat
    chat.temperature.setValue(0.8)
    qtbot.mouseClick(chat.greedy, _left())
    assert chat.greedy.isChecked() and chat.temperature.value() == 0
    qtbot.mouseClick(chat.greedy, _left())
    assert not chat.greedy.isChecked() and chat.temperature.value() == pytest.approx(0.8)
    chat.temperature.setValue(0.0)              # typing 0 is greedy too
    assert chat.greedy.isChecked()


def test_the_chosen_sampling_is_remembered_for_new_chats_and_the_next_run(qtbot, make_window, tmp_path):
    ini = tmp_path / "remembered.ini"
    first = make_window(settings_file=ini, app_defaults=True)
    chat = first.chat
    chat.temperature.setValue(0.5)
    chat.top_p.setValue(0.8)
    chat.repeat_penalty.setValue(1.25)
    qtbot.mouseClick(chat.stop_loops, _left())
    chat.new_conversation()
    s = chat.conversation.sampling
    assert (s.temperature, s.top_p, s.repetition_penalty) == pytest.approx((0.5, 0.8, 1.25))
    qtbot.mouseClick(chat.greedy, _left())
    first.close()
    chat = make_window(settings_file=ini, app_defaults=True).chat
    assert chat.greedy.isChecked() and chat.conversation.sampling.temperature == 0
    assert (chat.top_p.value(), chat.repeat_penalty.value()) == pytest.approx((0.8, 1.25))
    assert not chat.stop_loops.isChecked()
    qtbot.mouseClick(chat.greedy, _left())
    assert chat.temperature.value() == pytest.approx(0.5)       # the last temperature above 0


def test_the_defaults_reach_the_engine(qtbot, make_window, models, monkeypatch):
    """One sampled answer at the app's defaults (the sampled path's first compile is slow: only here)."""
    window = make_window(models[1], app_defaults=True)
    asked: list = []
    generate = window.bridge.service.generate
    monkeypatch.setattr(window.bridge.service, "generate", lambda **kw: asked.append(kw) or generate(**kw))
    chat = window.chat
    chat.max_tokens.setValue(12)
    events = _record(window)
    assert chat.send("Hello")
    qtbot.waitUntil(lambda: _done(events) is not None and not chat.generating, timeout=LOAD_TIMEOUT_MS)
    p = asked[-1]["sampling"]
    assert (p.temperature, p.top_p, p.repetition_penalty) == pytest.approx((0.7, 0.9, 1.1))
    assert _done(events).finish_reason in ("stop", "length")


def _record(window) -> list:
    events: list = []
    window.bridge.generation.connect(lambda request, event: events.append(event))
    return events


def _done(events: list) -> DoneEvent | None:
    return next((e for e in events if isinstance(e, DoneEvent)), None)


def _looping(chat) -> None:
    """Greedy with a repetition penalty below 1 (it favours tokens already seen): the tiny random model falls
    into a loop. The spin box offers 1 to 2; the engine takes any penalty above 0."""
    chat.conversation = replace(chat.conversation, sampling=replace(chat.conversation.sampling,
                                                                    repetition_penalty=0.2))


LOOP_PROMPT = "Tell me a story"
LOOP_TOKENS = 200


def test_an_answer_that_loops_is_stopped_and_the_transcript_says_so(qtbot, window, monkeypatch):
    chat = window.chat
    _looping(chat)
    chat.max_tokens.setValue(LOOP_TOKENS)
    events = _record(window)
    assert chat.send(LOOP_PROMPT)                   # Stop loops off (the tests' default): it runs to the end
    qtbot.waitUntil(lambda: _done(events) is not None and not chat.generating, timeout=LOAD_TIMEOUT_MS)
    free = _done(events)
    loop = next((find_loop(free.tokens[: i + 1]) for i in range(len(free.tokens))
                 if find_loop(free.tokens[: i + 1]) is not None), None)
    assert loop is not None, f"the tiny model did not loop in {len(free.tokens)} tokens: {free.text!r}"
    assert chat.loop is None

    chat.new_conversation()
    qtbot.mouseClick(chat.stop_loops, _left())
    assert chat.stop_loops.isChecked()
    events.clear()
    paced(monkeypatch)      # the tiny model would write all 200 tokens before the GUI sees the loop and cancels
    assert chat.send(LOOP_PROMPT)
    qtbot.waitUntil(lambda: _done(events) is not None and not chat.generating, timeout=LOAD_TIMEOUT_MS)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert chat.loop == loop                                     # greedy: the same loop, caught at its first sight
    assert len(_done(events).tokens) <= loop.start + loop.length + 3   # stopped within a few tokens of it
    kept = "".join(e.text for e in tokens[: loop.start + loop.period])
    turn = window.store.load(chat.conversation.id).turns[-1]
    assert turn.content == kept and turn.stats["finish_reason"] == "loop"
    page = chat.transcript.toPlainText()
    assert "stopped because it repeated itself" in page and "stopped: it repeated itself" in page
    assert "Stopped" in chat.status.text()


def test_the_demo_model_says_what_it_is(qtbot, make_window, models, tmp_path):
    from app.config.catalog import DEFAULT_MODEL, DERIVED

    demo = tmp_path / DERIVED[DEFAULT_MODEL].folder       # the demo's folder name, holding the tiny container
    demo.symlink_to(models[1], target_is_directory=True)
    window = make_window(demo)
    chat = window.chat
    assert "demo model" in chat.transcript.note() and "135M" in chat.transcript.note()
    assert "demo" in chat.status.text()
    with qtbot.waitSignal(window.bridge.modelLoaded, timeout=LOAD_TIMEOUT_MS):
        window.open_model(str(models[1]))
    assert chat.transcript.note() == "" and "demo" not in chat.status.text()


def test_a_servers_tokens_seen_only_as_text_are_told_apart_by_their_text():
    """A remote server sends no token ids (all UNKNOWN_TOKEN): the detector compares their text instead."""
    from app.service.remote import UNKNOWN_TOKEN
    from engine.generation.loops import LoopDetector
    from ui.chat import loop_key

    words = [f"word{i} " for i in range(100)]
    detector = LoopDetector()
    assert all(detector.push(loop_key(TokenEvent(i, UNKNOWN_TOKEN, w))) is None for i, w in enumerate(words))
    looping = [detector.push(loop_key(TokenEvent(i, UNKNOWN_TOKEN, "again "))) for i in range(48)]
    assert looping[-1] is not None and looping[-1].period == 1 and looping[-2] is None
    assert loop_key(TokenEvent(0, 17, "x")) == 17
