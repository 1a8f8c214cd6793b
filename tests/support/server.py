"""Helpers of the server tests."""

from __future__ import annotations

import time

from engine.generation.scheduler import Scheduler


def paced(monkeypatch, seconds=0.02):
    """Every scheduler step takes at least `seconds` while the test runs: an answer then cannot end before the
    test's client has left or been refused, however fast the machine decodes (the tiny model's 200 tokens take
    a fraction of a second)."""
    step = Scheduler.step

    def slow(self):
        time.sleep(seconds)
        return step(self)

    monkeypatch.setattr(Scheduler, "step", slow)
