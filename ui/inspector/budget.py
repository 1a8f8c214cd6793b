"""The budget bar: what the model's memory is made of, stacked against the memory budget.

Model memory is the process RSS minus the baseline measured before loading (`model_memory`). Its
parts come from the engine's gauges: dense weights (`dense_bytes`), the expert cache (pinned and
cached occupancy), the KV cache (`kv_bytes`); the rest is scratch: working buffers, allocator
slack and the compiled kernels, loaded after the baseline was read. The bar turns amber from
NEAR of the budget and red over it, and its text then says which part is to blame.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication, QRectF, QSize, Qt
from PySide6.QtGui import QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

from ui.inspector.common import RGB, Theme, fmt_bytes, fmt_percent

NEAR = 0.9                       # the bar turns amber from this share of the budget
AMBER: RGB = (230, 150, 20)
RED: RGB = (215, 50, 45)
# (part, label, tooltip words) in stacking order, bottom first; translated where shown
PARTS = (("dense", QT_TRANSLATE_NOOP("BudgetBar", "dense weights"),
          QT_TRANSLATE_NOOP("BudgetBar", "weights held whatever the budget: attention, norms, embeddings")),
         ("experts", QT_TRANSLATE_NOOP("BudgetBar", "cached experts"),
          QT_TRANSLATE_NOOP("BudgetBar", "routed experts in memory, pinned or cached")),
         ("kv", QT_TRANSLATE_NOOP("BudgetBar", "KV cache"),
          QT_TRANSLATE_NOOP("BudgetBar", "keys and values of the context, and earlier chats' prefixes kept for reuse")),
         ("scratch", QT_TRANSLATE_NOOP("BudgetBar", "scratch"),
          QT_TRANSLATE_NOOP("BudgetBar", "the rest: working buffers, allocator slack and the compiled kernels")))


def _tr(text: str) -> str:
    """A text of PARTS or of the functions below (marked for lupdate where written) in the language of the UI."""
    return QCoreApplication.translate("BudgetBar", text)


@dataclass(frozen=True)
class MemoryParts:
    """Model memory (bytes) and what it is made of; `scratch` is what the gauges leave unexplained."""

    total: float
    dense: float
    experts: float
    kv: float
    scratch: float
    working: float | None = None  # the planned working buffers (part of scratch), when reported

    def get(self, part: str) -> float:
        """The bytes of a part by its PARTS name."""
        return float(getattr(self, part))


def model_memory(gauges: Mapping[str, float]) -> float | None:
    """Process RSS minus the baseline before loading (bytes); None unless both gauges are reported."""
    rss, baseline = gauges.get("rss"), gauges.get("rss_baseline")
    if rss is None or baseline is None:
        return None
    return max(0.0, rss - baseline)


def memory_parts(gauges: Mapping[str, float], occupancy: Mapping[str, int]) -> MemoryParts | None:
    """Model memory split into dense weights, cached experts, KV cache and scratch; None without RSS gauges."""
    total = model_memory(gauges)
    if total is None:
        return None
    dense = float(gauges.get("dense_bytes", 0.0))
    experts = float(occupancy.get("pinned", 0) + occupancy.get("cached", 0))
    kv = float(gauges.get("kv_bytes", 0.0))
    return MemoryParts(total, dense, experts, kv, max(0.0, total - dense - experts - kv), gauges.get("working_bytes"))


def level(total: float, budget: float) -> str:
    """'ok', 'near' (from NEAR of the budget) or 'over' (beyond it)."""
    share = total / budget
    return "over" if share > 1.0 else "near" if share >= NEAR else "ok"


def describe(parts: MemoryParts | None, budget: float | None) -> str:
    """The bar's one line: model memory against the budget, and when over, the largest part to blame."""
    if budget is None and parts is None:
        return QCoreApplication.translate("BudgetBar", "no memory budget (the whole model is resident)")
    if budget is None:
        return QCoreApplication.translate(
            "BudgetBar", "model memory {size}, no budget (the whole model is resident)").format(
            size=fmt_bytes(parts.total))
    if parts is None:
        return QCoreApplication.translate("BudgetBar", "budget {size} (model memory not reported)").format(
            size=fmt_bytes(budget))
    figures = {"size": fmt_bytes(parts.total), "budget": fmt_bytes(budget), "share": fmt_percent(parts.total / budget)}
    if level(parts.total, budget) != "over":
        return QCoreApplication.translate("BudgetBar", "model memory {size} of the {budget} budget ({share})").format(
            **figures)
    name, label, _ = max(PARTS, key=lambda p: parts.get(p[0]))
    return QCoreApplication.translate(
        "BudgetBar", "model memory {size} of the {budget} budget ({share}): over by {over}, the most in {part} "
        "({part_size})").format(**figures, over=fmt_bytes(parts.total - budget), part=_tr(label),
                                part_size=fmt_bytes(parts.get(name)))


