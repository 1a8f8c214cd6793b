"""Conversations people can manage (pytest-qt, offscreen): the context-used meter, rename, search, export,
and per-message Copy and Edit (an edit branches the conversation and keeps the old continuation)."""

from __future__ import annotations

from support.qt import *  # noqa: F403 - the GUI fixtures (no_leftovers is autouse)
from support.qt import LOAD_TIMEOUT_MS, ask, click_link
from support.server import paced


def test_the_context_meter_counts_as_the_engine_does_and_warns_when_nearly_full(qtbot, window):
    meter = window.chat.context_meter
    assert meter.total == window.info.settings.context_length and meter.used is None
    assert "Context — / " in meter.label.text()
    done = ask(qtbot, window, "Count the tokens, please")
    first = done.stats.prompt_tokens + done.stats.generated_tokens
    assert meter.used == first and f"Context {first:,} / {meter.total:,}" == meter.label.text()
    assert not meter.warning and "refused" in meter.toolTip()           # overflow "error": the engine refuses
    # a smaller context (the Controls slider) moves the total, and a nearly full context turns the bar amber
    with qtbot.waitSignal(window.bridge.settingsApplied, timeout=30_000):
        window.controls.context.slider.setValue(0)
        window.controls.apply()
    assert meter.total == 256 and meter.used == first
    done = ask(qtbot, window, "And now a longer answer", max_tokens=400)
    used = done.stats.prompt_tokens + done.stats.generated_tokens
    assert used > first and meter.used == used and used > 0.8 * 256
    assert meter.warning and meter.bar.color().name() == "#e69614"
    # the count is kept with the answer: the conversation opened again shows it
    conv = window.chat.conversation
    window.chat.new_conversation()
    assert meter.used is None
    window.conversations.selected.emit(conv.id)
    assert meter.used == used


def test_the_meter_says_what_each_overflow_policy_does_when_the_context_fills(qtbot):
    from ui.context_meter import ContextMeter

    meter = ContextMeter()
    qtbot.addWidget(meter)
    assert meter.label.text() == "Context: no model" and "once a model is open" in meter.toolTip()
    meter.set_total(1024)
    meter.set_used(800)
    assert meter.label.text() == "Context 800 / 1,024" and not meter.warning and "(78%)" in meter.toolTip()
    meter.set_used(900)
    assert meter.warning and meter.bar.color() != meter.palette().color(meter.palette().ColorRole.Highlight)
    for policy, says in (("error", "is refused"), ("slide", "oldest tokens are dropped"),
                         ("retain", "drew the most attention"), (None, "the server decides")):
        meter.set_overflow(policy)
        assert says in meter.toolTip()


def _saved(folder, *conversations):
    """Save conversations into folder (a window's store), newest last."""
    from dataclasses import replace

    from app.conversations import ConversationStore

    store = ConversationStore(folder)
    for i, conv in enumerate(conversations):
        store.save(replace(conv, updated=1000.0 + i))
    return store


def _chat(question: str, answer: str):
    from app.conversations import Conversation, Turn

    return Conversation.new().with_turn(Turn("user", question)).with_turn(Turn("assistant", answer, {"tokens": 3}))


