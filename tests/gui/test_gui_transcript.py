"""The transcript reads well (pytest-qt, offscreen): code blocks highlighted with a Copy link and wrapping lines,
only explicit links clickable, Markdown's first block keeping its format, a streaming answer drawn without
touching what is finished, and a view that follows new text unless the user scrolled up."""

from __future__ import annotations

import pytest

from app.conversations import Conversation, Turn
from support.qt import *  # noqa: F403 - the GUI fixtures (no_leftovers is autouse)

CODE = "def twice(x):\n    # doubles\n    return x * 2  # the answer\n\nprint(twice(21))"


@pytest.fixture
def view(qtbot):
    from ui.transcript import Transcript

    v = Transcript()
    qtbot.addWidget(v)
    v.resize(520, 360)
    v.show()
    qtbot.waitExposed(v)
    return v


def answer(content: str) -> Conversation:
    return Conversation.new().with_turn(Turn("user", "q")).with_turn(Turn("assistant", content, {"tokens": 1}))


def blocks(view) -> list:
    out, block = [], view.document().begin()
    while block.isValid():
        out.append(block)
        block = block.next()
    return out


def anchors(view) -> list[tuple[str, str]]:
    """(text, href) of every link in the document."""
    found = []
    for block in blocks(view):
        it = block.begin()
        while not it.atEnd():
            fmt = it.fragment().charFormat()
            if fmt.isAnchor():
                found.append((it.fragment().text(), fmt.anchorHref()))
            it += 1
    return found


def click_text(qtbot, view, text: str) -> None:
    """A real mouse click in the middle of the first occurrence of text."""
    from PySide6.QtCore import QPoint, Qt
    from PySide6.QtGui import QTextCursor

    cursor = QTextCursor(view.document())
    cursor.setPosition(view.toPlainText().index(text) + len(text) // 2)
    view.setTextCursor(cursor)
    view.ensureCursorVisible()
    qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, pos=view.cursorRect(cursor).center() + QPoint(1, 0))


def test_code_is_highlighted_and_its_copy_link_copies_it(qtbot, view):
    from PySide6.QtGui import QGuiApplication, QTextFormat

    view.show_conversation(answer(f"Here:\n\n```python\n{CODE}\n```\n\nDone."))
    code = [b for b in blocks(view) if b.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence)]
    assert "\n".join(b.text() for b in code) == CODE
    colours = {it.fragment().charFormat().foreground().color().name() for b in code for it in _fragments(b)}
    assert len(colours) >= 3, colours                   # keywords, comments, numbers: not one colour
    assert all(it.fragment().charFormat().fontFixedPitch() for b in code for it in _fragments(b))
    assert ("Copy", "#copy-0") in anchors(view)
    QGuiApplication.clipboard().clear()
    click_text(qtbot, view, "Copy")
    qtbot.waitUntil(lambda: QGuiApplication.clipboard().text() == CODE)
    page = view.toPlainText()
    assert "python   Copy\n" + CODE + "\nDone." in page           # no empty paragraphs around the block


def test_each_code_block_copies_its_own_code(qtbot, view):
    from PySide6.QtGui import QGuiApplication

    view.show_conversation(answer("```sh\nls -l\n```\n\nand\n\n```\nplain text\n```"))
    assert [href for text, href in anchors(view) if text == "Copy"] == ["#copy-0", "#copy-1"]
    assert (view.code(0), view.code(1)) == ("ls -l", "plain text")
    view.copy_code(1)
    assert QGuiApplication.clipboard().text() == "plain text"


def test_a_long_code_line_wraps_inside_its_block(qtbot, view):
    long_line = "x = [" + ", ".join(str(i) for i in range(400)) + "]"
    very_long_word = "y" * 600
    view.show_conversation(answer(f"```python\n{long_line}\n{very_long_word}\n```\n\n    indented {very_long_word}"))
    qtbot.waitUntil(lambda: view.document().size().width() <= view.viewport().width() + 1)
    assert view.horizontalScrollBar().maximum() == 0
    wrapped = [b for b in blocks(view) if b.text() in (long_line, very_long_word) or very_long_word in b.text()]
    assert len(wrapped) == 3 and all(b.layout().lineCount() > 1 for b in wrapped)


def test_only_explicit_links_are_links(view):
    view.show_conversation(answer("See http://invented.example/page, www.made-up.example and "
                                  "[the docs](https://example.org/docs) or <https://example.org/auto>."))
    links = [(text, href) for text, href in anchors(view) if not href.startswith("#message-")]  # copy, edit
    assert links == [("the docs", "https://example.org/docs"),
                     ("https://example.org/auto", "https://example.org/auto")]
    assert "http://invented.example/page" in view.toPlainText()


@pytest.mark.parametrize("streamed", [False, True])
def test_the_first_block_keeps_its_format(qtbot, view, streamed):
    content = "# Title\n\nText.\n\n- one\n- two\n\n> quoted\n\n1. first\n2. second"
    if streamed:
        view.show_conversation(Conversation.new().with_turn(Turn("user", "q")))
        view.begin_answer(1)                            # turn 1: its header carries a copy link
        view.end_answer(content)
    else:
        view.show_conversation(answer(content))
    by_text = {b.text(): b for b in blocks(view)}
    assert by_text["Title"].blockFormat().headingLevel() == 1
    assert by_text["one"].textList() is not None and by_text["one"].textList() == by_text["two"].textList()
    assert by_text["quoted"].blockFormat().intProperty(_quote_level()) == 1
    assert by_text["first"].textList() is not None
    page = view.toPlainText()
    assert "Assistant   copy · regenerate\nTitle\nText.\none\ntwo\nquoted\nfirst\nsecond" in page   # no stray empty blocks


