"""The chat: a transcript that streams the answer being written, the input with Send / Stop /
Regenerate, the system prompt and sampling settings, and a stats line under every answer.

Tokens only append to a string; the transcript re-renders the answer from it on a timer at
REDRAW_HZ, so the UI never paints once per token. Conversations are saved (app.conversations)
when a question is sent and when its answer ends. A model's reasoning (sent apart from the answer:
engine.tokenizer.reasoning) shows above its answer as a block that a click on its "Reasoning" line
opens or closes: open while the answer is being written, closed in the answers of the past.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from PySide6.QtCore import QEvent, QObject, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (
    QFont,
    QFontDatabase,
    QKeyEvent,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextFormat,
)
from PySide6.QtWidgets import (
    QDoubleSpinBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QTextBrowser,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.conversations import Conversation, ConversationStore, Sampling, Turn
from app.service.local import ModelInfo
from engine.events import DoneEvent, ErrorEvent, ProgressEvent, TokenEvent
from engine.generation.sampling import SamplingParams
from ui.bridge import Bridge
from ui.theme import chat_colors

log = logging.getLogger(__name__)

REDRAW_HZ = 30      # the streaming answer is re-rendered at most this often
THINKING = "reasoning-"     # the reasoning blocks' link targets: "#reasoning-<turn index>" (LIVE: the answer)
LIVE = -1


def stats_line(stats: dict) -> str:
    """'TTFT 0.21 s · 38.4 tok/s · 64 tokens' (· stopped / · error when it did not end normally)."""
    parts = [f"TTFT {stats.get('ttft_s', 0.0):.2f} s", f"{stats.get('tok_s', 0.0):.1f} tok/s",
             f"{stats.get('tokens', 0)} tokens"]
    reason = stats.get("finish_reason")
    if reason == "cancelled":
        parts.append("stopped")
    elif reason == "length":
        parts.append("max tokens reached")
    if stats.get("model"):
        parts.append(str(stats["model"]))
    return " · ".join(parts)


class Transcript(QTextBrowser):
    """The conversation as a read-only rich-text document; the answer in progress is redrawn on a timer."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setOpenExternalLinks(True)
        self.anchorClicked.connect(self._on_anchor)     # a reasoning block's link opens or closes it
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction
                                     | Qt.TextInteractionFlag.TextSelectableByKeyboard)
        self.document().setDocumentMargin(12)
        self._shown: Conversation | None = None  # the conversation as last rendered whole
        self._answer_start: int | None = None   # document position where the streaming answer begins
        self._text = ""                         # the answer so far
        self._thought = ""                      # the answer's reasoning so far
        self._open: set[int] = set()            # turns (LIVE: the answer) whose reasoning is shown
        self._dirty = False
        self.redraws = 0                        # answer renders (tests check they stay below the token count)
        self._timer = QTimer(self)
        self._timer.setInterval(1000 // REDRAW_HZ)
        self._timer.timeout.connect(self._flush)

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
        for i, turn in enumerate(conv.turns):
            self._header(turn.role)
            if turn.role == "assistant":
                start = None
                if turn.reasoning:
                    cursor = self._end_block()
                    self._insert_reasoning(cursor, turn.reasoning, i)
                    start = cursor.position()
                self._markdown(turn.content, start=start)
                if turn.stats:
                    self._note(stats_line(dict(turn.stats)))
            else:
                self._plain(turn.content)
        self._scroll_to_end()

    def remember(self, conv: Conversation) -> None:
        """conv is what the transcript shows now (turns appended one by one): redraw it on a palette change."""
        self._shown = conv

    def add_user(self, text: str) -> None:
        """Append a question."""
        self._header("user")
        self._plain(text)
        self._scroll_to_end()

    def add_error(self, message: str) -> None:
        """Append an error note."""
        self._note(message, error=True)
        self._scroll_to_end()

    # --- the streaming answer ---

    def begin_answer(self) -> None:
        """Start an assistant turn whose text arrives in pieces."""
        self._header("assistant")
        cursor = self._end_block()
        self._answer_start = cursor.position()
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
        self._text, self._dirty = text, True
        if reasoning is not None:
            self._thought = reasoning
        self._flush()
        self.stop_answer()
        if note:
            self._note(note, error=error)

    def stop_answer(self) -> None:
        """Stop redrawing (the answer stays as drawn)."""
        self._timer.stop()
        self._answer_start = None

    @property
    def text(self) -> str:
        """The streaming answer's text so far."""
        return self._text

    @property
    def reasoning(self) -> str:
        """The streaming answer's reasoning so far."""
        return self._thought

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

    def _on_anchor(self, url: QUrl) -> None:
        if _reasoning_link(url):
            self.toggle_reasoning(int(url.fragment()[len(THINKING):]))

    def doSetSource(self, name: QUrl, type: QTextDocument.ResourceType = QTextDocument.ResourceType.UnknownResource
                    ) -> None:
        """Links are followed as QTextBrowser does, except a reasoning block's (it toggles in place)."""
        if not _reasoning_link(name):
            super().doSetSource(name, type)

    @property
    def answering(self) -> bool:
        """Whether an answer is being streamed in."""
        return self._answer_start is not None

    def _flush(self) -> None:
        if not self._dirty or self._answer_start is None:
            return
        self._dirty = False
        self.redraws += 1
        bar = self.verticalScrollBar()
        follow = bar.value() >= bar.maximum() - 4
        cursor = QTextCursor(self.document())
        cursor.setPosition(self._answer_start)
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        start = self._answer_start
        if self._thought:
            self._insert_reasoning(cursor, self._thought, LIVE)
            start = cursor.position()
        self._markdown(self._text if self._text else ("" if self._thought else "…"), start=start)
        if follow:
            self._scroll_to_end()

    # --- document building ---

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

    def _header(self, role: str) -> None:
        colors = chat_colors(self.palette())
        cursor = self._end_block()
        block = QTextBlockFormat()
        block.setTopMargin(14 if cursor.position() > 0 else 0)
        cursor.setBlockFormat(block)
        fmt = QTextCharFormat()
        fmt.setFontWeight(QFont.Weight.Bold)
        fmt.setForeground(colors.user if role == "user" else colors.assistant)
        cursor.insertText({"user": "You", "assistant": "Assistant", "system": "System"}.get(role, role), fmt)

    def _insert_reasoning(self, cursor: QTextCursor, text: str, key: int) -> None:
        """Reasoning at `cursor` (the end, in an empty block): a "Reasoning" link that opens or closes it, then
        the text, muted, when open; `cursor` ends in a fresh block for the answer."""
        colors = chat_colors(self.palette())
        link = QTextCharFormat()
        link.setAnchor(True)
        link.setAnchorHref(f"#{THINKING}{key}")
        link.setForeground(colors.muted)
        shown = key in self._open
        words = len(text.split())
        cursor.insertText(f"{'▾' if shown else '▸'} Reasoning ({words} word{'' if words == 1 else 's'})", link)
        if shown:
            block = QTextBlockFormat()
            block.setLeftMargin(14)
            body = QTextCharFormat()
            body.setForeground(colors.muted)
            body.setFontItalic(True)
            cursor.insertBlock(block, body)
            cursor.insertText(text, body)
        cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())

    def _plain(self, text: str) -> None:
        cursor = self._end_block()
        cursor.insertText(text)

    def _markdown(self, text: str, start: int | None = None) -> None:
        """Insert markdown at the end (or at `start`, the end too), then give code blocks a background."""
        if start is None:
            start = self._end_block().position()
        cursor = QTextCursor(self.document())
        cursor.setPosition(start)
        cursor.insertMarkdown(text)
        self._style_code(start)

    def _style_code(self, start: int) -> None:
        """Code blocks from `start` on: a fixed-pitch font on a background of their own."""
        colors = chat_colors(self.palette())
        mono = QTextCharFormat()
        mono.setFontFixedPitch(True)
        mono.setFontFamilies([QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont).family()])
        block = self.document().findBlock(start)
        while block.isValid():
            fmt = block.blockFormat()
            if fmt.hasProperty(QTextFormat.Property.BlockCodeFence) or fmt.nonBreakableLines():
                fmt.setBackground(colors.code_background)
                fmt.setLeftMargin(8)
                cursor = QTextCursor(block)
                cursor.setBlockFormat(fmt)
                cursor.movePosition(QTextCursor.MoveOperation.EndOfBlock, QTextCursor.MoveMode.KeepAnchor)
                cursor.mergeCharFormat(mono)
            block = block.next()

    def _note(self, text: str, error: bool = False) -> None:
        colors = chat_colors(self.palette())
        cursor = self._end_block()
        fmt = QTextCharFormat()
        fmt.setForeground(colors.error if error else colors.muted)
        fmt.setFontPointSize(max(7.0, self.font().pointSizeF() * 0.85))
        cursor.insertText(text, fmt)

    def _scroll_to_end(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())