def _type_title(qtbot, window, title: str) -> None:
    """Type into the title editor that is open in the conversation list, then Enter."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QLineEdit

    listing = window.conversations
    qtbot.waitUntil(lambda: listing.editing)
    editor = next(e for e in listing.list.viewport().findChildren(QLineEdit) if e.isVisible())  # not a closed one
    editor.selectAll()
    qtbot.keyClicks(editor, title)
    qtbot.keyClick(editor, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: not listing.editing)


def test_a_double_click_renames_a_conversation_in_place(qtbot, make_window, tmp_path):
    from PySide6.QtCore import Qt

    birds, code = _chat("Tell me about hummingbirds", "They hover."), _chat("Some code", "print(1)")
    store = _saved(tmp_path / "convs", birds, code)
    window = make_window(conversations=tmp_path / "convs")
    listing = window.conversations
    assert listing.ids() == [code.id, birds.id]
    at = listing.list.visualItemRect(listing.item(birds.id)).center()
    qtbot.mouseClick(listing.list.viewport(), Qt.MouseButton.LeftButton, pos=at)    # a double-click's first press
    qtbot.mouseDClick(listing.list.viewport(), Qt.MouseButton.LeftButton, pos=at)   # opens it, then edits its title
    assert window.chat.conversation.id == birds.id
    _type_title(qtbot, window, "  Birds   that hover ")
    assert store.load(birds.id).title == "Birds that hover" == window.chat.conversation.title
    assert listing.item(birds.id).text() == "Birds that hover"
    assert store.load(birds.id).turns == birds.turns and store.load(code.id).title == "Some code"
    # Rename (the context menu's action) on another conversation; an empty title is refused and says why
    listing.rename(code.id)
    _type_title(qtbot, window, "   ")
    assert store.load(code.id).title == "Some code" and listing.item(code.id).text() == "Some code"
    assert "cannot be empty" in window.chat.status.text()


def test_the_search_box_filters_by_title_and_text(qtbot, make_window, tmp_path):
    birds, code = _chat("Tell me about hummingbirds", "They drink nectar."), _chat("Some code", "print(1)")
    _saved(tmp_path / "convs", birds, code)
    window = make_window(conversations=tmp_path / "convs")
    listing = window.conversations
    qtbot.keyClicks(listing.search, "NECTAR")
    assert listing.ids() == [birds.id] and not listing.no_match.isVisible()
    listing.search.clear()
    qtbot.keyClicks(listing.search, "code print")         # a word of the title and one of the text
    assert listing.ids() == [code.id]
    listing.search.setText("penguins")
    assert listing.ids() == [] and listing.no_match.isVisible()
    listing.search.clear()
    assert listing.ids() == [code.id, birds.id] and not listing.no_match.isVisible()


def test_export_writes_the_conversation_where_the_save_dialog_says(qtbot, make_window, tmp_path, monkeypatch):
    import json

    from app.conversations import Conversation

    docs = tmp_path / "Documents"
    docs.mkdir()
    (tmp_path / "xdg").mkdir()
    (tmp_path / "xdg" / "user-dirs.dirs").write_text(f'XDG_DOCUMENTS_DIR="{docs}"\n')
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))    # where Qt finds the documents folder
    birds = _chat("Tell me about hummingbirds", "They drink **nectar**.")
    _saved(tmp_path / "convs", birds)
    window = make_window(conversations=tmp_path / "convs")
    assert window.chat.export_conversation() is None and "Nothing to export" in window.chat.status.text()
    window.conversations.selected.emit(birds.id)
    window.export_action.trigger()                                  # File > Export conversation…
    dialog = window.chat.export_dialog
    assert dialog is not None and dialog.isVisible() and dialog.directory().absolutePath() == str(docs)
    assert dialog.selectedFiles() == [str(docs / "Tell me about hummingbirds.md")]
    with qtbot.waitSignal(dialog.finished):
        dialog.accept()
    md = (docs / "Tell me about hummingbirds.md").read_text(encoding="utf-8")
    assert md.startswith("# Tell me about hummingbirds") and "They drink **nectar**." in md
    assert "Exported" in window.chat.status.text() and window.chat.export_dialog is None
    window.conversations.exportRequested.emit(birds.id)            # the list's Export… action
    dialog = window.chat.export_dialog
    dialog.selectFile(str(docs / "birds.json"))
    with qtbot.waitSignal(dialog.finished):
        dialog.accept()
    saved = json.loads((docs / "birds.json").read_text(encoding="utf-8"))
    assert Conversation.from_json(saved).turns == birds.turns
    assert sorted(p.name for p in docs.iterdir()) == ["Tell me about hummingbirds.md", "birds.json"]   # no temps


def test_copy_and_edit_a_message_branch_and_keep_the_old_continuation(qtbot, window):
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication

    chat = window.chat
    ask(qtbot, window, "First question")
    ask(qtbot, window, "Second question")
    before = chat.conversation
    assert [t.role for t in before.turns] == ["user", "assistant"] * 2
    QGuiApplication.clipboard().clear()
    click_link(qtbot, chat.transcript, "#message-copy-1")              # the first answer's raw Markdown
    assert QGuiApplication.clipboard().text() == before.turns[1].content
    click_link(qtbot, chat.transcript, "#message-copy-2")
    assert QGuiApplication.clipboard().text() == "Second question"
    click_link(qtbot, chat.transcript, "#message-edit-0")              # Escape leaves the edit
    assert chat.editing == 0 and chat.input.toPlainText() == "First question"
    qtbot.keyClick(chat.input, Qt.Key.Key_Escape)
    assert chat.editing is None and chat.input.toPlainText() == "" and not chat.edit_bar.isVisible()
    click_link(qtbot, chat.transcript, "#message-edit-2")
    assert chat.editing == 2 and chat.input.toPlainText() == "Second question" and chat.edit_bar.isVisible()
    done = ask(qtbot, window, "Second question, put another way")
    assert chat.editing is None and not chat.edit_bar.isVisible()
    after = chat.conversation
    assert after.id == before.id and after.turns[:2] == before.turns[:2]
    assert [t.content for t in after.turns[2:]] == ["Second question, put another way", done.text]
    saved = {c.id: c for c in window.store.list()}
    branch = next(c for c in saved.values() if c.id != before.id)
    assert len(saved) == 2 and saved[before.id] == after
    assert branch.title == "First question (branch)" and branch.turns == before.turns     # nothing lost
    page = chat.transcript.toPlainText()
    assert "Second question, put another way" in page and "Second question\n" not in page
    assert window.conversations.ids() == [before.id, branch.id]
    # the edit link of a question while an answer is being written does nothing but say why
    chat.max_tokens.setValue(400)
    chat.input.setPlainText("Third")
    chat.send()
    assert chat.generating and not chat.edit_message(0) and "Wait for the answer" in chat.status.text()
    with qtbot.waitSignal(chat.generatingChanged, timeout=LOAD_TIMEOUT_MS):
        chat.stop()


def test_an_answer_stopped_before_any_text_leaves_no_empty_answer(qtbot, window, monkeypatch):
    from PySide6.QtGui import QGuiApplication

    chat = window.chat
    ask(qtbot, window, "First question")
    paced(monkeypatch, 0.3)             # the engine waits before each step: the stop lands before the first token
    chat.input.setPlainText("Second")
    with qtbot.waitSignal(chat.generatingChanged, check_params_cb=lambda busy: not busy, timeout=LOAD_TIMEOUT_MS):
        chat.send()
        chat.stop()                     # before the engine has read the prompt
    assert [t.role for t in chat.conversation.turns] == ["user", "assistant", "user"]
    page = chat.transcript.toPlainText()
    assert page.count("Assistant") == 1 and "0 tokens · stopped" in page.splitlines()[-1]
    click_link(qtbot, chat.transcript, "#message-copy-2")
    assert QGuiApplication.clipboard().text() == "Second"
