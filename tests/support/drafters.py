"""Drafters whose guesses a test decides: right every time, or wrong every time."""

from __future__ import annotations

import numpy as np


class Oracle:
    """Drafts the continuation a plain run produced (always right), or one token off it (never right)."""

    def __init__(self, sequence: list[int], vocab: int, wrong: bool = False):
        self.sequence, self.vocab, self.wrong = list(sequence), vocab, wrong
        self.calls = 0

    def propose(self, context: np.ndarray, k: int) -> list[int]:
        """The plain run's next k tokens after `context` (each shifted by one when wrong)."""
        n = len(context)
        assert list(context) == self.sequence[:n], "speculative decoding strayed from plain decoding"
        self.calls += 1
        draft = self.sequence[n : n + k]
        return [(t + 1) % self.vocab for t in draft] if self.wrong else draft
