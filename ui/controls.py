"""Sliders for the live settings: memory budget, prefetch depth, context length, reader threads.

A slider only asks: its change goes to the service as a `SettingsChange` (after a short pause,
or at once when released), the engine applies it between tokens, and the sliders then show the
settings the engine reports as in force. A setting the loaded model cannot change is disabled,
its tooltip saying why. Settings the engine accepted are kept in QSettings (the budget as a slider
position, since budgets differ between models) and asked for again when a model loads
(`restore_remembered`), where that model allows them.
"""

from __future__ import annotations

from PySide6.QtCore import QSettings, Qt, QTimer, Signal
from PySide6.QtWidgets import QFormLayout, QLabel, QSlider, QVBoxLayout, QWidget

from app.config.sizes import format_size as format_bytes
from app.service.local import ModelInfo, SettingsApplied, SettingsChange

DEBOUNCE_MS = 250       # a dragged slider asks once it rests this long (or when released)
BUDGET_STEPS = 1000     # the budget slider's positions between the least budget and the one holding every expert
MAX_PREFETCH = 4
MAX_IO_THREADS = 8
MIN_CONTEXT = 256
REMEMBERED = "controls/"   # QSettings group of the sliders' last accepted values


def context_steps(limit: int) -> list[int]:
    """Context lengths offered: powers of two from MIN_CONTEXT, then the model's own limit."""
    steps = [n for n in (2 ** k for k in range(8, 24)) if n < limit]
    return steps + [limit]


class _Setting:
    """One slider with its caption and value label."""

    def __init__(self, caption: str, fmt):
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setTracking(True)
        self.value_label = QLabel()
        self.value_label.setMinimumWidth(90)
        self.value_label.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        self.caption = caption
        self.fmt = fmt

    def show(self, value) -> None:
        self.value_label.setText(self.fmt(value))

    def set_enabled(self, on: bool, why: str = "") -> None:
        self.slider.setEnabled(on)
        self.slider.setToolTip(why)
        self.value_label.setToolTip(why)


