"""What the expert store knows of its read-ahead: the guesses of each layer's next step and how they scored, the
experts read ahead and not yet used, and how often each of a guess's first ranks was right when its expert was not
in memory (which decides whether a guess the store refuses is read through a scratch slot instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.offload.store_types import Key, PrefetchStats
from engine.offload.story import ExpertLog
from engine.telemetry import Telemetry

# A guess the store refuses (its expert is worth less than the one it would push out) is read through a scratch slot
# instead when it is among the first THROUGH_RANKS of its guess and that rank's absent guesses were used by their
# step at least THROUGH_PRECISION of the time lately (an average over about THROUGH_MEMORY of them). With a small
# cache the first ranks' absent guesses are mostly used and the later ones seldom, with a larger one seldom at any
# rank: a wasted read costs the disk's time, the bound where much is missed.
THROUGH_RANKS = 4
THROUGH_PRECISION = 0.5
THROUGH_MEMORY = 64


@dataclass
class GuessScore:
    """Over the layer steps guessed: experts guessed, experts the step needed, and those both."""

    predicted: int = 0
    needed: int = 0
    correct: int = 0

    def frozen(self) -> PrefetchStats:
        """The score as reported."""
        return PrefetchStats(self.predicted, self.needed, self.correct)


@dataclass
class ReadAheadCounts:
    """Experts read ahead: reads started, read ahead and then used by a step, and evicted before any step used them."""

    issued: int = 0
    used: int = 0
    wasted: int = 0


@dataclass
class RankUsage:
    """How often each of the first ranks' guesses was used by its step when its expert was not in memory: a running
    average over about THROUGH_MEMORY guesses, rank by rank."""

    scores: list[float] = field(default_factory=lambda: [0.0] * THROUGH_RANKS)   # [THROUGH_RANKS]

    def learn(self, rank: int, used: bool) -> None:
        """A guess at `rank` whose expert was absent was used by its step (or not)."""
        self.scores[rank] += (used - self.scores[rank]) / THROUGH_MEMORY

    def trusted(self, rank: int) -> bool:
        """Whether absent guesses at `rank` are used often enough to read them through a scratch slot."""
        return self.scores[rank] >= THROUGH_PRECISION


class ReadAhead:
    """The read-ahead's guesses, their scores and its counters (telemetry told of each count)."""

    def __init__(self, telemetry: Telemetry, log: ExpertLog):
        self.telemetry, self.log = telemetry, log
        self.predicted: dict[int, set[int]] = {}       # layer -> experts predicted for its next step
        self.absent: dict[int, list[tuple[int, int]]] = {}   # layer -> (rank, expert) guessed, not in memory
        self.prefetched: set[Key] = set()              # read ahead and not yet used
        self.score = GuessScore()
        self.counts = ReadAheadCounts()
        self.ranks = RankUsage()

    def guess(self, layer: int, ids: list[int], absent: list[tuple[int, int]]) -> None:
        """Note a guess of `layer`'s next step, with its first ranks' experts not in memory: (rank, expert)s."""
        self.predicted[layer] = set(ids)
        self.absent[layer] = absent

    def through(self, layer: int, absent: list[tuple[int, int]]) -> set[Key]:
        """Of a guess's absent experts, those at ranks trusted to be read through a scratch slot if refused."""
        return {(layer, i) for r, i in absent if self.ranks.trusted(r)}

    def score_step(self, layer: int, ids: list[int]) -> None:
        """`layer`'s step came: score the guess of it, if any."""
        predicted = self.predicted.pop(layer, None)
        if predicted is None:
            return
        needed = set(ids)
        for r, i in self.absent.pop(layer, ()):
            self.ranks.learn(r, i in needed)
        score = self.score
        score.predicted += len(predicted)
        score.needed += len(needed)
        score.correct += len(predicted & needed)

    def issued(self, n: int) -> None:
        """n reads ahead started."""
        self.counts.issued += n
        self.telemetry.prefetch(issued=n)

    def started(self, key: Key) -> None:
        """A read ahead of `key` started."""
        self.prefetched.add(key)

    def failed(self, key: Key) -> None:
        """A read of `key` failed: it is no longer read ahead (nor counted)."""
        self.prefetched.discard(key)

    def used(self, key: Key) -> None:
        """A step uses `key`: counted if it was read ahead."""
        if key in self.prefetched:
            self.prefetched.discard(key)
            self.counts.used += 1
            self.log.ahead_used[key] += 1
            self.telemetry.prefetch(used=1)

    def wasted(self, key: Key) -> None:
        """`key` leaves memory: counted if it was read ahead and never used."""
        if key in self.prefetched:
            self.prefetched.discard(key)
            self.counts.wasted += 1
            self.log.ahead_wasted[key] += 1
            self.telemetry.prefetch(wasted=1)