def test_a_streaming_answer_never_redraws_what_is_finished(qtbot, view):
    view.show_conversation(Conversation.new().with_turn(Turn("user", "q")))
    changes: list[int] = []
    view.document().contentsChange.connect(lambda pos, removed, added: changes.append(pos))
    view.begin_answer()
    first = "# Plan\n\nFirst a paragraph with **bold** text.\n\n"
    for piece in (first[:10], first[10:]):
        view.add_text(piece)
        qtbot.waitUntil(lambda: not view._dirty)
    view.add_text("```python\nprint(1)\n```\n\nThen")
    qtbot.waitUntil(lambda: "Then" in view.toPlainText())
    finished = view.toPlainText().index("Then")           # heading, paragraph and code are drawn for good
    drawn = view.segments_drawn
    changes.clear()
    for word in (" more", " words", " arrive,", " one", " by", " one."):
        view.add_text(word)
        qtbot.waitUntil(lambda: not view._dirty)
    assert "Then more words arrive, one by one." in view.toPlainText()
    assert changes and min(changes) >= finished - 1       # only the unfinished paragraph was touched
    assert view.segments_drawn == drawn
    view.end_answer(view.text, "stats")
    assert view.toPlainText().index("Then") == finished and view.segments_drawn == drawn + 1


def test_an_unfinished_code_block_streams_as_code(qtbot, view):
    from PySide6.QtGui import QTextFormat

    view.show_conversation(Conversation.new().with_turn(Turn("user", "q")))
    view.begin_answer()
    view.add_text("```python\nfor i in range(3):\n    print(i")
    qtbot.waitUntil(lambda: "print(i" in view.toPlainText())
    code = [b for b in blocks(view) if b.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence)]
    assert [b.text() for b in code] == ["for i in range(3):", "    print(i"]
    view.end_answer(view.text + ")\n```")
    assert view.code(0) == "for i in range(3):\n    print(i)"


def test_the_view_follows_new_text_unless_scrolled_up(qtbot, view):
    view.show_conversation(Conversation.new().with_turn(Turn("user", "q")))
    bar = view.verticalScrollBar()
    view.begin_answer()
    for i in range(40):
        view.add_text(f"Line {i} of a long answer.\n\n")
    qtbot.waitUntil(lambda: "Line 39" in view.toPlainText())
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())      # it followed
    bar.setValue(bar.maximum() // 2)                                                  # the user scrolls up to read
    where = bar.value()
    for i in range(40, 80):
        view.add_text(f"Line {i} of a long answer.\n\n")
    qtbot.waitUntil(lambda: "Line 79" in view.toPlainText())
    assert bar.value() == where and bar.maximum() > where                           # neither followed nor jumped
    bar.setValue(bar.maximum())                                                       # back at the bottom
    view.add_text("The end.")
    qtbot.waitUntil(lambda: "The end." in view.toPlainText())
    qtbot.waitUntil(lambda: bar.value() == bar.maximum())
    view.end_answer(view.text, "stats")
    assert bar.value() == bar.maximum() > 0


def _fragments(block):
    it = block.begin()
    while not it.atEnd():
        yield it
        it += 1


def _quote_level():
    from PySide6.QtGui import QTextFormat

    return QTextFormat.Property.BlockQuoteLevel


def test_a_list_streams_from_its_first_item_and_the_view_follows(qtbot, view):
    # a fresh clone's first essay raised "Internal C++ object (QTextList) already deleted" at each flush while its
    # list had one item, and the view stopped following the answer
    view.show_conversation(Conversation.new().with_turn(Turn("user", "q")))
    bar = view.verticalScrollBar()
    view.begin_answer()
    view.add_text("".join(f"Line {i} of a long answer.\n\n" for i in range(30)))
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())
    for piece in ("- A paragraph", " of at least four sentences", "\n- The word"):
        view.add_text(piece)
        qtbot.waitUntil(lambda: not view._dirty)
        qtbot.waitUntil(lambda: bar.value() == bar.maximum())                      # it kept following
    by_text = {b.text(): b for b in blocks(view)}
    first = by_text["A paragraph of at least four sentences"]
    assert first.textList() is not None and first.textList() == by_text["The word"].textList()
    view.end_answer(view.text, "stats")


def test_the_note_of_an_empty_transcript_wraps_to_its_width(view):
    # Qt's placeholder text drew the demo model's note on one line, cut at the right edge
    import numpy as np
    from PySide6.QtGui import QFontMetrics

    view.resize(320, 300)
    view.set_note("This is the demo model: a small model upcycled into experts to show them streaming from disk. "
                  "Expect simple answers.")
    image = view.viewport().grab().toImage()
    pixels = np.array([[image.pixelColor(x, y).lightness() for x in range(image.width())]
                       for y in range(image.height())])
    inked = np.flatnonzero((pixels < pixels.max() - 40).any(axis=1))      # rows where the note left ink
    assert inked.size and inked[-1] - inked[0] > 2.5 * QFontMetrics(view.font()).height()   # three lines or more
    view.set_note("")
    view.show_conversation(answer("Hello."))
    assert view.note() == "" and "Hello." in view.toPlainText()
