"""The chat of the desktop app (pytest-qt, offscreen): tokens stream into the transcript, Stop,
Regenerate, system prompt and sampling, conversations that survive a restart, code blocks, and
an event loop that stays responsive while the engine generates."""

from __future__ import annotations

import pytest

from app.conversations import Conversation, Turn
from engine.events import DoneEvent, TokenEvent
from support.qt import *  # noqa: F403 - the GUI fixtures (no_leftovers is autouse)
from support.qt import LOAD_TIMEOUT_MS


class Stream:
    """Records the generation events the bridge delivers."""

    def __init__(self, bridge):
        self.events: list = []
        bridge.generation.connect(lambda request, event: self.events.append(event))

    def tokens(self) -> list[TokenEvent]:
        return [e for e in self.events if isinstance(e, TokenEvent)]

    def done(self) -> DoneEvent | None:
        return next((e for e in self.events if isinstance(e, DoneEvent)), None)


def _answer(qtbot, window, text: str, max_tokens: int = 40) -> DoneEvent:
    chat = window.chat
    chat.max_tokens.setValue(max_tokens)
    stream = Stream(window.bridge)
    chat.input.setPlainText(text)
    qtbot.mouseClick(chat.send_button, _left())
    qtbot.waitUntil(lambda: stream.done() is not None, timeout=LOAD_TIMEOUT_MS)
    qtbot.waitUntil(lambda: not chat.generating)
    return stream.done()


def _left():
    from PySide6.QtCore import Qt

    return Qt.MouseButton.LeftButton


def test_a_question_streams_its_answer_into_the_transcript(qtbot, window):
    chat = window.chat
    assert chat.send_button.isEnabled() is False            # nothing typed yet
    chat.max_tokens.setValue(300)
    stream = Stream(window.bridge)
    chat.input.setPlainText("Hello, tiny model")
    assert chat.send_button.isEnabled()
    states = []
    chat.generatingChanged.connect(states.append)
    qtbot.mouseClick(chat.send_button, _left())
    assert chat.generating and chat.stop_button.isEnabled() and not chat.send_button.isEnabled()
    assert states == [True] and window.inspector._generating
    assert chat.input.toPlainText() == ""
    # text shows up while the answer is still being written
    qtbot.waitUntil(lambda: len(chat.transcript.text) >= 20 and chat.transcript.text[:20]
                    in chat.transcript.toPlainText(), timeout=LOAD_TIMEOUT_MS)
    assert chat.generating
    qtbot.waitUntil(lambda: stream.done() is not None and not chat.generating, timeout=LOAD_TIMEOUT_MS)
    assert states == [True, False] and not window.inspector._generating   # the Brain stops flashing
    done = stream.done()
    assert len(done.tokens) == 300 and done.text
    assert "".join(t.text for t in stream.tokens()) + done.tail == done.text
    page = chat.transcript.toPlainText()
    assert "Hello, tiny model" in page and done.text.strip()[:40] in page
    assert "tok/s" in page and "TTFT" in page and "300 tokens" in page
    assert 0 < chat.transcript.redraws < len(stream.tokens())   # on a timer, not once per token
    turns = window.store.load(chat.conversation.id).turns
    assert [t.role for t in turns] == ["user", "assistant"] and turns[1].content == done.text
    assert turns[1].stats["tokens"] == 300
    assert window.conversations.ids() == [chat.conversation.id]


def test_stop_ends_the_answer_and_keeps_what_was_written(qtbot, window):
    chat = window.chat
    chat.max_tokens.setValue(1900)
    stream = Stream(window.bridge)
    chat.send("Write for a long time")
    qtbot.waitUntil(lambda: len(stream.tokens()) >= 5, timeout=LOAD_TIMEOUT_MS)
    seen = len(stream.tokens())
    qtbot.mouseClick(chat.stop_button, _left())
    qtbot.waitUntil(lambda: stream.done() is not None, timeout=30_000)
    done = stream.done()
    assert done.finish_reason == "cancelled"
    assert seen <= len(done.tokens) < 1900
    assert not chat.generating and chat.send_button.isEnabled() is False and chat.regen_button.isEnabled()
    assert "stopped" in chat.transcript.toPlainText()
    assert window.store.load(chat.conversation.id).turns[-1].stats["finish_reason"] == "cancelled"