class ControlsPanel(QWidget):
    """The live settings of the loaded model."""

    changeRequested = Signal(object)    # SettingsChange

    def __init__(self, parent: QWidget | None = None, settings: QSettings | None = None):
        super().__init__(parent)
        self.store = settings               # where accepted settings are remembered (None: nowhere)
        self.info: ModelInfo | None = None
        self._contexts: list[int] = [MIN_CONTEXT]
        self._budget_range = (0, 0)
        self.budget = _Setting(self.tr("Memory budget"), lambda pos: format_bytes(self.budget_at(pos)))
        self.prefetch = _Setting(self.tr("Prefetch depth"), self._depth)
        self.context = _Setting(self.tr("Context length"),
                                lambda i: self.tr("{n} tokens").format(n=f"{self._contexts[i]:,}"))
        self.io_threads = _Setting(self.tr("Reader threads"), lambda n: str(n))
        self.prefetch.slider.setRange(0, MAX_PREFETCH)
        self.io_threads.slider.setRange(1, MAX_IO_THREADS)
        self.note = QLabel()
        self.note.setWordWrap(True)
        self.note.setObjectName("controlsNote")
        self.problem = QLabel()
        self.problem.setWordWrap(True)
        self.problem.setObjectName("controlsProblem")
        self.problem.setStyleSheet("color: palette(bright-text);")
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(DEBOUNCE_MS)
        self._timer.timeout.connect(self.apply)

        form = QFormLayout()
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        for s in self.settings():
            row = QWidget()
            line = QVBoxLayout(row)
            line.setContentsMargins(0, 0, 0, 0)
            line.addWidget(s.slider)
            form.addRow(s.caption, row)
            form.addRow("", s.value_label)
            s.slider.valueChanged.connect(lambda v, s=s: self._moved(s, v))
            s.slider.sliderReleased.connect(self.apply)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.addLayout(form)
        layout.addWidget(self.note)
        layout.addWidget(self.problem)
        layout.addStretch(1)
        self.set_model(None)

    def _depth(self, layers: int) -> str:
        """A prefetch depth as the slider's label says it."""
        if layers == 0:
            return self.tr("off")
        return (self.tr("{n} layer") if layers == 1 else self.tr("{n} layers")).format(n=layers)

    def settings(self) -> tuple[_Setting, ...]:
        """The sliders, in display order."""
        return (self.budget, self.prefetch, self.context, self.io_threads)

    # --- from the window ---

    def set_model(self, info: ModelInfo | None) -> None:
        """Show the settings of the loaded model (None: no model, all disabled)."""
        self.info = info
        self._timer.stop()
        self.problem.clear()
        if info is None:
            for s in self.settings():
                s.set_enabled(False, self.tr("open a model first"))
                s.value_label.setText("–")
            self.note.setText(self.tr("No model loaded."))
            return
        self._show(info)

    def show_applied(self, applied: SettingsApplied) -> None:
        """The engine's answer to a change: the settings in force, and what it refused."""
        self.problem.setText("\n".join(applied.problems))
        if applied.info is not None:
            self._show(applied.info)
            self.remember(applied.info)

    def remember(self, info: ModelInfo) -> None:
        """Keep the settings in force, those this model may change, for the next model loaded."""
        if self.store is None:
            return
        s, fixed = info.settings, info.fixed
        if self._budget_enabled():
            self.store.setValue(REMEMBERED + "budget_position", self.position_of(s.memory_budget))
        for name in ("prefetch_depth", "io_threads", "context_length"):
            if name not in fixed:
                self.store.setValue(REMEMBERED + name, getattr(s, name))

    def restore_remembered(self, keep: frozenset[str] = frozenset()) -> SettingsChange:
        """Ask for the remembered settings the loaded model allows (clamped to its ranges), but those named in
        `keep` (SettingsChange field names the user gave for this load); the change asked."""
        if self.store is None or self.info is None:
            return SettingsChange()

        def saved(name: str) -> int | None:
            value = self.store.value(REMEMBERED + name)
            try:
                return int(value) if value is not None else None
            except (TypeError, ValueError):
                return None

        with_blocked = [s.slider for s in self.settings()]
        for slider in with_blocked:
            slider.blockSignals(True)
        try:
            for name, field, setting, low, high in (
                    ("prefetch_depth", "prefetch_depth", self.prefetch, 0, MAX_PREFETCH),
                    ("io_threads", "io_threads", self.io_threads, 1, MAX_IO_THREADS),
                    ("budget_position", "memory_budget", self.budget, 0, BUDGET_STEPS)):
                value = saved(name)
                if value is not None and setting.slider.isEnabled() and field not in keep:
                    setting.slider.setValue(min(high, max(low, value)))
                    setting.show(setting.slider.value())
            ctx = saved("context_length")
            if ctx is not None and self.context.slider.isEnabled() and "context_length" not in keep:
                index = min(range(len(self._contexts)), key=lambda i: abs(self._contexts[i] - ctx))
                self.context.slider.setValue(index)
                self.context.show(index)
        finally:
            for slider in with_blocked:
                slider.blockSignals(False)
        change = self.requested_change()
        if change != SettingsChange():
            self.changeRequested.emit(change)
        return change

    def requested_change(self) -> SettingsChange:
        """What the sliders ask that differs from the settings in force."""
        if self.info is None:
            return SettingsChange()
        s, fixed = self.info.settings, self.info.fixed
        budget = self.budget_at(self.budget.slider.value()) if self._budget_enabled() else None
        depth = self.prefetch.slider.value() if "prefetch_depth" not in fixed else None
        ctx = self._contexts[self.context.slider.value()] if "context_length" not in fixed else s.context_length
        io = self.io_threads.slider.value() if "io_threads" not in fixed else None
        if budget is not None and self.budget.slider.value() == self.position_of(s.memory_budget):
            budget = None   # the slider's step rounds: the position of the budget in force asks for nothing
        return SettingsChange(
            memory_budget=budget,
            prefetch_depth=depth if depth != s.prefetch_depth else None,
            io_threads=io if io != s.io_threads else None,
            context_length=ctx if ctx != s.context_length else None,
        )

    def apply(self) -> None:
        """Ask for the sliders' settings now."""
        self._timer.stop()
        change = self.requested_change()
        if change != SettingsChange():
            self.changeRequested.emit(change)

    def budget_at(self, position: int) -> int:
        """The budget in bytes at a slider position."""
        low, high = self._budget_range
        return low + (high - low) * position // BUDGET_STEPS

    def position_of(self, budget: int | None) -> int:
        """The slider position nearest a budget."""
        low, high = self._budget_range
        if budget is None or high <= low:
            return BUDGET_STEPS
        return min(BUDGET_STEPS, max(0, round((budget - low) * BUDGET_STEPS / (high - low))))

    def close_views(self) -> None:
        """Stop the pending-change timer."""
        self._timer.stop()

    # --- internals ---

    def _budget_enabled(self) -> bool:
        return self.info is not None and "memory_budget" not in self.info.fixed and self.info.budget_range is not None

    def _moved(self, setting: _Setting, value: int) -> None:
        setting.show(value)
        if self.info is not None:
            self._timer.start()

    def _show(self, info: ModelInfo) -> None:
        """Put the sliders at info's settings without asking for anything."""
        self.info = info
        s, fixed = info.settings, info.fixed
        for setting in self.settings():
            setting.slider.blockSignals(True)
        try:
            if info.budget_range is not None and "memory_budget" not in fixed:
                low, high = self._budget_range = info.budget_range
                self.budget.slider.setRange(0, BUDGET_STEPS)
                self.budget.slider.setPageStep(BUDGET_STEPS // 10)
                self.budget.slider.setValue(self.position_of(s.memory_budget))
                self.budget.set_enabled(True, self.tr("least {low}; every expert held at {high}").format(
                    low=format_bytes(low), high=format_bytes(high)))
                self.budget.value_label.setText(format_bytes(s.memory_budget or high))
            else:
                self._budget_range = (0, 0)
                # no range to place it in: the far end, where a streamed model holds every expert (left where the
                # last model put it, a model held whole read as one under a budget halfway)
                self.budget.slider.setRange(0, BUDGET_STEPS)
                self.budget.slider.setValue(BUDGET_STEPS)
                self.budget.set_enabled(False, fixed.get("memory_budget", self.tr("this model has no memory budget")))
                self.budget.value_label.setText(format_bytes(s.memory_budget) if s.memory_budget
                                                else self.tr("whole model"))
            self.prefetch.slider.setValue(s.prefetch_depth)
            self.prefetch.set_enabled("prefetch_depth" not in fixed, fixed.get("prefetch_depth", ""))
            self.prefetch.show(s.prefetch_depth)
            self._contexts = context_steps(info.max_context)
            if s.context_length not in self._contexts:
                self._contexts = sorted(set(self._contexts) | {s.context_length})
            self.context.slider.setRange(0, len(self._contexts) - 1)
            self.context.slider.setValue(self._contexts.index(s.context_length))
            self.context.set_enabled("context_length" not in fixed,
                                     fixed.get("context_length", self.tr("applies to the next answer's KV cache")))
            self.context.show(self.context.slider.value())
            self.io_threads.slider.setValue(s.io_threads)
            self.io_threads.set_enabled("io_threads" not in fixed, fixed.get("io_threads", ""))
            self.io_threads.show(s.io_threads)
        finally:
            for setting in self.settings():
                setting.slider.blockSignals(False)
        if all(name in fixed for name in ("memory_budget", "prefetch_depth", "io_threads", "context_length")):
            reasons = set(fixed.values())
            self.note.setText(self.tr("Every setting is {reason}.").format(reason=reasons.pop()) if len(reasons) == 1
                              else self.tr("No setting can change."))
        elif info.streaming == "experts":
            self.note.setText(self.tr("Experts stream from disk: a smaller budget keeps fewer in memory (more reads, "
                                      "more I/O wait)."))
        elif info.streaming == "layers":
            self.note.setText(self.tr("Layers stream from disk; reopen the model to change its budget."))
        else:
            self.note.setText(fixed.get("memory_budget", ""))
