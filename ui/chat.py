"""The chat: a transcript that streams the answer being written (ui.transcript), the input with Send / Stop /
Regenerate, the system prompt and sampling settings, and a stats line under every answer.

Conversations are saved (app.conversations) when a question is sent and when its answer ends. A new
conversation starts with the app's sampling defaults (`ChatDefaults`: temperature 0.7, top-p 0.9, a mild
repetition penalty, as suits small models), which the user's last choices replace, kept in QSettings; Greedy
(temperature 0) is one click away, and presets (ui.presets) fill the system prompt and sampling at once. The
drafting choice (ui.chat_options) asks the engine to draft each answer by prompt lookup or the model's MTP head,
which changes its speed, never its tokens. With "Stop loops" on, each token goes through a loop detector
(engine.generation.loops): an answer that starts repeating itself is stopped, cut to one copy of its loop, and
the transcript says why. The default demo model (`smollm2-moe`, a 135 M model upcycled to show streaming)
is named as such in the empty transcript, so users expect its quality.

A context meter (ui.context_meter) shows the tokens the conversation takes of the context in force, as the engine
counted them (each answer keeps its count, `context_tokens`). A question's edit link puts it back in the input;
sending it branches (`Conversation.branched`): the conversation goes on from the edited question and the old
continuation is saved apart as "<title> (branch)". An answer's regenerate link branches the same way
(`Conversation.regenerated`): the conversation goes on from that answer's question with a new answer. Conversations
are renamed and exported here too.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from PySide6.QtCore import QCoreApplication, QEvent, QObject, QSettings, Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QCheckBox,
    QDoubleSpinBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.conversations import EXPORTS, Conversation, ConversationStore, Sampling, Turn, export
from app.service.local import ModelInfo, SettingsApplied
from engine.events import DoneEvent, ErrorEvent, ProgressEvent, TokenEvent
from engine.generation.loops import Loop, LoopDetector
from engine.generation.sampling import SamplingParams
from ui.bridge import Bridge
from ui.chat_options import DEMO_NOTE, ChatDefaults, DraftingChoice, is_demo, loop_key
from ui.context_meter import ContextMeter
from ui.conversation_list import export_dialog
from ui.presets import Preset, PresetPicker, PresetStore, presets_path
from ui.transcript import LIVE, REDRAW_HZ, THINKING, Transcript, stats_line
from ui.widgets import ElidedLabel

__all__ = ["ChatDefaults", "ChatPanel", "LIVE", "REDRAW_HZ", "THINKING", "Transcript", "is_demo", "loop_key",
           "stats_line"]

log = logging.getLogger(__name__)

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
            if event.key() == Qt.Key.Key_Escape and self.panel.editing is not None:
                self.panel.cancel_edit()
                return True
        return False


class ChatPanel(QWidget):
    """One conversation at a time: shows it, sends questions through the service, streams the answers."""

    conversationsChanged = Signal()     # a conversation was saved or started (the list refreshes)
    generatingChanged = Signal(bool)    # an answer started (True) or ended, stopped or failed (False)

    def __init__(self, bridge: Bridge, store: ConversationStore, parent: QWidget | None = None,
                 settings: QSettings | None = None, overflow: str | None = "error", remote: str | None = None):
        """overflow: the KV overflow policy the engine runs with ("error", "slide", "retain"; None: a server's);
        remote: the URL of the server that answers, if one does."""
        super().__init__(parent)
        self.bridge, self.store, self.settings, self.remote = bridge, store, settings, remote
        self.presets = PresetStore(presets_path(settings) if settings is not None else None)
        self.info: ModelInfo | None = None
        self.defaults = ChatDefaults.load(settings)
        self.conversation = Conversation.new(sampling=self.defaults.sampling())
        self._loops: LoopDetector | None = None  # watching the answer in flight (Stop loops on)
        self.loop: Loop | None = None           # the loop that stopped the last answer, if one did
        self._pieces: list[tuple[str, str]] = []  # per token of the answer in flight: (text, reasoning)
        self._request: int | None = None        # the generation in flight
        self._busy_shown = False                # what generatingChanged last said
        self._answering: Conversation | None = None  # the conversation that answer belongs to
        self._tokens = 0
        self._partial = ""                      # the answer in flight so far (shown or not)
        self._partial_reasoning = ""            # and its reasoning
        self._prompt_tokens = 0                 # the prompt of the answer in flight, as the engine counted it
        self.editing: int | None = None         # the question being edited (its turn index), if one is
        self.export_dialog: QFileDialog | None = None   # the export's save dialog, while open
        self._applying = False                  # a preset is filling the fields
        self._build()
        self.context_meter.set_overflow(overflow)
        bridge.generation.connect(self._on_generation)
        bridge.settingsApplied.connect(self._on_settings)
        self._show(self.conversation)
        self._update_buttons()

    def _build(self) -> None:
        self.transcript = Transcript()
        self.transcript.editRequested.connect(self.edit_message)
        self.transcript.regenerateRequested.connect(self.regenerate_at)
        self.edit_note = QLabel()
        self.edit_note.setWordWrap(True)
        self.edit_cancel = QPushButton(self.tr("Cancel edit"))
        self.edit_cancel.clicked.connect(self.cancel_edit)
        self.edit_bar = QWidget()
        edit_row = QHBoxLayout(self.edit_bar)
        edit_row.setContentsMargins(0, 0, 0, 0)
        edit_row.addWidget(self.edit_note, 1)
        edit_row.addWidget(self.edit_cancel)
        self.edit_bar.hide()
        self.context_meter = ContextMeter()
        # a line of its own under the buttons, elided (the whole text in its tooltip): wrapped, a long status broke
        # the model's name and pushed the input up a line
        self.status = ElidedLabel()
        self.status.setObjectName("chatStatus")

        self.system_toggle = QToolButton(text=self.tr("System prompt"), checkable=True)
        self.system_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.system_toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.system_edit = QPlainTextEdit()
        self.system_edit.setPlaceholderText(self.tr("Instructions the model reads before the conversation (optional)"))
        self.system_edit.setMaximumHeight(80)
        self.system_edit.setVisible(False)
        self.system_toggle.toggled.connect(self._toggle_system)

        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=2.0, singleStep=0.1, decimals=2)
        self.temperature.setToolTip(self.tr("how freely tokens are chosen; 0 is greedy: the likeliest token every "
                                            "time"))
        self.greedy = QCheckBox(self.tr("Greedy"))
        self.greedy.setToolTip(self.tr("always the likeliest token (temperature 0): the same answer every time"))
        self.top_p = QDoubleSpinBox(minimum=0.05, maximum=1.0, singleStep=0.05, decimals=2)
        self.top_p.setToolTip(self.tr("nucleus sampling: keep the likeliest tokens holding this much probability "
                                      "(1 is off)"))
        self.repeat_penalty = QDoubleSpinBox(minimum=1.0, maximum=2.0, singleStep=0.05, decimals=2)
        self.repeat_penalty.setToolTip(self.tr("makes tokens already in the conversation less likely (1 is off; "
                                               "small models repeat themselves less at 1.1)"))
        self.max_tokens = QSpinBox(minimum=1, maximum=32768, singleStep=64)
        self.max_tokens.setToolTip(self.tr("the longest answer, in tokens"))
        self.stop_loops = QCheckBox(self.tr("Stop loops"))
        self.stop_loops.setToolTip(self.tr("stop an answer that starts repeating itself, and say so"))
        self.stop_loops.setChecked(self.defaults.stop_loops)
        self.temperature.valueChanged.connect(self._temperature_changed)
        self.greedy.toggled.connect(self._greedy_toggled)
        self.top_p.valueChanged.connect(lambda _v: self._keep_defaults())
        self.repeat_penalty.valueChanged.connect(self._penalty_changed)
        self.stop_loops.toggled.connect(lambda _on: self._keep_defaults())
        self.preset_picker = PresetPicker(self.presets, self.current_preset)
        self.preset_picker.chosen.connect(self.apply_preset)
        self.preset_picker.problem.connect(self._set_status)
        self.drafting = DraftingChoice()
        self.system_edit.textChanged.connect(self._show_preset)

        self.input = QPlainTextEdit()
        self.input.setPlaceholderText(self.tr("Ask something (Enter sends, Shift+Enter for a new line)"))
        self.input.setMaximumHeight(110)
        self.input.installEventFilter(_SendOnEnter(self))

        self.send_button = QPushButton(self.tr("Send"))
        self.send_button.setDefault(True)
        self.stop_button = QPushButton(self.tr("Stop"))
        self.regen_button = QPushButton(self.tr("Regenerate"))
        self.send_button.clicked.connect(lambda: self.send())
        self.stop_button.clicked.connect(self.stop)
        self.regen_button.clicked.connect(self.regenerate)
        self.input.textChanged.connect(self._update_buttons)

        # short rows rather than one long one: the chat keeps a narrow minimum width beside the docks
        rows = (((self.tr("Preset"), self.preset_picker), (self.tr("Drafting"), self.drafting)),
                ((self.tr("Temperature"), self.temperature), ("", self.greedy), (self.tr("Top-p"), self.top_p)),
                ((self.tr("Repeat penalty"), self.repeat_penalty), (self.tr("Max tokens"), self.max_tokens),
                 ("", self.stop_loops)))
        settings = QVBoxLayout()
        settings.setSpacing(2)
        for row in rows:
            line = QHBoxLayout()
            line.addStretch(1)
            for label, widget in row:
                if label:
                    line.addWidget(QLabel(label))
                line.addWidget(widget)
            settings.addLayout(line)
        buttons = QHBoxLayout()
        buttons.addWidget(self.system_toggle)
        buttons.addStretch(1)
        buttons.addWidget(self.regen_button)
        buttons.addWidget(self.stop_button)
        buttons.addWidget(self.send_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.addWidget(self.transcript, 1)
        layout.addWidget(self.context_meter)
        layout.addLayout(settings)
        layout.addWidget(self.system_edit)
        layout.addWidget(self.edit_bar)
        layout.addWidget(self.input)
        layout.addLayout(buttons)
        layout.addWidget(self.status)
        self.status.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)

    # --- what the window calls ---

    def set_model(self, info: ModelInfo | None) -> None:
        """The model answers come from (None: none loaded, nothing can be sent)."""
        self.info = info
        demo = info is not None and is_demo(info)
        self.transcript.set_note(QCoreApplication.translate("ChatPanel", DEMO_NOTE) if demo else "")
        self.context_meter.set_total(info.settings.context_length if info is not None else None)
        self.drafting.set_model(info, self.remote)
        if info is None:
            self._set_status(self.tr("Open a model to chat (File ▸ Open)"))
        elif not info.chat:
            self._set_status(self.tr("{name} has no chat template: it cannot chat").format(name=info.name))
        elif demo:
            self._set_status(self.tr("Ready: {name} (the small demo model)").format(name=info.name))
        else:
            self._set_status(self.tr("Ready: {name}").format(name=info.name))
        self._update_buttons()

    def open_conversation(self, conv: Conversation) -> None:
        """Show conv (an answer being written keeps going into its own conversation, not shown)."""
        self.cancel_edit()
        self._commit_settings()
        self.conversation = conv
        self._show(conv)
        if self._answering is not None and self._answering.id == conv.id:   # back to the answer being written
            self.transcript.begin_answer(len(conv.turns))
            self.transcript.add_text(self._partial, self._partial_reasoning)
            if self._prompt_tokens:
                self.context_meter.set_used(self._prompt_tokens + self._tokens)
        self._update_buttons()

    def new_conversation(self) -> None:
        """Start an empty conversation that keeps the current system prompt and sampling."""
        self.cancel_edit()
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
        """Send the input's text (or `text`) as a question; False when nothing could be sent. While a question
        is being edited, the conversation branches there (the old continuation is saved apart)."""
        text = (self.input.toPlainText() if text is None else text).strip()
        if not text or not self._can_generate():
            return False
        self._commit_settings()
        if self.editing is not None:
            self.conversation, old = self.conversation.branched(self.editing, text)
            self._save(old)
            self.cancel_edit()
            self._show(self.conversation)
        else:
            self.conversation = self.conversation.with_turn(Turn("user", text))
            self.transcript.add_user(text, len(self.conversation.turns) - 1)
        self._save(self.conversation)
        self.input.clear()
        self._start()
        return True

    def edit_message(self, index: int) -> bool:
        """Put question `index` back in the input: the next send branches the conversation there."""
        turns = self.conversation.turns
        if not 0 <= index < len(turns) or turns[index].role != "user":
            return False
        if self.generating:
            self._set_status(self.tr("Wait for the answer to end, or stop it, before editing a question"))
            return False
        self.editing = index
        self.input.setPlainText(turns[index].content)
        self.edit_note.setText(self.tr("Editing question {n}: Send starts a branch here; the conversation after it "
                                       "is kept as “{title} (branch)”. Escape cancels.").format(
            n=sum(t.role == "user" for t in turns[:index + 1]), title=self.conversation.title))
        self.edit_bar.show()
        self.input.setFocus()
        return True

    def cancel_edit(self) -> None:
        """Leave the question being edited as it was (the input is cleared)."""
        if self.editing is None:
            return
        self.editing = None
        self.edit_bar.hide()
        self.input.clear()

    def rename_conversation(self, conversation_id: str, title: str) -> bool:
        """Give a saved conversation (or the one shown) a new title; False, saying why, when it cannot be."""
        try:
            conv = (self.conversation if conversation_id == self.conversation.id
                    else self.store.load(conversation_id)).renamed(title)
        except (OSError, ValueError) as exc:
            self._set_status(self.tr("Not renamed: {why}").format(why=exc))
            self.conversationsChanged.emit()        # the list shows the title it had
            return False
        if conversation_id == self.conversation.id:
            self.conversation = conv
        if self._answering is not None and self._answering.id == conversation_id:   # its answer saves it again
            self._answering = replace(self._answering, title=conv.title)
        self._save(conv)
        return True

    def export_conversation(self, conversation_id: str | None = None) -> QFileDialog | None:
        """Ask where to export a conversation (None: the one shown) as Markdown or JSON; the file is written when
        the dialog is accepted. None, saying why, when there is nothing to export."""
        try:
            conv = (self.conversation if conversation_id in (None, self.conversation.id)
                    else self.store.load(str(conversation_id)))
        except (OSError, ValueError) as exc:
            self._set_status(self.tr("Not exported: {why}").format(why=exc))
            return None
        if not conv.turns:
            self._set_status(self.tr("Nothing to export yet: ask a question first"))
            return None
        if self.export_dialog is not None:
            self.export_dialog.reject()
        dlg = self.export_dialog = export_dialog(self, conv.title, lambda path: self._export(conv, path))
        dlg.finished.connect(lambda _r: self._export_closed(dlg))
        dlg.open()
        return dlg

    def _export(self, conv: Conversation, path: str) -> None:
        try:
            written = export(conv, path)
        except (OSError, ValueError) as exc:
            log.warning("conversation %s not exported: %s", conv.id, exc)
            self._set_status(self.tr("Not exported: {why}").format(why=exc))
            return
        self._set_status(self.tr("Exported “{title}” as {format} to {path}").format(
            title=conv.title, format=EXPORTS[written.suffix.lower()], path=written))

    def _export_closed(self, dlg: QFileDialog) -> None:
        if self.export_dialog is dlg:
            self.export_dialog = None

    def stop(self) -> None:
        """Stop the answer being written (the engine stops before its next token)."""
        if self._request is not None:
            self.bridge.service.cancel(self._request)
            self._set_status(self.tr("Stopping…"))

    def regenerate(self) -> bool:
        """Write the last answer again."""
        if not self._can_generate() or not self.conversation.turns:
            return False
        self.cancel_edit()
        self._commit_settings()
        self.conversation = self.conversation.without_last_answer()
        if not self.conversation.turns:
            return False
        self._save(self.conversation)
        self._show(self.conversation)
        self._start()
        return True

    def regenerate_at(self, index: int) -> bool:
        """Write answer `index` again as a branch: the conversation goes on from its question with a new answer, and
        the old conversation (that answer and what followed) is saved apart as "<title> (branch)"."""
        if not self._can_generate():
            if self.generating:
                self._set_status(self.tr("Wait for the answer to end, or stop it, before regenerating another"))
            return False
        self.cancel_edit()
        self._commit_settings()
        try:
            self.conversation, old = self.conversation.regenerated(index)
        except ValueError as exc:
            self._set_status(self.tr("Not regenerated: {why}").format(why=exc))
            return False
        self._save(old)
        self._save(self.conversation)
        self._show(self.conversation)
        self._start()
        return True

    def current_preset(self, name: str) -> Preset:
        """The system prompt and sampling in the fields, as a preset called name."""
        return Preset(name, self.temperature.value(), self.top_p.value(), self.repeat_penalty.value(),
                      self.system_edit.toPlainText())

    def apply_preset(self, preset: Preset) -> None:
        """Fill the fields from a preset (a built-in one leaves the system prompt); they become the defaults."""
        self._applying = True      # the list keeps showing this preset while the fields change one by one
        try:
            if preset.system is not None:
                self.system_edit.setPlainText(preset.system)
                if preset.system and not self.system_toggle.isChecked():
                    self.system_toggle.setChecked(True)
            self.top_p.setValue(preset.top_p)
            self.repeat_penalty.setValue(preset.repetition_penalty)
            self.temperature.setValue(preset.temperature)
        finally:
            self._applying = False
        self._commit_settings()
        self._show_preset()
        self._set_status(self.tr("Preset “{name}”: temperature {t:g}, top-p {p:g}, repeat penalty {r:g}").format(
            name=self.preset_picker.combo.currentText(), t=preset.temperature, p=preset.top_p,
            r=preset.repetition_penalty))

    def set_defaults(self, defaults: ChatDefaults) -> None:
        """New conversations start with defaults (the settings dialog); an empty conversation shown takes them now."""
        self.defaults = defaults
        defaults.save(self.settings)
        self.stop_loops.blockSignals(True)      # its signal would keep the fields' sampling as the defaults
        self.stop_loops.setChecked(defaults.stop_loops)
        self.stop_loops.blockSignals(False)
        if not self.conversation.turns:
            self.conversation = replace(self.conversation,
                                        sampling=defaults.sampling(self.conversation.sampling.max_tokens))
            self._show(self.conversation)

    def close_views(self) -> None:
        """Stop the redraw timer and any answer in flight (the window is closing)."""
        self.preset_picker.close_views()
        self.transcript.stop_answer()
        if self._request is not None:
            self.bridge.service.cancel(self._request)
        if self.export_dialog is not None:
            self.export_dialog.reject()
        self._commit_settings()

    # --- generation ---

    def _can_generate(self) -> bool:
        return self.info is not None and self.info.chat and self._request is None

    def _start(self) -> None:
        s = self.conversation.sampling
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, repetition_penalty=s.repetition_penalty)
        self._answering = self.conversation
        self._tokens, self._partial, self._partial_reasoning, self._prompt_tokens = 0, "", "", 0
        self._loops = LoopDetector() if self.stop_loops.isChecked() else None
        self.loop, self._pieces = None, []
        drafting = {} if self.remote is not None else {"speculative": self.drafting.mode()}   # a server's: as started
        self._request = self.bridge.service.generate(messages=self.conversation.messages(), sampling=params,
                                                     max_tokens=s.max_tokens, **drafting)
        self.transcript.begin_answer(len(self.conversation.turns))
        self._set_status(self.tr("Reading the prompt…"))
        self._update_buttons()

    def _on_generation(self, request: int, event: object) -> None:
        if request != self._request:
            return
        shown = self._answering is not None and self._answering.id == self.conversation.id
        if isinstance(event, TokenEvent):
            self._tokens += 1
            self._partial += event.text
            self._partial_reasoning += event.reasoning
            self._pieces.append((event.text, event.reasoning))
            if shown:
                self.transcript.add_text(event.text, event.reasoning)
            if self._loops is not None and self.loop is None:
                self.loop = self._loops.push(loop_key(event))
                if self.loop is not None:   # the engine stops before its next token; _finish cuts the loop
                    self.bridge.service.cancel(request)
                    self._set_status(self.tr("Stopping: the answer repeats itself…"))
                    return
            if self._tokens == 1 or self._tokens % 16 == 0:
                self._set_status(self.tr("Writing… {n} tokens").format(n=self._tokens))
                if shown and self._prompt_tokens:
                    self.context_meter.set_used(self._prompt_tokens + self._tokens)
        elif isinstance(event, ProgressEvent):
            self._set_status(self.tr("Reading the prompt: {done}/{total} tokens").format(done=event.done,
                                                                                          total=event.total))
            self._prompt_tokens = event.total
            if shown:
                self.context_meter.set_used(event.total)
        elif isinstance(event, DoneEvent):
            self._finish(event, shown)
        elif isinstance(event, ErrorEvent):
            if shown:
                self.transcript.end_answer(self.transcript.text, event.message, error=True)
                self.transcript.remember(self.conversation)
            self._request = self._answering = None
            self._set_status(self.tr("The answer failed: {why}").format(why=event.message))
            self._update_buttons()

    def _finish(self, done: DoneEvent, shown: bool) -> None:
        s = done.stats
        loop, self._loops = self.loop, None
        if loop is not None:    # keep the answer up to the first copy of its loop
            kept = self._pieces[: loop.start + loop.period]
            done = replace(done, finish_reason="loop", text="".join(t for t, _ in kept),
                           reasoning="".join(r for _, r in kept))
        stats = {"ttft_s": round(s.ttft_s, 4), "tok_s": round(s.decode_tok_s, 2), "tokens": len(done.tokens),
                 "finish_reason": done.finish_reason, "model": self.info.name if self.info else None}
        if s.prompt_tokens > 0:     # a server that sends no usage counts nothing
            stats["context_tokens"] = s.prompt_tokens + s.generated_tokens
        conv = self._answering
        self._request = self._answering = None
        kept = conv is not None and bool(done.text or done.reasoning or done.finish_reason != "cancelled")
        if conv is not None and kept:
            conv = conv.with_turn(Turn("assistant", done.text, stats, done.reasoning))
            self._save(conv)
            if conv.id == self.conversation.id:
                self.conversation = conv
        if shown and self.transcript.answering and kept:
            self.transcript.end_answer(done.text, stats_line(stats), reasoning=done.reasoning)
            self.transcript.remember(self.conversation)
        elif shown:     # stopped before any text: no empty answer (its copy link would name the next question)
            self.transcript.show_conversation(self.conversation)
            if not kept:
                self.transcript.add_note(stats_line(stats))
        if shown:
            self.context_meter.set_used(self.conversation.context_tokens())
        if shown and loop is not None:
            note = (self.tr("The answer was stopped because it repeated itself ({repeats} times a stretch of "
                            "{period} tokens); it is shown up to the first repeat. Regenerate, raise the temperature "
                            "or the repeat penalty, or uncheck Stop loops to let it run.") if loop.period > 1 else
                    self.tr("The answer was stopped because it repeated itself ({repeats} times a stretch of "
                            "{period} token); it is shown up to the first repeat. Regenerate, raise the temperature "
                            "or the repeat penalty, or uncheck Stop loops to let it run."))
            self.transcript.add_note(note.format(repeats=loop.repeats, period=loop.period))
        stopped = done.finish_reason in ("cancelled", "loop")
        status = self.tr("Stopped: {stats}") if stopped else self.tr("Done: {stats}")
        # the model's name only in the tooltip: the window's status bar and the answer's own line name it already
        self._set_status(status.format(stats=stats_line({k: v for k, v in stats.items() if k != "model"})),
                         status.format(stats=stats_line(stats)))
        self._update_buttons()

    def _on_settings(self, applied: SettingsApplied) -> None:
        """The context length may have moved (Controls): the meter measures against the one in force."""
        if applied.info is not None:
            self.context_meter.set_total(applied.info.settings.context_length)

    # --- helpers ---

    def _show(self, conv: Conversation) -> None:
        self.transcript.show_conversation(conv)
        self.context_meter.set_used(conv.context_tokens())
        widgets = (self.system_edit, self.temperature, self.greedy, self.top_p, self.repeat_penalty, self.max_tokens)
        for w in widgets:
            w.blockSignals(True)
        self.system_edit.setPlainText(conv.system)
        self.temperature.setValue(conv.sampling.temperature)
        self.greedy.setChecked(conv.sampling.temperature == 0)
        self.top_p.setValue(conv.sampling.top_p)
        self.repeat_penalty.setValue(conv.sampling.repetition_penalty)
        self.max_tokens.setValue(conv.sampling.max_tokens)
        for w in widgets:
            w.blockSignals(False)
        if conv.system and not self.system_toggle.isChecked():
            self.system_toggle.setChecked(True)
        self._show_preset()

    def _show_preset(self) -> None:
        """The preset list names the preset the fields hold, or Custom."""
        if self._applying:
            return
        self.preset_picker.show_matching(self.temperature.value(), self.top_p.value(), self.repeat_penalty.value(),
                                         self.system_edit.toPlainText())

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

    def _temperature_changed(self, value: float) -> None:
        """Temperature 0 is greedy: the check box says so."""
        self.greedy.blockSignals(True)
        self.greedy.setChecked(value == 0)
        self.greedy.blockSignals(False)
        self._keep_defaults()

    def _greedy_toggled(self, on: bool) -> None:
        """Greedy sets the temperature to 0; unchecked, back to the last temperature above 0."""
        self.temperature.setValue(0.0 if on else (self.defaults.temperature or ChatDefaults.temperature))

    def _penalty_changed(self, value: float) -> None:
        conv = self.conversation
        if value != conv.sampling.repetition_penalty:
            self.conversation = conv = replace(conv, sampling=replace(conv.sampling, repetition_penalty=value))
            if conv.turns:
                self._save(conv)
        self._keep_defaults()

    def _keep_defaults(self) -> None:
        """The user changed a setting: it becomes the default of new conversations and of the next run."""
        t = self.temperature.value()
        self.defaults = ChatDefaults(t if t > 0 else self.defaults.temperature, self.top_p.value(),
                                     self.repeat_penalty.value(), t == 0, self.stop_loops.isChecked())
        self.defaults.save(self.settings)
        self._show_preset()

    def _save(self, conv: Conversation) -> None:
        try:
            self.store.save(conv)
        except (OSError, ValueError) as exc:
            log.warning("conversation %s not saved: %s", conv.id, exc)
            self._set_status(self.tr("The conversation could not be saved: {why}").format(why=exc))
        self.conversationsChanged.emit()

    def _toggle_system(self, on: bool) -> None:
        self.system_edit.setVisible(on)
        self.system_toggle.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow)

    def _set_status(self, text: str, tip: str = "") -> None:
        """Say text on the status line (tip: its tooltip, when it says more than the line)."""
        self.status.setText(text)     # (an ElidedLabel: its tooltip is the text, unless tip says more)
        if tip:
            self.status.setToolTip(tip)

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
            why = (self.tr("open a model first") if self.info is None
                   else self.tr("{name} has no chat template").format(name=self.info.name))
            self.send_button.setToolTip(why)
        else:
            self.send_button.setToolTip(self.tr("send (Enter)"))