def test_regenerate_writes_the_last_answer_again(qtbot, window):
    chat = window.chat
    first = _answer(qtbot, window, "Say something")
    stream = Stream(window.bridge)
    qtbot.mouseClick(chat.regen_button, _left())
    qtbot.waitUntil(lambda: stream.done() is not None and not chat.generating, timeout=LOAD_TIMEOUT_MS)
    assert stream.done().text == first.text                     # greedy: the same answer
    turns = chat.conversation.turns
    assert [t.role for t in turns] == ["user", "assistant"]     # replaced, not appended


def test_system_prompt_and_sampling_reach_the_engine(qtbot, window, monkeypatch):
    chat = window.chat
    asked = []
    generate = window.bridge.service.generate
    monkeypatch.setattr(window.bridge.service, "generate", lambda **kw: asked.append(kw) or generate(**kw))
    chat.system_toggle.setChecked(True)
    chat.system_edit.setPlainText("You are terse.")
    chat.temperature.setValue(0.7)
    chat.top_p.setValue(0.9)
    _answer(qtbot, window, "Hi", max_tokens=7)
    kw = asked[-1]
    assert kw["messages"][0] == {"role": "system", "content": "You are terse."}
    assert kw["sampling"].temperature == pytest.approx(0.7) and kw["sampling"].top_p == pytest.approx(0.9)
    assert kw["max_tokens"] == 7
    saved = window.store.load(chat.conversation.id)
    assert saved.system == "You are terse." and saved.sampling.max_tokens == 7


def test_conversations_survive_a_restart(qtbot, make_window, models, tmp_path):
    first = make_window(models[1])
    done = _answer(qtbot, first, "Remember me")
    conv_id = first.chat.conversation.id
    first.close()
    second = make_window(models[1])
    assert second.conversations.ids() == [conv_id]
    second.conversations.selected.emit(conv_id)
    page = second.chat.transcript.toPlainText()
    assert "Remember me" in page and done.text.strip()[:30] in page
    # a new chat keeps the old one; delete removes it
    second.conversations.newRequested.emit()
    assert second.chat.conversation.id != conv_id and not second.chat.conversation.turns
    second.conversations.deleteRequested.emit(conv_id)
    assert second.conversations.ids() == []


def test_an_answer_keeps_going_into_its_conversation_while_another_is_shown(qtbot, window):
    chat = window.chat
    chat.max_tokens.setValue(1900)
    stream = Stream(window.bridge)
    chat.send("A long answer please")
    asked = chat.conversation.id
    qtbot.waitUntil(lambda: len(stream.tokens()) >= 3, timeout=LOAD_TIMEOUT_MS)
    window.conversations.newRequested.emit()             # look elsewhere meanwhile
    assert chat.conversation.id != asked and "A long answer" not in chat.transcript.toPlainText()
    assert not chat.send_button.isEnabled()              # one answer at a time
    window.conversations.selected.emit(asked)            # and come back: the answer streams on
    qtbot.waitUntil(lambda: chat.transcript.answering and len(chat.transcript.text) > 10, timeout=LOAD_TIMEOUT_MS)
    chat.stop()
    qtbot.waitUntil(lambda: stream.done() is not None and not chat.generating, timeout=30_000)
    done = stream.done()
    assert done.text.strip()[:50] in chat.transcript.toPlainText()
    assert window.store.load(asked).turns[-1].content == done.text


