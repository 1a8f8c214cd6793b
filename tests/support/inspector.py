"""Helpers of the inspector's GUI tests (tests/gui/test_gui_inspector*.py): a `Telemetry` driven like the engine
drives it on a fake clock (`Generation`, `support.clock`), a small atlas (`tiny_atlas`), waiting for a redraw, a Brain cell's pixel,
and the check that fails a test leaving a thread, a visible window or an Inspector behind.

Import `no_leftovers` into a test module (pytest finds fixtures by name there).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from PySide6.QtCore import QCoreApplication, QEvent, QPoint, QPointF
from PySide6.QtWidgets import QApplication, QToolTip

from app.atlas.build import build_atlas
from app.atlas.probes import ProbeTopic
from engine.telemetry import Telemetry
from support.clock import FakeClock
from ui.inspector import Inspector
from ui.inspector.brain import BrainView

GB, MB = 10**9, 10**6  # decimal, as `--max-memory` and the app count


class Generation:
    """Drives a Telemetry like the engine would: 10 ms per decoded token, two experts per layer."""

    def __init__(self, n_layers: int = 4, n_experts: int = 8, history: int = 512):
        self.n_layers, self.n_experts = n_layers, n_experts
        self.clock = FakeClock()
        self.tel = Telemetry(n_layers, n_experts, history=history, clock=self.clock)
        self.t = 0
        self.tel.begin()

    def routes(self, t: int) -> list[tuple[int, tuple[int, int]]]:
        """The experts token t routes to, per layer."""
        return [(layer, ((t + layer) % self.n_experts, (t + layer + 3) % self.n_experts))
                for layer in range(self.n_layers)]

    def prefill(self, n: int) -> None:
        with self.tel.phase("attention"):
            self.clock.advance(3 * n)
        with self.tel.phase("experts"):
            self.clock.advance(2 * n)
        self.tel.end_token(n=n, prefill=True)

    def decode(self, tokens: int = 1, hits: tuple[int, int, int] = (3, 1, 4)) -> None:
        for _ in range(tokens):
            tel, clock = self.tel, self.clock
            with tel.phase("attention"):
                clock.advance(2)
            with tel.phase("dense"):
                clock.advance(1)
            with tel.phase("experts"):
                for layer, ids in self.routes(self.t):
                    tel.route(layer, np.array(ids))
                for tier, n in zip(("pinned", "cached", "disk"), hits):
                    tel.hit(tier, n)
                with tel.phase("io_wait"):
                    clock.advance(4)
                clock.advance(2)
            with tel.phase("sampling"):
                clock.advance(0.5)
            clock.advance(0.5)  # other
            tel.end_token()
            self.t += 1

    def current(self) -> list[tuple[int, tuple[int, int]]]:
        """The routes of the latest token."""
        return self.routes(self.t - 1)


def tiny_atlas(n_layers: int = 4, n_experts: int = 8, n_topics: int = 3) -> dict:
    """An atlas in the sidecar's format: expert e prefers topic e % n_topics; expert 1 of layer 0 is never chosen."""
    topics = [ProbeTopic(f"topic{t}", f"Topic {t}", ("a b c", "d e f")) for t in range(n_topics)]
    counts = {}
    for layer in range(n_layers):
        c = np.ones((n_experts, n_topics, 2), np.int64)
        for e in range(n_experts):
            c[e, e % n_topics] += 20 + e + layer
        counts[layer] = c
    counts[0][1] = 0
    tokens = np.full((n_topics, 2), 50, np.int64)
    return build_atlas(Path("/models/tiny"), topics, counts, tokens, "0" * 64, "tests")


@pytest.fixture(autouse=True)
def no_leftovers(qtbot):
    """Fail a test that leaves a thread, a visible window or an Inspector (with its timer) behind."""
    before = set(threading.enumerate())
    yield
    # pytest-qt has closed the widgets given to qtbot.addWidget; let their deleteLater run
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    QCoreApplication.processEvents()
    QToolTip.hideText()
    qtbot.waitUntil(lambda: not [w for w in QApplication.topLevelWidgets() if w.isVisible()], timeout=3000)
    assert not [w for w in QApplication.allWidgets() if isinstance(w, Inspector)], "an Inspector outlived its test"
    assert set(threading.enumerate()) <= before, "a thread outlived its test"


def redraw(qtbot, insp: Inspector) -> None:
    """Wait for the next timer tick that redraws."""
    n = insp.redraws
    qtbot.waitUntil(lambda: insp.redraws > n, timeout=3000)


def cell_point(brain: BrainView, layer: int, expert: int) -> QPoint:
    """Viewport pixel at the centre of a Brain cell."""
    scene = brain.plot.getViewBox().mapViewToScene(QPointF(expert + 0.5, layer + 0.5))
    return brain.view.mapFromScene(scene)
