"""The transcript: the conversation as a read-only rich-text document, and the answer being written.

Tokens only append to a string; the answer is drawn from it on a timer at REDRAW_HZ, so the UI never paints
once per token. Drawing is incremental: the answer is cut into top-level segments (ui.codeblocks), each
finished segment is drawn once at the end of the document and never parsed again, and only the unfinished
last one is removed and drawn anew, so text already shown does not reflow. Code blocks are highlighted, wrap
their long lines and carry a Copy link; only explicit Markdown links are links.

The view follows new text while it is scrolled to the bottom; scrolled up, it stays where the user left it.
A model's reasoning (sent apart from the answer: engine.tokenizer.reasoning) shows above its answer as a
block that a click on its "Reasoning" line opens or closes: open while the answer is being written, closed in
the answers of the past.

Each message's header carries small links: "copy" puts the message's raw Markdown on the clipboard, on a
question "edit" asks the chat (`editRequested`) to put it back in the input, to send it again as a branch, and
on an answer "regenerate" asks it (`regenerateRequested`) to write that answer again as a branch.
"""

from __future__ import annotations

from PySide6.QtCore import QCoreApplication, QEvent, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (
    QFont,
    QGuiApplication,
    QPainter,
    QPaintEvent,
    QPalette,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextOption,
)
from PySide6.QtWidgets import QTextBrowser, QWidget

from app.conversations import Conversation
from ui.codeblocks import COPY, Segment, insert_code, insert_markdown, split_segments, unwrap_code
from ui.theme import chat_colors

REDRAW_HZ = 30      # the streaming answer is drawn at most this often
THINKING = "reasoning-"     # the reasoning blocks' link targets: "#reasoning-<turn index>" (LIVE: the answer)
LIVE = -1
MESSAGE_COPY = "message-copy-"  # a message's copy link target: "#message-copy-<turn index>"
MESSAGE_EDIT = "message-edit-"  # a question's edit link target: "#message-edit-<turn index>"
MESSAGE_REGENERATE = "message-regenerate-"  # an answer's regenerate link target: "#message-regenerate-<turn index>"
IN_PLACE = (THINKING, COPY, MESSAGE_COPY, MESSAGE_EDIT, MESSAGE_REGENERATE)    # links that act in the transcript, never navigate
FOLLOW_SLACK = 4    # pixels from the bottom that still count as "at the bottom" (the view follows new text)


def stats_line(stats: dict) -> str:
    """'TTFT 0.21 s · 38.4 tok/s · 64 tokens' (· stopped, · max tokens reached, · stopped: it repeated itself)."""
    parts = [f"TTFT {stats.get('ttft_s', 0.0):.2f} s", f"{stats.get('tok_s', 0.0):.1f} tok/s",
             QCoreApplication.translate("Transcript", "{n} tokens").format(n=stats.get("tokens", 0))]
    reason = stats.get("finish_reason")
    if reason == "cancelled":
        parts.append(QCoreApplication.translate("Transcript", "stopped"))
    elif reason == "length":
        parts.append(QCoreApplication.translate("Transcript", "max tokens reached"))
    elif reason == "loop":
        parts.append(QCoreApplication.translate("Transcript", "stopped: it repeated itself"))
    if stats.get("model"):
        parts.append(str(stats["model"]))
    return " · ".join(parts)


