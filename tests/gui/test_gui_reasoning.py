"""The chat shows a model's reasoning apart from its answer, in a block a click opens or closes (pytest-qt,
offscreen), and hands it back to the template with the history."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.conversations import Conversation, Turn
from engine.events import DoneEvent
from support.qt import *  # noqa: F403 - the GUI fixtures (no_leftovers is autouse)
from support.qt import LOAD_TIMEOUT_MS
from support.reasoning_chat import ANSWER_TOKENS, MESSAGES, thinking_model


def _click_link(qtbot, view, label: str) -> None:
    """A real mouse click on the first character of the link text `label`."""
    from PySide6.QtCore import QPoint, Qt
    from PySide6.QtGui import QTextCursor

    at = view.toPlainText().index(label)
    cursor = QTextCursor(view.document())
    cursor.setPosition(at + 2)
    view.ensureCursorVisible()
    point = view.cursorRect(cursor).center() + QPoint(1, 0)
    qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, pos=point)


def test_the_reasoning_streams_in_its_own_block_that_a_click_closes(qtbot):
    from ui.chat import LIVE, Transcript

    view = Transcript()
    qtbot.addWidget(view)
    view.resize(600, 400)
    view.show()
    view.show_conversation(Conversation.new().with_turn(Turn("user", "2+2?")))
    view.begin_answer()
    view.add_text("", "The user adds two and two.")
    qtbot.waitUntil(lambda: "The user adds two and two." in view.toPlainText())
    assert "▾ Reasoning (6 words)" in view.toPlainText() and view.reasoning_open(LIVE)
    view.add_text("It is **4**.")
    qtbot.waitUntil(lambda: "It is 4." in view.toPlainText())
    _click_link(qtbot, view, "▾ Reasoning")
    qtbot.waitUntil(lambda: not view.reasoning_open(LIVE))
    page = view.toPlainText()
    assert "▸ Reasoning (6 words)" in page and "adds two" not in page and "It is 4." in page
    view.end_answer("It is **4**.", "done")
    assert "It is 4." in view.toPlainText()


def test_past_answers_show_their_reasoning_closed_until_clicked(qtbot):
    from ui.chat import Transcript

    view = Transcript()
    qtbot.addWidget(view)
    view.resize(600, 400)
    view.show()
    conv = Conversation.new().with_turn(Turn("user", "2+2?")).with_turn(
        Turn("assistant", "It is 4.", {"tokens": 5}, "Two and two make four."))
    view.show_conversation(conv)
    page = view.toPlainText()
    assert "▸ Reasoning (5 words)" in page and "make four" not in page
    assert page.index("Reasoning") < page.index("It is 4.")
    _click_link(qtbot, view, "▸ Reasoning")
    qtbot.waitUntil(lambda: "Two and two make four." in view.toPlainText())
    assert view.reasoning_open(1)


def test_web_links_in_an_answer_still_open(qtbot):
    """The reasoning links toggle in place; an answer's web link still goes to the system's browser."""
    from PySide6.QtCore import QObject, QUrl, Slot
    from PySide6.QtGui import QDesktopServices

    from ui.chat import Transcript

    class Opened(QObject):
        def __init__(self):
            super().__init__()
            self.urls: list[str] = []

        @Slot(QUrl)
        def open(self, url: QUrl) -> None:
            self.urls.append(url.toString())

    opened = Opened()
    QDesktopServices.setUrlHandler("https", opened, "open")
    try:
        view = Transcript()
        qtbot.addWidget(view)
        view.resize(600, 400)
        view.show()
        view.show_conversation(Conversation.new().with_turn(Turn("user", "q")).with_turn(
            Turn("assistant", "see [the site](https://example.org/x)", {"tokens": 1}, "one")))
        _click_link(qtbot, view, "▸ Reasoning (1 word)")
        qtbot.waitUntil(lambda: view.reasoning_open(1))
        _click_link(qtbot, view, "the site")
        qtbot.waitUntil(lambda: opened.urls == ["https://example.org/x"])
        assert "one\nsee the site" in view.toPlainText()
    finally:
        QDesktopServices.unsetUrlHandler("https")


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    return thinking_model(tmp_path_factory.mktemp("thinking"))


def test_a_thinking_model_answers_with_its_reasoning_apart(qtbot, make_window, thinking):
    window = make_window(thinking.folder)
    chat = window.chat
    chat.conversation = replace(chat.conversation, sampling=replace(chat.conversation.sampling,
                                                                     repetition_penalty=1.0))
    chat.max_tokens.setValue(ANSWER_TOKENS)
    chat.temperature.setValue(0.0)
    events: list = []
    window.bridge.generation.connect(lambda request, event: events.append(event))
    assert chat.send(MESSAGES[0]["content"])
    qtbot.waitUntil(lambda: any(isinstance(e, DoneEvent) for e in events) and not chat.generating,
                    timeout=LOAD_TIMEOUT_MS)
    done = next(e for e in events if isinstance(e, DoneEvent))
    assert (done.reasoning, done.text) == (thinking.reasoning, thinking.content)
    turn = window.store.load(chat.conversation.id).turns[-1]
    assert (turn.reasoning, turn.content) == (thinking.reasoning, thinking.content)
    page = chat.transcript.toPlainText()
    assert "Reasoning (" in page and "<think>" not in page
    # the next question hands the reasoning back to the template
    assert chat.conversation.messages()[-1]["reasoning_content"] == thinking.reasoning
