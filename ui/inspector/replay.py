"""The Brain's replay: a scrubber over the recorded routing of decoded tokens (`engine.offload.story.Routes`).

Off "Live", the Brain shows one recorded token instead of the current one: the experts it chose flash and those it
waited for from disk are drawn in the I/O colour. Step token by token, drag the slider, or play: each token's routing
then sweeps down the Brain layer by layer at the speed set (layers per second, a QTimer on the GUI thread), and the
next token follows until the last recorded one.
"""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QHideEvent
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QSlider, QSpinBox, QToolButton, QWidget

from engine.offload.story import Routes

Route = list[tuple[int, tuple[int, ...]]]      # (layer, experts) as the Brain flashes them


class ReplayBar(QWidget):
    """Live / replay switch, step and play buttons, the token slider and the sweep's speed."""

    moved = Signal(int, int)                   # (token, layers swept) whenever the replayed position changes

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.live = QPushButton(self.tr("Live"))
        self.live.setCheckable(True)
        self.live.setChecked(True)
        self.live.setToolTip(self.tr("show the current token; off: replay the recorded ones"))
        self.back = QToolButton()
        self.back.setText("◀")
        self.back.setToolTip(self.tr("the token before"))
        self.play = QToolButton()
        self.play.setCheckable(True)
        self.play.setText("▶")
        self.play.setToolTip(self.tr("play: each token sweeps down the layers"))
        self.forward = QToolButton()
        self.forward.setText("▶|")
        self.forward.setToolTip(self.tr("the token after"))
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setRange(0, 0)
        self.speed = QSpinBox()
        self.speed.setRange(1, 1000)
        self.speed.setValue(60)
        self.speed.setSuffix(self.tr(" layers/s"))
        self.speed.setToolTip(self.tr("how fast a token's routing sweeps down the Brain"))
        self.label = QLabel(self.tr("no routing recorded"))
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        for w in (self.live, self.back, self.play, self.forward):
            layout.addWidget(w)
        layout.addWidget(self.slider, 1)
        layout.addWidget(self.speed)
        layout.addWidget(self.label)

        self.routes: Routes | None = None
        self.tokens = np.zeros(0, np.int64)    # [T] recorded tokens, ascending
        self.index = 0                         # the replayed token, an index into `tokens`
        self.swept = 0                         # of its steps, those drawn (all of them unless playing)
        self._steps: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []   # its steps in layer order
        self._timer = QTimer(self)
        self._timer.timeout.connect(self._advance)
        self.live.toggled.connect(self._live_toggled)
        self.back.clicked.connect(lambda: self.seek(self.index - 1))
        self.forward.clicked.connect(lambda: self.seek(self.index + 1))
        self.play.toggled.connect(self.set_playing)
        self.slider.valueChanged.connect(self._slid)
        self.speed.valueChanged.connect(self._set_interval)
        self._set_interval(self.speed.value())
        self._enable()

    @property
    def active(self) -> bool:
        """Whether the Brain shows a replayed token rather than the current one."""
        return not self.live.isChecked() and len(self.tokens) > 0

    def set_routes(self, routes: Routes | None) -> None:
        """The recorded routing (None: none); the replayed token stays where it was while it is still recorded."""
        if routes is self.routes:
            return
        token = int(self.tokens[self.index]) if len(self.tokens) else None
        self.routes = routes
        self.tokens = routes.tokens() if routes is not None else np.zeros(0, np.int64)
        where = np.searchsorted(self.tokens, token) if token is not None else len(self.tokens) - 1
        self.slider.blockSignals(True)
        self.slider.setRange(0, max(len(self.tokens) - 1, 0))
        self.slider.blockSignals(False)
        self._enable()
        self._go(int(min(max(where, 0), max(len(self.tokens) - 1, 0))), keep_sweep=True)

    def shown(self) -> tuple[Route, Route]:
        """What the Brain draws now: (experts chosen, experts read from disk) of the swept steps of the token."""
        steps = self._steps[:self.swept]
        return [(layer, ids) for layer, ids, _ in steps], [(layer, disk) for layer, _, disk in steps if disk]

    def seek(self, index: int) -> None:
        """Show the token at `index` of the recorded ones, all its layers (paused)."""
        if not len(self.tokens):
            return
        self.play.setChecked(False)
        self._go(min(max(index, 0), len(self.tokens) - 1))

    def set_playing(self, playing: bool) -> None:
        """Play from the replayed token (its sweep starts over), or pause."""
        if self.play.isChecked() != playing:
            self.play.setChecked(playing)           # (toggled calls back here)
            return
        self.play.setText("⏸" if playing else "▶")
        if not playing or not len(self.tokens):
            self._timer.stop()
            return
        if self.live.isChecked():
            self.live.setChecked(False)
        if self.index == len(self.tokens) - 1 and self.swept == len(self._steps):
            self._load(0)                           # at the end: from the first token again
        self.swept = 0
        self._emit()
        self._timer.start()

    def stop(self) -> None:
        """Pause for good (the inspector closes)."""
        self.play.setChecked(False)
        self._timer.stop()

    def hideEvent(self, event: QHideEvent) -> None:
        """Nothing plays unseen."""
        self.play.setChecked(False)
        super().hideEvent(event)

    # --- internals ---------------------------------------------------------------------------

    def _load(self, index: int) -> None:
        """Make the token at `index` the replayed one (nothing drawn yet)."""
        self.index = index
        self._steps = self.routes.of(int(self.tokens[index])) if len(self.tokens) and self.routes else []
        self.slider.blockSignals(True)
        self.slider.setValue(index)
        self.slider.blockSignals(False)

    def _go(self, index: int, keep_sweep: bool = False) -> None:
        """Replay the token at `index`, all its layers (unless `keep_sweep` while playing: as far as swept)."""
        self._load(index)
        self.swept = min(self.swept, len(self._steps)) if keep_sweep and self._timer.isActive() else len(self._steps)
        self._emit()

    def _advance(self) -> None:
        """One timer tick: one more layer of the token, or the next token's first, or the end."""
        if self.swept < len(self._steps):
            self.swept += 1
        elif self.index + 1 < len(self.tokens):
            self._load(self.index + 1)
            self.swept = 1 if self._steps else 0
        else:
            self.play.setChecked(False)
            return
        self._emit()

    def _emit(self) -> None:
        if len(self.tokens):
            self.label.setText(self.tr("token {token} ({n} of {count}), {swept} of {layers} layers").format(
                token=int(self.tokens[self.index]), n=self.index + 1, count=len(self.tokens), swept=self.swept,
                layers=len(self._steps)))
        else:
            self.label.setText(self.tr("no routing recorded"))
        self.moved.emit(int(self.tokens[self.index]) if len(self.tokens) else -1, self.swept)

    def _slid(self, value: int) -> None:
        self.seek(value)

    def _live_toggled(self, live: bool) -> None:
        if live:
            self.play.setChecked(False)
        self._enable()
        self._emit()

    def _set_interval(self, layers_per_s: int) -> None:
        self._timer.setInterval(max(1, round(1000 / layers_per_s)))

    def _enable(self) -> None:
        recorded = len(self.tokens) > 0
        for w in (self.back, self.forward, self.slider):
            w.setEnabled(recorded and not self.live.isChecked())
        self.play.setEnabled(recorded)
