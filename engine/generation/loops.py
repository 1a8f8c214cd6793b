"""Loops in generated text: the tail of a token sequence that repeats one period of n tokens k times.

Small models at low temperature fall into loops (one sentence twenty times, a thousand `=`); a front end
watches each token and stops the answer when the tail has become periodic. A period-n loop at the tail means
tokens[i] == tokens[i - n] for every i of the last (k - 1) * n positions, so `LoopDetector` keeps, for each
period n, how many positions in a row ended with that equality: each new token costs O(max_period), whatever
the length of the answer. `find_loop` computes the same from a whole sequence (tests, and callers without a
detector), and `trim_loop` cuts a sequence to one copy of its loop.

A loop is reported when it repeats at least `min_repeats` times and covers at least `min_tokens` tokens, so
that short periods (a run of one token) need many copies and long ones (a sentence) a few.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

MAX_PERIOD = 128    # longest period looked for, in tokens (a long sentence)
MIN_REPEATS = 3     # a period seen fewer times is no loop
MIN_TOKENS = 48     # nor is a periodic tail shorter than this (a run of 10 spaces, a `----` rule)


@dataclass(frozen=True)
class Loop:
    """A periodic tail: tokens[start:] repeats its first `period` tokens (the last copy may be partial)."""

    period: int     # n, in tokens
    start: int      # index of the first token of the periodic tail
    length: int     # tokens in the periodic tail (>= period * min_repeats)

    @property
    def repeats(self) -> int:
        """Whole copies of the period in the tail."""
        return self.length // self.period


def _check(max_period: int, min_repeats: int, min_tokens: int) -> None:
    if max_period < 1 or min_repeats < 2 or min_tokens < 2:
        raise ValueError(f"loop detection needs max_period >= 1, min_repeats >= 2 and min_tokens >= 2, not "
                         f"{max_period}, {min_repeats} and {min_tokens}")


def _is_loop(period: int, run: int, min_repeats: int, min_tokens: int) -> bool:
    """Whether a tail of run + period periodic tokens is long enough to count (run: equalities at distance n)."""
    length = run + period
    return length >= period * min_repeats and length >= min_tokens


def find_loop(tokens: Sequence[int] | np.ndarray, max_period: int = MAX_PERIOD, min_repeats: int = MIN_REPEATS,
              min_tokens: int = MIN_TOKENS) -> Loop | None:
    """The loop at the end of tokens (its shortest period), or None."""
    _check(max_period, min_repeats, min_tokens)
    ids = np.asarray(tokens, dtype=np.int64)     # [L]
    for period in range(1, min(max_period, len(ids) - 1) + 1):
        same = ids[period:] == ids[:-period]    # [L - n]: token i equals token i - n
        mismatch = np.flatnonzero(~same)
        run = len(same) - 1 - int(mismatch[-1]) if len(mismatch) else len(same)
        if _is_loop(period, run, min_repeats, min_tokens):
            return Loop(period, len(ids) - run - period, run + period)
    return None


def trim_loop(tokens: Sequence[int], loop: Loop, keep: int = 1) -> list[int]:
    """tokens with the loop cut to its first `keep` copies (what came before it stays)."""
    if keep < 0:
        raise ValueError(f"keep is a number of copies (0 or more), not {keep}")
    return list(tokens[: loop.start + min(loop.length, keep * loop.period)])


class LoopDetector:
    """Fed one token at a time, says when the tokens so far end in a loop (the same answer as find_loop)."""

    def __init__(self, max_period: int = MAX_PERIOD, min_repeats: int = MIN_REPEATS, min_tokens: int = MIN_TOKENS):
        _check(max_period, min_repeats, min_tokens)
        self.max_period, self.min_repeats, self.min_tokens = max_period, min_repeats, min_tokens
        self._recent = np.zeros(max_period + 1, dtype=np.int64)   # ring of the last max_period + 1 ids
        self._runs = np.zeros(max_period + 1, dtype=np.int64)     # [n]: tokens[i] == tokens[i - n] for the last runs[n] i
        self._periods = np.arange(max_period + 1)
        self.count = 0

    def push(self, token: int) -> Loop | None:
        """Add the next token; the loop the tokens now end in, or None."""
        size = len(self._recent)
        back = self._recent[(self.count - self._periods) % size]   # [n]: tokens[count - n] (garbage where n > count)
        same = (back == token) & (self._periods >= 1) & (self._periods <= self.count)
        self._runs = np.where(same, self._runs + 1, 0)
        self._recent[self.count % size] = token
        self.count += 1
        lengths = self._runs + self._periods                                    # [n]
        hits = np.flatnonzero((lengths >= self._periods * self.min_repeats) & (lengths >= self.min_tokens)
                              & (self._periods >= 1) & (self._periods < self.count))
        if not len(hits):
            return None
        period = int(hits[0])
        return Loop(period, self.count - int(lengths[period]), int(lengths[period]))

    def reset(self) -> None:
        """Forget the tokens seen (a new answer)."""
        self._runs[:] = 0
        self.count = 0
