"""The chat's options beside its fields: the sampling a new conversation starts with (`ChatDefaults`), the
drafting choice (`DraftingChoice`: answers drafted by prompt lookup or by the model's MTP head, never changing
them), what the loop detector compares, and which model is the small demo one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication, QSettings
from PySide6.QtWidgets import QComboBox, QWidget

from app.config.catalog import DEFAULT_MODEL, DERIVED
from app.conversations import Sampling
from app.service.local import ModelInfo
from app.service.remote import UNKNOWN_TOKEN
from engine.events import TokenEvent

# shown in the empty transcript of the demo model; translated where shown (context "ChatPanel")
DEMO_NOTE = QT_TRANSLATE_NOOP("ChatPanel", "This is the demo model: SmolLM2-135M, a small model upcycled into experts "
                              "to show them streaming from disk. Expect simple answers, and open a bigger model for "
                              "real work (File ▸ Open).")


@dataclass(frozen=True)
class ChatDefaults:
    """The sampling a new conversation starts with, and whether loops stop answers (kept in QSettings)."""

    temperature: float = 0.7        # the last non-greedy temperature
    top_p: float = 0.9
    repetition_penalty: float = 1.1
    greedy: bool = False            # temperature 0: the likeliest token every time
    stop_loops: bool = True

    @classmethod
    def load(cls, settings: QSettings | None) -> ChatDefaults:
        """The defaults saved in settings (the app's own where none are)."""
        if settings is None:
            return cls()
        d = cls()
        return cls(float(settings.value("chat/temperature", d.temperature, type=float)),
                   float(settings.value("chat/top_p", d.top_p, type=float)),
                   float(settings.value("chat/repetition_penalty", d.repetition_penalty, type=float)),
                   bool(settings.value("chat/greedy", d.greedy, type=bool)),
                   bool(settings.value("chat/stop_loops", d.stop_loops, type=bool)))

    def save(self, settings: QSettings | None) -> None:
        """Keep these defaults for the next conversation and the next run."""
        if settings is None:
            return
        for key in ("temperature", "top_p", "repetition_penalty", "greedy", "stop_loops"):
            settings.setValue(f"chat/{key}", getattr(self, key))

    def sampling(self, max_tokens: int = Sampling.max_tokens) -> Sampling:
        """A new conversation's sampling."""
        return Sampling(0.0 if self.greedy else self.temperature, self.top_p, max_tokens, self.repetition_penalty)


def loop_key(event: TokenEvent) -> int:
    """What the loop detector compares: the token id, or for a server's token seen only as text, the text."""
    if event.token_id != UNKNOWN_TOKEN:
        return event.token_id
    return hash((event.text, event.reasoning)) & 0x7FFF_FFFF_FFFF_FFFF | 1 << 62   # never a real token id


def is_demo(info: ModelInfo) -> bool:
    """Whether info is the default demo model (or the bf16 model it is converted from)."""
    folders, name = set(), DEFAULT_MODEL
    while name in DERIVED:
        folders.add(DERIVED[name].folder)
        name = DERIVED[name].source
    return Path(info.path).name in folders




class DraftingChoice(QComboBox):
    """Off, prompt lookup, or MTP (offered when the model ships an MTP head): how answers are drafted and verified.
    Drafting only changes speed: a greedy answer is the same token for token."""

    OFF, LOOKUP, MTP = False, "lookup", "mtp"

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.addItem(self.tr("Off"), self.OFF)
        self.addItem(self.tr("Prompt lookup"), self.LOOKUP)
        self.addItem(self.tr("MTP head"), self.MTP)
        # as narrow as a short word: the chat keeps its small minimum width beside the docks
        self.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.setMinimumContentsLength(4)
        self.setToolTip(self.tr("speculative decoding: guess a few tokens ahead (from the conversation, or with the "
                                "model's multi-token-prediction head) and verify them in one step; answers stay the "
                                "same, only faster when guesses hold"))
        self.set_model(None)

    def mode(self) -> bool | str:
        """What the service is asked for: False, "lookup" or "mtp"."""
        return self.currentData()

    def set_mode(self, mode: bool | str) -> None:
        """Choose a mode (True counts as prompt lookup); MTP falls back to Off where the model has no MTP head."""
        mode = self.LOOKUP if mode is True else mode
        index = self.findData(mode) if mode else 0
        item = self.model().item(index) if index >= 0 else None
        self.setCurrentIndex(index if item is not None and item.isEnabled() else 0)

    def set_model(self, info: ModelInfo | None, remote: str | None = None) -> None:
        """Offer what the loaded model allows (remote: a server's URL, which drafts as it was started)."""
        mtp = self.model().item(2)
        mtp.setEnabled(info is not None and info.mtp)
        mtp.setToolTip("" if info is not None and info.mtp else
                       QCoreApplication.translate("DraftingChoice", "this model has no MTP head to draft with"))
        if remote is not None:
            self.setCurrentIndex(0)
            self.setToolTip(QCoreApplication.translate(
                "DraftingChoice", "the server at {url} drafts as it was started (colibri serve --speculative)")
                .format(url=remote))
        self.setEnabled(remote is None)
        if self.currentData() == self.MTP and not mtp.isEnabled():
            self.setCurrentIndex(0)
