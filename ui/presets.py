"""Presets of the chat: a system prompt and sampling settings under a name, chosen from a list above the input.

A few are built in (Default suits small models: temperature 0.7, top-p 0.9, a mild repetition penalty; Greedy
always takes the likeliest token; Creative samples more freely); they set the sampling and leave the system
prompt as it is. The user saves the chat's current settings as presets of their own, which carry the system
prompt too; those are kept in a JSON file beside the app's settings (`presets_path`), written atomically, and
can be replaced or deleted. A file that cannot be read is left as it is and never overwritten.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication, QSettings, Qt, Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QInputDialog, QToolButton, QWidget

from engine.atomic import atomic_file

log = logging.getLogger(__name__)

FORMAT = "colibri-presets"
VERSION = 1
NAME_CHARS = 40


@dataclass(frozen=True)
class Preset:
    """A named system prompt and sampling; `system` None leaves the chat's system prompt as it is."""

    name: str
    temperature: float
    top_p: float
    repetition_penalty: float
    system: str | None = None
    builtin: bool = False

    def same_settings(self, temperature: float, top_p: float, repetition_penalty: float, system: str) -> bool:
        """Whether the chat's fields hold this preset (its system prompt counts only when it sets one)."""
        close = all(abs(a - b) < 1e-6 for a, b in ((self.temperature, temperature), (self.top_p, top_p),
                                                   (self.repetition_penalty, repetition_penalty)))
        return close and (self.system is None or self.system == system)

    def to_json(self) -> dict[str, Any]:
        """Plain values for the file."""
        return {"name": self.name, "temperature": self.temperature, "top_p": self.top_p,
                "repetition_penalty": self.repetition_penalty, "system": self.system}

    @classmethod
    def from_json(cls, data: Any) -> Preset:
        """A user's preset from the file; ValueError naming what is wrong."""
        try:
            system = data.get("system")
            if system is not None and not isinstance(system, str):
                raise ValueError(f"a preset's system prompt is {type(system).__name__}, not text")
            return cls(valid_name(str(data["name"])), float(data["temperature"]), float(data["top_p"]),
                       float(data["repetition_penalty"]), system)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"a preset with a missing or malformed field: {exc}") from None


# the built-in names are shown translated (context "PresetPicker"); they stay English in files and lookups
BUILTIN = (
    Preset(QT_TRANSLATE_NOOP("PresetPicker", "Default"), 0.7, 0.9, 1.1, builtin=True),  # what small models like
    Preset(QT_TRANSLATE_NOOP("PresetPicker", "Greedy"), 0.0, 1.0, 1.0, builtin=True),   # the same answer each run
    Preset(QT_TRANSLATE_NOOP("PresetPicker", "Creative"), 1.0, 0.95, 1.05, builtin=True),
)


def valid_name(name: str) -> str:
    """A preset's name with its spaces collapsed; ValueError for an empty or overlong one, or a built-in's."""
    name = " ".join(name.split())
    if not name:
        raise ValueError(QCoreApplication.translate("Presets", "a preset needs a name: type a few words"))
    if len(name) > NAME_CHARS:
        raise ValueError(QCoreApplication.translate("Presets", "a preset's name has at most {n} characters").format(
            n=NAME_CHARS))
    if any(name.casefold() == b.name.casefold() for b in BUILTIN):
        raise ValueError(QCoreApplication.translate(
            "Presets", "“{name}” is a built-in preset: choose another name").format(name=name))
    return name


def presets_path(settings: QSettings) -> Path:
    """The user's presets file: beside the settings file (`<settings>.presets.json`)."""
    return Path(settings.fileName()).with_suffix(".presets.json")


class PresetStore:
    """The built-in presets and the user's, whose file is read on creation and rewritten on every change."""

    def __init__(self, path: Path | None):
        self.path = path                    # None: the user's presets live only in memory
        self.problem: str | None = None     # why the file could not be read (it is then never overwritten)
        self._own: list[Preset] = []
        if path is not None and path.exists():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
                    raise ValueError(f"not a version {VERSION} Colibri presets file")
                self._own = [Preset.from_json(p) for p in data["presets"]]
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
                log.warning("presets: %s could not be read (%s); it is kept as it is", path, exc)
                self.problem = QCoreApplication.translate(
                    "Presets", "{path} could not be read ({why}); it is kept as it is").format(path=path, why=exc)

    def all(self) -> list[Preset]:
        """The built-in presets, then the user's in the order saved."""
        return [*BUILTIN, *self._own]

    def find(self, name: str) -> Preset | None:
        """The preset called name (any case), or None."""
        return next((p for p in self.all() if p.name.casefold() == name.casefold()), None)

    def save(self, preset: Preset) -> Preset:
        """Add preset, or replace the user's preset of that name; ValueError (bad name, unreadable file) or OSError."""
        preset = Preset(valid_name(preset.name), preset.temperature, preset.top_p, preset.repetition_penalty,
                        preset.system)
        own = [p for p in self._own if p.name.casefold() != preset.name.casefold()]
        self._write(own + [preset])
        return preset

    def delete(self, name: str) -> None:
        """Forget the user's preset called name; ValueError for a built-in one."""
        if any(name.casefold() == b.name.casefold() for b in BUILTIN):
            raise ValueError(QCoreApplication.translate(
                "Presets", "“{name}” is built in: it cannot be deleted").format(name=name))
        self._write([p for p in self._own if p.name.casefold() != name.casefold()])

    def _write(self, own: list[Preset]) -> None:
        if self.path is not None:
            if self.problem is not None:
                raise ValueError(QCoreApplication.translate(
                    "Presets", "{problem}, not overwritten: move it away to save presets again").format(
                    problem=self.problem))
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(self.path, public=False) as f:
                json.dump({"format": FORMAT, "version": VERSION, "presets": [p.to_json() for p in own]}, f,
                          ensure_ascii=False, indent=1)
                f.write("\n")
        self._own = own