def test_a_theme_change_redraws_the_transcript_in_the_new_colours(qtbot):
    from PySide6.QtGui import QColor, QPalette

    from ui.chat import Transcript
    from ui.theme import chat_colors, palette

    view = Transcript()
    qtbot.addWidget(view)
    view.show_conversation(Conversation.new().with_turn(Turn("user", "hi")))

    def header_color() -> QColor:
        return view.document().begin().begin().fragment().charFormat().foreground().color()

    assert header_color() == chat_colors(view.palette()).user
    view.setPalette(palette(dark=True))
    qtbot.waitUntil(lambda: header_color() == chat_colors(palette(dark=True)).user)
    assert view.palette().color(QPalette.ColorRole.Base).lightness() < 128


def test_code_blocks_render_in_a_fixed_font_on_their_own_background(qtbot):
    from PySide6.QtGui import QTextFormat

    from ui.chat import Transcript

    view = Transcript()
    qtbot.addWidget(view)
    conv = Conversation.new().with_turn(Turn("user", "code please")).with_turn(
        Turn("assistant", "Here:\n\n```python\ndef f(x):\n    return x * 2\n```\n\nDone.", {"tokens": 3}))
    view.show_conversation(conv)
    blocks, block = [], view.document().begin()
    while block.isValid():
        blocks.append(block)
        block = block.next()
    code = [b for b in blocks if "return x * 2" in b.text()]
    assert code, [b.text() for b in blocks]
    fmt = code[0].blockFormat()
    assert fmt.hasProperty(QTextFormat.Property.BlockCodeFence) and fmt.background().style() != 0
    assert code[0].charFormat().fontFixedPitch() or code[0].begin().fragment().charFormat().fontFixedPitch()
    assert "    return x * 2" in view.toPlainText()                # indentation kept, text selectable
    view.selectAll()
    assert "def f(x):" in view.textCursor().selectedText()


@pytest.mark.parametrize("view", ["chat only", "Overview", "Time", "Brain"])
def test_the_event_loop_stays_responsive_during_generation(qtbot, window, view):
    """A 10 ms timer keeps ticking while the engine writes, with the inspector hidden or on one of its tabs:
    its ticks fall between deliveries all along the stream, not only before and after it. (How late they are
    is a speed figure: `colibri bench` measures speed, tests check behaviour.)"""
    from PySide6.QtCore import Qt, QTimer
    from PySide6.QtWidgets import QDockWidget

    if view == "chat only":
        window.findChild(QDockWidget, "dockInspector").hide()
    elif hasattr(window.inspector, "tabs"):
        tabs = window.inspector.tabs
        tabs.setCurrentIndex(next(i for i in range(tabs.count()) if tabs.tabText(i) == view))
    chat = window.chat
    chat.max_tokens.setValue(1500)
    stream = Stream(window.bridge)
    ticks: list[tuple[int, bool]] = []   # per tick: events delivered so far, and whether an answer was being written

    def tick() -> None:
        ticks.append((len(stream.events), chat.generating))

    timer = QTimer()
    timer.setTimerType(Qt.TimerType.PreciseTimer)
    timer.setInterval(10)
    timer.timeout.connect(tick)
    def answers() -> int:
        return sum(isinstance(e, DoneEvent) for e in stream.events)

    chat.send("Keep writing")
    qtbot.waitUntil(lambda: len(stream.tokens()) >= 1, timeout=LOAD_TIMEOUT_MS)   # past the first compile
    timer.start()
    sent = 1
    while True:
        qtbot.waitUntil(lambda: answers() >= sent or len(ticks) >= 400, timeout=LOAD_TIMEOUT_MS)
        if len(ticks) >= 100 or sent >= 8:
            break
        qtbot.waitUntil(lambda: not chat.generating, timeout=30_000)   # the answer ended within a second: another
        chat.send("Keep writing")
        sent += 1
    timer.stop()
    chat.stop()
    qtbot.waitUntil(lambda: not chat.generating, timeout=30_000)
    generated = len(stream.tokens())
    assert len(ticks) >= 100 and generated > 20
    # ticks at many points of the stream: the loop ran the timer between deliveries, again and again
    while_writing = {delivered for delivered, writing in ticks if writing}
    assert len(while_writing) >= 10, f"the timer ticked at only {len(while_writing)} points of {sent} answers"