class Transcript(QTextBrowser):
    """The conversation as a read-only rich-text document; the answer in progress is drawn on a timer."""

    editRequested = Signal(int)     # a question's turn index: its edit link was clicked
    regenerateRequested = Signal(int)   # an answer's turn index: its regenerate link was clicked

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setOpenExternalLinks(True)
        self.anchorClicked.connect(self._on_anchor)     # reasoning and Copy links act in place
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction
                                     | Qt.TextInteractionFlag.TextSelectableByKeyboard)
        # a long code line or URL wraps anywhere rather than widening the page (no sideways scrolling)
        self.setLineWrapMode(QTextBrowser.LineWrapMode.WidgetWidth)
        self.setWordWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.document().setDocumentMargin(12)
        self._shown: Conversation | None = None  # the conversation as last rendered whole
        self._answer_start: int | None = None   # end of the answer's header: the answer is drawn after it
        self._tail_start = 0                    # end of what is drawn for good: the unfinished part follows
        self._done_chars = 0                    # characters of the answer drawn for good
        self._drawn_reasoning: tuple[str, bool] | None = None   # the reasoning drawn (text, open)
        self._text = ""                         # the answer so far
        self._thought = ""                      # the answer's reasoning so far
        self._open: set[int] = set()            # turns (LIVE: the answer) whose reasoning is shown
        self._codes: dict[int, str] = {}        # code block number -> its code (what Copy copies)
        self._messages: dict[int, str] = {}     # turn index -> its raw text (what a message's copy copies)
        self._answer_index: int | None = None   # the turn index of the answer being written
        self._answer_codes = 0                  # the first code block number of the streaming answer
        self._tail_codes = 0                    # and of its unfinished part
        self._empty_note = ""                   # shown in an empty transcript, wrapped (set_note)
        self._dirty = False
        self.redraws = 0                        # answer draws (tests check they stay below the token count)
        self.segments_drawn = 0                 # segments drawn for good (each once)
        self._timer = QTimer(self)
        self._timer.setInterval(1000 // REDRAW_HZ)
        self._timer.timeout.connect(self._flush)

    # --- the note of an empty transcript ---

    def set_note(self, text: str) -> None:
        """Text shown, wrapped to the width, while the transcript is empty ("" for none). Qt's placeholder text
        draws on one line, cut at the right edge."""
        self._empty_note = text
        self.viewport().update()

    def note(self) -> str:
        """The note shown while the transcript is empty."""
        return self._empty_note

    def paintEvent(self, event: QPaintEvent) -> None:
        super().paintEvent(event)
        if self._empty_note and self.document().isEmpty():
            margin = int(self.document().documentMargin())
            painter = QPainter(self.viewport())
            painter.setPen(self.palette().color(QPalette.ColorRole.PlaceholderText))
            painter.drawText(self.viewport().rect().adjusted(margin, margin, -margin, -margin),
                             int(Qt.AlignmentFlag.AlignTop | Qt.TextFlag.TextWordWrap), self._empty_note)
            painter.end()

    # --- whole turns ---

    def changeEvent(self, event: QEvent) -> None:
        """A new palette (the system went dark or light): draw the turns again in its colours."""
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange and self._shown is not None and not self.answering:
            self.show_conversation(self._shown)

    def show_conversation(self, conv: Conversation) -> None:
        """Render every turn of conv (replacing what was shown)."""
        self.stop_answer()
        self._shown = conv
        self.clear()
        self._codes.clear()
        self._messages.clear()
        for i, turn in enumerate(conv.turns):
            self._messages[i] = turn.content
            self._header(turn.role, i)
            if turn.role == "assistant":
                if turn.reasoning:
                    self._insert_reasoning(turn.reasoning, i)
                for segment in split_segments(turn.content):
                    self._draw(segment, len(self._codes))
                if turn.stats:
                    self._note(stats_line(dict(turn.stats)))
            else:
                self._plain(turn.content)
        self._scroll_to_end()

    def remember(self, conv: Conversation) -> None:
        """conv is what the transcript shows now (turns appended one by one): redraw it on a palette change."""
        self._shown = conv

    def add_user(self, text: str, index: int | None = None) -> None:
        """Append a question (turn `index` of the conversation: its copy and edit links; None: no links)."""
        if index is not None:
            self._messages[index] = text
        self._header("user", index)
        self._plain(text)
        self._scroll_to_end()

    def add_error(self, message: str) -> None:
        """Append an error note."""
        self._note(message, error=True)
        self._scroll_to_end()

    def add_note(self, message: str) -> None:
        """Append a muted note (why an answer ended early), following it if the view was at the bottom."""
        follow = self._at_bottom()
        self._note(message)
        if follow:
            self._scroll_to_end()

    # --- the streaming answer ---

    def begin_answer(self, index: int | None = None) -> None:
        """Start an assistant turn whose text arrives in pieces (turn `index`: its copy link; None: no link)."""
        self._answer_index = index
        self._header("assistant", index)
        self._answer_start = self._tail_start = self._end()
        self._done_chars = 0
        self._answer_codes = self._tail_codes = len(self._codes)
        self._drawn_reasoning = None
        self._text, self._thought, self._dirty = "", "", True
        self._open.add(LIVE)
        self._timer.start()

    def add_text(self, text: str, reasoning: str = "") -> None:
        """Append to the answer and to its reasoning (drawn at the next tick, not now)."""
        if text or reasoning:
            self._text += text
            self._thought += reasoning
            self._dirty = True

    def end_answer(self, text: str, note: str = "", error: bool = False, reasoning: str | None = None) -> None:
        """Draw the final answer (and its reasoning: None keeps what streamed) and its stats line."""
        if self._answer_start is None:
            return
        if not text.startswith(self._text[: self._done_chars]):     # the end took back drawn text: draw it anew
            self._drawn_reasoning = None
        self._text, self._dirty = text, True
        if reasoning is not None:
            self._thought = reasoning
        self._flush(final=True)
        self.stop_answer()
        if note and error:
            self._note(note, error=True)
        elif note:
            self.add_note(note)

    def stop_answer(self) -> None:
        """Stop redrawing (the answer stays as drawn)."""
        self._timer.stop()
        if self._answer_start is not None and self._answer_index is not None:
            self._messages[self._answer_index] = self._text
        self._answer_start = self._answer_index = None

    @property
    def text(self) -> str:
        """The streaming answer's text so far."""
        return self._text

    @property
    def reasoning(self) -> str:
        """The streaming answer's reasoning so far."""
        return self._thought

    @property
    def answering(self) -> bool:
        """Whether an answer is being streamed in."""
        return self._answer_start is not None

    def toggle_reasoning(self, key: int) -> None:
        """Open or close the reasoning of turn `key` (LIVE: of the answer being written). A past turn's block
        changes at once when no answer is being written, else when the conversation is next drawn whole."""
        self._open ^= {key}
        if key == LIVE:
            self._dirty = True
            self._flush()
        elif not self.answering and self._shown is not None:
            bar = self.verticalScrollBar()
            where = bar.value()
            self.show_conversation(self._shown)
            bar.setValue(where)

    def reasoning_open(self, key: int) -> bool:
        """Whether the reasoning of turn `key` (LIVE: of the answer being written) is shown."""
        return key in self._open

    def code(self, number: int) -> str:
        """The code of code block `number` (in the order drawn)."""
        return self._codes[number]

    def copy_code(self, number: int) -> None:
        """Put the code of block `number` on the clipboard (its Copy link)."""
        QGuiApplication.clipboard().setText(self._codes[number])

    def message(self, index: int) -> str:
        """The raw text (Markdown) of turn `index` as shown (the answer being written: so far)."""
        if index == self._answer_index and self.answering:
            return self._text
        return self._messages[index]

    def copy_message(self, index: int) -> None:
        """Put the raw Markdown of turn `index` on the clipboard (its copy link)."""
        QGuiApplication.clipboard().setText(self.message(index))

    def _on_anchor(self, url: QUrl) -> None:
        fragment = url.fragment()
        if _local_link(url, THINKING):
            self.toggle_reasoning(int(fragment[len(THINKING):]))
        elif _local_link(url, COPY):
            self.copy_code(int(fragment[len(COPY):]))
        elif _local_link(url, MESSAGE_COPY):
            self.copy_message(int(fragment[len(MESSAGE_COPY):]))
        elif _local_link(url, MESSAGE_EDIT):
            self.editRequested.emit(int(fragment[len(MESSAGE_EDIT):]))
        elif _local_link(url, MESSAGE_REGENERATE):
            self.regenerateRequested.emit(int(fragment[len(MESSAGE_REGENERATE):]))

    def doSetSource(self, name: QUrl, type: QTextDocument.ResourceType = QTextDocument.ResourceType.UnknownResource
                    ) -> None:
        """Links are followed as QTextBrowser does, except reasoning, copy and edit links (they act in place)."""
        if not any(_local_link(name, prefix) for prefix in IN_PLACE):
            super().doSetSource(name, type)

    def _flush(self, final: bool = False) -> None:
        """Draw what arrived: new finished segments once, then the unfinished rest anew (final: all finished)."""
        if not self._dirty or self._answer_start is None:
            return
        self._dirty = False
        self.redraws += 1
        bar = self.verticalScrollBar()
        follow, where = self._at_bottom(), bar.value()
        reasoning = (self._thought, LIVE in self._open)
        if reasoning != self._drawn_reasoning:     # the reasoning grew or opened: everything after it moves
            self._cut(self._answer_start)
            if self._thought:
                self._insert_reasoning(self._thought, LIVE)
            self._drawn_reasoning = reasoning
            self._tail_start, self._done_chars, self._tail_codes = self._end(), 0, self._answer_codes
        self._cut(self._tail_start)
        self._codes = {k: v for k, v in self._codes.items() if k < self._tail_codes}   # the tail's go with it
        segments = split_segments(self._text[self._done_chars:])
        finished = segments if final else segments[:-1]
        for segment in finished:
            self._draw(segment, len(self._codes))
            self._done_chars += len(segment.source)
            self.segments_drawn += 1
        self._tail_start, self._tail_codes = self._end(), len(self._codes)
        if not final:
            if len(segments) > len(finished):
                self._draw(segments[-1], len(self._codes))
            elif not self._text and not self._thought:
                self._plain("…")
        if follow:
            self._scroll_to_end()
        else:       # the user scrolled up to read: the edit below must not move the view
            bar.setValue(where)

    # --- document building ---

    def _end(self) -> int:
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        return cursor.position()

    def _cut(self, position: int) -> None:
        """Remove everything after position (the end of a block: that block keeps its format)."""
        cursor = QTextCursor(self.document())
        cursor.setPosition(position)
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()

    def _end_block(self) -> QTextCursor:
        """A cursor at the end, in a fresh block with neutral formats (markdown leaves its own behind)."""
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        if cursor.position() > 0:
            cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
        else:
            cursor.setBlockFormat(QTextBlockFormat())
            cursor.setCharFormat(QTextCharFormat())
        return cursor

    def _draw(self, segment: Segment, number: int) -> None:
        """One segment at the end: Markdown, or a code block numbered `number` (its Copy link's target)."""
        if segment.kind == "markdown" and not segment.source.strip():
            return      # the blank lines after a code block: Markdown would make empty paragraphs of them
        cursor = self._end_block()
        if segment.kind == "code":
            self._codes[number] = segment.code
            dark = self.palette().color(QPalette.ColorRole.Window).lightness() < 128
            insert_code(cursor, segment.code, segment.language, number, chat_colors(self.palette()), dark)
            return
        start = cursor.position()
        insert_markdown(cursor, segment.source)
        unwrap_code(self.document(), start, chat_colors(self.palette()))

    def _header(self, role: str, index: int | None = None) -> None:
        """The speaker's name, then (for turn `index`) its copy link and, on a question, its edit link."""
        colors = chat_colors(self.palette())
        cursor = self._end_block()
        block = QTextBlockFormat()
        block.setTopMargin(14 if cursor.position() > 0 else 0)
        cursor.setBlockFormat(block)
        fmt = QTextCharFormat()
        fmt.setFontWeight(QFont.Weight.Bold)
        fmt.setForeground(colors.user if role == "user" else colors.assistant)
        names = {"user": self.tr("You"), "assistant": self.tr("Assistant"), "system": self.tr("System")}
        cursor.insertText(names.get(role, role), fmt)
        if index is None:
            return
        # lower case and muted: they stay out of the way of the message, and apart from a code block's "Copy"
        links = [(self.tr("copy"), MESSAGE_COPY, self.tr("copy this message's text (Markdown)"))]
        if role == "user":
            links.append((self.tr("edit"), MESSAGE_EDIT, self.tr("edit this question and send it again as a branch "
                                                                 "(the conversation after it is kept as a copy)")))
        elif role == "assistant":
            links.append((self.tr("regenerate"), MESSAGE_REGENERATE,
                          self.tr("write this answer again as a branch (the conversation from here is kept as a copy)")))
        plain = QTextCharFormat()
        plain.setForeground(colors.muted)
        plain.setFontPointSize(max(7.0, self.font().pointSizeF() * 0.85))
        for i, (label, prefix, tip) in enumerate(links):
            cursor.insertText("   " if i == 0 else " · ", plain)
            link = QTextCharFormat(plain)
            link.setAnchor(True)
            link.setAnchorHref(f"#{prefix}{index}")
            link.setToolTip(tip)
            cursor.insertText(label, link)

    def _insert_reasoning(self, text: str, key: int) -> None:
        """Reasoning at the end: a "Reasoning" link that opens or closes it, then the text, muted, when open."""
        colors = chat_colors(self.palette())
        cursor = self._end_block()
        link = QTextCharFormat()
        link.setAnchor(True)
        link.setAnchorHref(f"#{THINKING}{key}")
        link.setForeground(colors.muted)
        shown = key in self._open
        words = len(text.split())
        title = self.tr("Reasoning ({n} word)") if words == 1 else self.tr("Reasoning ({n} words)")
        cursor.insertText(f"{'▾' if shown else '▸'} {title.format(n=words)}", link)
        if shown:
            block = QTextBlockFormat()
            block.setLeftMargin(14)
            body = QTextCharFormat()
            body.setForeground(colors.muted)
            body.setFontItalic(True)
            cursor.insertBlock(block, body)
            cursor.insertText(text, body)

    def _plain(self, text: str) -> None:
        cursor = self._end_block()
        cursor.insertText(text)

    def _note(self, text: str, error: bool = False) -> None:
        colors = chat_colors(self.palette())
        cursor = self._end_block()
        fmt = QTextCharFormat()
        fmt.setForeground(colors.error if error else colors.muted)
        fmt.setFontPointSize(max(7.0, self.font().pointSizeF() * 0.85))
        cursor.insertText(text, fmt)

    def _at_bottom(self) -> bool:
        bar = self.verticalScrollBar()
        return bar.value() >= bar.maximum() - FOLLOW_SLACK

    def _scroll_to_end(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())


def _local_link(url: QUrl, prefix: str) -> bool:
    return url.isRelative() and url.fragment().startswith(prefix)