class PresetPicker(QWidget):
    """A list of presets with Save and Delete: choosing one emits `chosen`; the list shows the preset the chat's
    fields hold, or "Custom" when they hold none."""

    chosen = Signal(object)         # Preset
    problem = Signal(str)           # a save or delete that failed, and why

    def __init__(self, store: PresetStore, current: Callable[[str], Preset], parent: QWidget | None = None):
        """current(name): the chat's fields as a preset of that name (what Save keeps)."""
        super().__init__(parent)
        self.store, self.current = store, current
        self.name_dialog: QInputDialog | None = None    # Save's name prompt, while open
        self.combo = QComboBox()
        self.combo.setToolTip(self.tr("a system prompt and sampling under a name: choosing one fills the fields "
                                      "below (built-in ones leave the system prompt as it is)"))
        self.save_button = QToolButton(text=self.tr("Save…"))
        self.save_button.setToolTip(self.tr("keep the system prompt and sampling below as a preset"))
        self.delete_button = QToolButton(text=self.tr("Delete"))
        self.delete_button.setToolTip(self.tr("forget the preset chosen (built-in ones stay)"))
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.combo, 1)
        row.addWidget(self.save_button)
        row.addWidget(self.delete_button)
        self.combo.activated.connect(self._activated)
        self.save_button.clicked.connect(lambda: self.ask_name())
        self.delete_button.clicked.connect(self.delete_chosen)
        self._fill()
        if store.problem:
            self.save_button.setToolTip(store.problem)

    def selected(self) -> Preset | None:
        """The preset shown (None: "Custom")."""
        name = self.combo.currentData()
        return self.store.find(name) if name else None

    def choose(self, name: str) -> Preset:
        """Choose the preset called name, as a click on it would; KeyError when there is none."""
        preset = self.store.find(name)
        if preset is None:
            raise KeyError(name)
        self.combo.setCurrentIndex(self.combo.findData(preset.name))
        self._activated(self.combo.currentIndex())
        return preset

    def show_matching(self, temperature: float, top_p: float, repetition_penalty: float, system: str) -> None:
        """Show the preset the fields hold (the one shown first, if it still matches), else "Custom"."""
        shown = self.selected()
        if shown is not None and shown.same_settings(temperature, top_p, repetition_penalty, system):
            return
        own_first = sorted(self.store.all(), key=lambda p: p.builtin)     # a user's preset is the more specific
        match = next((p for p in own_first if p.same_settings(temperature, top_p, repetition_penalty, system)), None)
        self.combo.setCurrentIndex(self.combo.findData(match.name) if match is not None else 0)
        self._update_buttons()

    def save_as(self, name: str) -> Preset | None:
        """Keep the chat's fields as preset `name` (replacing the user's of that name); None, saying why, on failure."""
        try:
            preset = self.store.save(self.current(name))
        except (OSError, ValueError) as exc:
            self.problem.emit(self.tr("The preset was not saved: {why}").format(why=exc))
            return None
        self._fill()
        self.combo.setCurrentIndex(self.combo.findData(preset.name))
        self._update_buttons()
        return preset

    def delete_chosen(self) -> bool:
        """Forget the user's preset shown; False when it is built in or none is."""
        preset = self.selected()
        if preset is None or preset.builtin:
            return False
        try:
            self.store.delete(preset.name)
        except (OSError, ValueError) as exc:
            self.problem.emit(self.tr("The preset was not deleted: {why}").format(why=exc))
            return False
        self._fill()
        return True

    def ask_name(self) -> QInputDialog:
        """Ask for the new preset's name (non-blocking); it is saved when the dialog is accepted."""
        if self.name_dialog is not None:
            self.name_dialog.reject()
        dlg = self.name_dialog = QInputDialog(self)
        dlg.setWindowTitle(self.tr("Save preset"))
        dlg.setLabelText(self.tr("Name of the preset (the system prompt and sampling are kept):"))
        shown = self.selected()
        dlg.setTextValue(shown.name if shown is not None and not shown.builtin else "")
        dlg.textValueSelected.connect(self.save_as)
        dlg.finished.connect(lambda _r: self._name_dialog_closed(dlg))
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dlg.open()
        return dlg

    def close_views(self) -> None:
        """Close Save's name prompt (the window is closing)."""
        if self.name_dialog is not None:
            self.name_dialog.reject()

    def _name_dialog_closed(self, dlg: QInputDialog) -> None:
        if self.name_dialog is dlg:
            self.name_dialog = None

    def _fill(self) -> None:
        self.combo.blockSignals(True)
        self.combo.clear()
        self.combo.addItem(self.tr("Custom"), None)
        for p in self.store.all():
            label = QCoreApplication.translate("PresetPicker", p.name) if p.builtin else p.name
            self.combo.addItem(label, p.name)
            tip = self.tr("temperature {t:g}, top-p {p:g}, repeat penalty {r:g}").format(
                t=p.temperature, p=p.top_p, r=p.repetition_penalty)
            if p.system:
                tip += "\n" + self.tr("system prompt: {s}").format(s=p.system[:200])
            self.combo.setItemData(self.combo.count() - 1, tip, Qt.ItemDataRole.ToolTipRole)
        self.combo.blockSignals(False)
        self._update_buttons()

    def _activated(self, index: int) -> None:
        self._update_buttons()
        preset = self.selected()
        if preset is not None:
            self.chosen.emit(preset)

    def _update_buttons(self) -> None:
        preset = self.selected()
        self.delete_button.setEnabled(preset is not None and not preset.builtin)