def _reasoning_link(url: QUrl) -> bool:
    return url.isRelative() and url.fragment().startswith(THINKING)


class _SendOnEnter(QObject):
    """Enter sends, Shift+Enter starts a new line, Escape stops the answer."""

    def __init__(self, panel: ChatPanel):
        super().__init__(panel)
        self.panel = panel

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.KeyPress and isinstance(event, QKeyEvent):
            if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
                    event.modifiers() & Qt.KeyboardModifier.ShiftModifier):
                self.panel.send()
                return True
            if event.key() == Qt.Key.Key_Escape and self.panel.generating:
                self.panel.stop()
                return True
        return False


class ChatPanel(QWidget):
    """One conversation at a time: shows it, sends questions through the service, streams the answers."""

    conversationsChanged = Signal()     # a conversation was saved or started (the list refreshes)
    generatingChanged = Signal(bool)    # an answer started (True) or ended, stopped or failed (False)

    def __init__(self, bridge: Bridge, store: ConversationStore, parent: QWidget | None = None):
        super().__init__(parent)
        self.bridge, self.store = bridge, store
        self.info: ModelInfo | None = None
        self.conversation = Conversation.new()
        self._request: int | None = None        # the generation in flight
        self._busy_shown = False                # what generatingChanged last said
        self._answering: Conversation | None = None  # the conversation that answer belongs to
        self._tokens = 0
        self._partial = ""                      # the answer in flight so far (shown or not)
        self._partial_reasoning = ""            # and its reasoning
        self._build()
        bridge.generation.connect(self._on_generation)
        self._show(self.conversation)
        self._update_buttons()

    def _build(self) -> None:
        self.transcript = Transcript()
        self.status = QLabel()
        self.status.setObjectName("chatStatus")
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.system_toggle = QToolButton(text="System prompt", checkable=True)
        self.system_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.system_toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.system_edit = QPlainTextEdit()
        self.system_edit.setPlaceholderText("Instructions the model reads before the conversation (optional)")
        self.system_edit.setMaximumHeight(80)
        self.system_edit.setVisible(False)
        self.system_toggle.toggled.connect(self._toggle_system)

        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=2.0, singleStep=0.1, decimals=2)
        self.temperature.setToolTip("0 is greedy: the likeliest token every time")
        self.top_p = QDoubleSpinBox(minimum=0.05, maximum=1.0, singleStep=0.05, decimals=2)
        self.top_p.setToolTip("nucleus sampling: keep the likeliest tokens holding this much probability (1 is off)")
        self.max_tokens = QSpinBox(minimum=1, maximum=32768, singleStep=64)
        self.max_tokens.setToolTip("the longest answer, in tokens")

        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Ask something (Enter sends, Shift+Enter for a new line)")
        self.input.setMaximumHeight(110)
        self.input.installEventFilter(_SendOnEnter(self))

        self.send_button = QPushButton("Send")
        self.send_button.setDefault(True)
        self.stop_button = QPushButton("Stop")
        self.regen_button = QPushButton("Regenerate")
        self.send_button.clicked.connect(lambda: self.send())
        self.stop_button.clicked.connect(self.stop)
        self.regen_button.clicked.connect(self.regenerate)
        self.input.textChanged.connect(self._update_buttons)

        settings = QHBoxLayout()
        settings.addStretch(1)
        for label, widget in (("Temperature", self.temperature), ("Top-p", self.top_p),
                              ("Max tokens", self.max_tokens)):
            settings.addWidget(QLabel(label))
            settings.addWidget(widget)
        buttons = QHBoxLayout()
        buttons.addWidget(self.system_toggle)
        buttons.addWidget(self.status, 1)
        buttons.addWidget(self.regen_button)
        buttons.addWidget(self.stop_button)
        buttons.addWidget(self.send_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.addWidget(self.transcript, 1)
        layout.addLayout(settings)
        layout.addWidget(self.system_edit)
        layout.addWidget(self.input)
        layout.addLayout(buttons)
        self.status.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)

    # --- what the window calls ---

    def set_model(self, info: ModelInfo | None) -> None:
        """The model answers come from (None: none loaded, nothing can be sent)."""
        self.info = info
        if info is None:
            self._set_status("Open a model to chat (File ▸ Open)")
        elif not info.chat:
            self._set_status(f"{info.name} has no chat template: it cannot chat")
        else:
            self._set_status(f"Ready: {info.name}")
        self._update_buttons()

    def open_conversation(self, conv: Conversation) -> None:
        """Show conv (an answer being written keeps going into its own conversation, not shown)."""
        self._commit_settings()
        self.conversation = conv
        self._show(conv)
        if self._answering is not None and self._answering.id == conv.id:   # back to the answer being written
            self.transcript.begin_answer()
            self.transcript.add_text(self._partial, self._partial_reasoning)
        self._update_buttons()

    def new_conversation(self) -> None:
        """Start an empty conversation that keeps the current system prompt and sampling."""
        self._commit_settings()
        self.conversation = Conversation.new(self.conversation.system, self.conversation.sampling)
        self._show(self.conversation)
        self._update_buttons()
        self.input.setFocus()

    @property
    def generating(self) -> bool:
        """Whether an answer is being written."""
        return self._request is not None

    def send(self, text: str | None = None) -> bool:
        """Send the input's text (or `text`) as a question; False when nothing could be sent."""
        text = (self.input.toPlainText() if text is None else text).strip()
        if not text or not self._can_generate():
            return False
        self._commit_settings()
        self.conversation = self.conversation.with_turn(Turn("user", text))
        self._save(self.conversation)
        self.input.clear()
        self.transcript.add_user(text)
        self._start()
        return True

    def stop(self) -> None:
        """Stop the answer being written (the engine stops before its next token)."""
        if self._request is not None:
            self.bridge.service.cancel(self._request)
            self._set_status("Stopping…")

    def regenerate(self) -> bool:
        """Write the last answer again."""
        if not self._can_generate() or not self.conversation.turns:
            return False
        self._commit_settings()
        self.conversation = self.conversation.without_last_answer()
        if not self.conversation.turns:
            return False
        self._save(self.conversation)
        self._show(self.conversation)
        self._start()
        return True

    def close_views(self) -> None:
        """Stop the redraw timer and any answer in flight (the window is closing)."""
        self.transcript.stop_answer()
        if self._request is not None:
            self.bridge.service.cancel(self._request)
        self._commit_settings()

    # --- generation ---

    def _can_generate(self) -> bool:
        return self.info is not None and self.info.chat and self._request is None

    def _start(self) -> None:
        s = self.conversation.sampling
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, repetition_penalty=s.repetition_penalty)
        self._answering = self.conversation
        self._tokens, self._partial, self._partial_reasoning = 0, "", ""
        self._request = self.bridge.service.generate(messages=self.conversation.messages(), sampling=params,
                                                     max_tokens=s.max_tokens)
        self.transcript.begin_answer()
        self._set_status("Reading the prompt…")
        self._update_buttons()

    def _on_generation(self, request: int, event: object) -> None:
        if request != self._request:
            return
        shown = self._answering is not None and self._answering.id == self.conversation.id
        if isinstance(event, TokenEvent):
            self._tokens += 1
            self._partial += event.text
            self._partial_reasoning += event.reasoning
            if shown:
                self.transcript.add_text(event.text, event.reasoning)
            if self._tokens == 1 or self._tokens % 16 == 0:
                self._set_status(f"Writing… {self._tokens} tokens")
        elif isinstance(event, ProgressEvent):
            self._set_status(f"Reading the prompt: {event.done}/{event.total} tokens")
        elif isinstance(event, DoneEvent):
            self._finish(event, shown)
        elif isinstance(event, ErrorEvent):
            if shown:
                self.transcript.end_answer(self.transcript.text, event.message, error=True)
                self.transcript.remember(self.conversation)
            self._request = self._answering = None
            self._set_status("The answer failed: " + event.message)
            self._update_buttons()

    def _finish(self, done: DoneEvent, shown: bool) -> None:
        s = done.stats
        stats = {"ttft_s": round(s.ttft_s, 4), "tok_s": round(s.decode_tok_s, 2), "tokens": len(done.tokens),
                 "finish_reason": done.finish_reason, "model": self.info.name if self.info else None}
        conv = self._answering
        self._request = self._answering = None
        if conv is not None and (done.text or done.reasoning or done.finish_reason != "cancelled"):
            conv = conv.with_turn(Turn("assistant", done.text, stats, done.reasoning))
            self._save(conv)
            if conv.id == self.conversation.id:
                self.conversation = conv
        if shown and self.transcript.answering:
            self.transcript.end_answer(done.text, stats_line(stats), reasoning=done.reasoning)
            self.transcript.remember(self.conversation)
        elif shown:
            self.transcript.show_conversation(self.conversation)
        self._set_status(("Stopped: " if done.finish_reason == "cancelled" else "Done: ") + stats_line(stats))
        self._update_buttons()

    # --- helpers ---

    def _show(self, conv: Conversation) -> None:
        self.transcript.show_conversation(conv)
        for w in (self.system_edit, self.temperature, self.top_p, self.max_tokens):
            w.blockSignals(True)
        self.system_edit.setPlainText(conv.system)
        self.temperature.setValue(conv.sampling.temperature)
        self.top_p.setValue(conv.sampling.top_p)
        self.max_tokens.setValue(conv.sampling.max_tokens)
        for w in (self.system_edit, self.temperature, self.top_p, self.max_tokens):
            w.blockSignals(False)
        if conv.system and not self.system_toggle.isChecked():
            self.system_toggle.setChecked(True)

    def _commit_settings(self) -> None:
        """Take the system prompt and sampling widgets into the conversation (saved if it was already)."""
        conv = self.conversation
        sampling = Sampling(self.temperature.value(), self.top_p.value(), self.max_tokens.value(),
                            conv.sampling.repetition_penalty)
        system = self.system_edit.toPlainText()
        if sampling != conv.sampling or system != conv.system:
            self.conversation = conv = replace(conv, system=system, sampling=sampling)
            if conv.turns:
                self._save(conv)

    def _save(self, conv: Conversation) -> None:
        try:
            self.store.save(conv)
        except (OSError, ValueError) as exc:
            log.warning("conversation %s not saved: %s", conv.id, exc)
            self._set_status(f"The conversation could not be saved: {exc}")
        self.conversationsChanged.emit()

    def _toggle_system(self, on: bool) -> None:
        self.system_edit.setVisible(on)
        self.system_toggle.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow)

    def _set_status(self, text: str) -> None:
        self.status.setText(text)
        self.status.setToolTip(text)

    def _update_buttons(self) -> None:
        busy = self._request is not None
        if busy != self._busy_shown:
            self._busy_shown = busy
            self.generatingChanged.emit(busy)
        ready = self.info is not None and self.info.chat
        self.send_button.setEnabled(ready and not busy and bool(self.input.toPlainText().strip()))
        self.stop_button.setEnabled(busy)
        self.regen_button.setEnabled(ready and not busy and any(t.role == "user" for t in self.conversation.turns))
        if not ready:
            why = "open a model first" if self.info is None else f"{self.info.name} has no chat template"
            self.send_button.setToolTip(why)
        else:
            self.send_button.setToolTip("send (Enter)")