def tooltip(parts: MemoryParts | None, budget: float | None) -> str:
    """Each part in MB, what it holds, and the budget."""
    if parts is None:
        return QCoreApplication.translate("BudgetBar", "model memory is not reported (no RSS gauge)")
    lines = [describe(parts, budget)]
    lines += [f"{_tr(label)}: {parts.get(name) / 1e6:,.1f} MB ({_tr(why)})" for name, label, why in PARTS]
    if parts.working is not None:
        lines.append(QCoreApplication.translate("BudgetBar", "  of which planned working buffers: {size} MB").format(
            size=f"{parts.working / 1e6:,.1f}"))
    lines.append(QCoreApplication.translate("BudgetBar", "model memory: {size} MB").format(
        size=f"{parts.total / 1e6:,.1f}"))
    lines.append(QCoreApplication.translate("BudgetBar", "budget: {size} MB").format(size=f"{budget / 1e6:,.1f}")
                 if budget else QCoreApplication.translate("BudgetBar", "no budget"))
    return "\n".join(lines)


class BudgetBar(QWidget):
    """A stacked bar of the model memory's parts against the budget, with its text and a tooltip in MB."""

    def __init__(self, theme: Theme, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("budgetBar")
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.parts: MemoryParts | None = None
        self.budget: float | None = None
        self.state = "ok"                         # 'ok', 'near' or 'over' (see `level`)
        self._text = describe(None, None)
        self.set_theme(theme)

    def set_theme(self, theme: Theme) -> None:
        """Recolour (the parts take the theme's phase colours)."""
        self.theme = theme
        p = theme.phases
        self.colours: dict[str, RGB] = {"dense": p["dense"], "experts": p["experts"], "kv": p["attention"],
                                        "scratch": p["other"]}
        self.update()

    def set_memory(self, parts: MemoryParts | None, budget: float | None) -> None:
        """Show model memory's parts against a budget (bytes; None: no budget)."""
        self.parts, self.budget = parts, budget
        self.state = level(parts.total, budget) if parts is not None and budget else "ok"
        text = describe(parts, budget)
        if text != self._text:
            self._text = text
            self.setToolTip(tooltip(parts, budget))
            self.update()
        elif parts is not None:
            self.setToolTip(tooltip(parts, budget))

    def format(self) -> str:
        """The bar's text (as QProgressBar.format)."""
        return self._text

    def value(self) -> int:
        """Model memory per mille of the budget, at most 1000 (as a QProgressBar of range 0..1000)."""
        if self.parts is None or not self.budget:
            return 0
        return int(min(1.0, max(0.0, self.parts.total / self.budget)) * 1000)

    def sizeHint(self) -> QSize:
        return QSize(320, self.fontMetrics().height() * 2 + 6)

    def paintEvent(self, event: QPaintEvent) -> None:
        theme, painter = self.theme, QPainter(self)
        try:
            h = self.fontMetrics().height()
            bar = QRectF(0.5, 0.5, self.width() - 1.0, h + 4.0)
            painter.fillRect(bar, theme.qcolor(theme.background))
            parts, budget = self.parts, self.budget
            if parts is not None and budget:
                scale = bar.width() / max(budget, parts.total)   # over budget: the bar shows the whole, budget marked
                x = bar.left()
                for name, _, _ in PARTS:
                    w = parts.get(name) * scale
                    if w > 0:
                        painter.fillRect(QRectF(x, bar.top(), w, bar.height()), theme.qcolor(self.colours[name]))
                        x += w
                mark = bar.left() + budget * scale
                edge = {"ok": theme.muted, "near": AMBER, "over": RED}[self.state]
                painter.setPen(QPen(theme.qcolor(edge), 2))
                painter.drawLine(int(mark) - 1, int(bar.top()), int(mark) - 1, int(bar.bottom()))
            frame = {"ok": theme.muted, "near": AMBER, "over": RED}[self.state]
            painter.setPen(QPen(theme.qcolor(frame), 2 if self.state != "ok" else 1))
            painter.drawRect(bar)
            painter.setPen(theme.qcolor(RED if self.state == "over" else theme.foreground))
            painter.drawText(QRectF(0, bar.bottom() + 1, self.width(), h + 2),
                             Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                             self.fontMetrics().elidedText(self._text, Qt.TextElideMode.ElideRight, self.width()))
        finally:
            painter.end()
