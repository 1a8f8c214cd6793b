"""The search of `colibri tune`: which settings that change speed but never output are fastest here.

A `Measure` runs one fixed workload (a prompt and greedy decode steps) under a dict of settings and returns the
generated token ids and the seconds it took. The search:

1. Runs the starting settings once to warm up (kernels compile, files come into the page cache); its token ids
   are the reference, and a second run tells what a run costs. Every later run, of a candidate or of the
   baseline, must give exactly these ids: a candidate that does not is rejected and reported as an engine bug
   (a speed setting must never change the answer).
2. Tries one setting at a time (coordinate descent): each value of an axis against the current settings, in
   REPEATS rounds that alternate the order (base, cand; cand, base; ...) so that a drift of the machine's load
   hits both alike.
3. Accepts a candidate only when it is faster beyond the noise (`judge`): the median of its times beats the
   baseline's median by more than K_SPREAD times the pooled spread (each side's median absolute deviation,
   scaled to a standard deviation, pooled as a root mean square) AND by at least MIN_GAIN of the baseline's.
   An accepted candidate becomes the baseline of the next comparisons.
4. Stops starting comparisons when the next one would pass the time budget, keeping room for a final check:
   the chosen settings against the starting ones by the same rule. Only when that check passes are they the
   winner; otherwise the starting settings stay (their gains were noise).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from engine.errors import ColibriError

K_SPREAD = 2.0          # how many pooled spreads a gain must exceed
MIN_GAIN = 0.03         # and the least fraction of the baseline's time it must save
REPEATS = 5             # timed runs of each side per comparison
MAD_TO_SIGMA = 1.4826   # a normal distribution's standard deviation over its median absolute deviation

Settings = Mapping[str, Any]
Log = Callable[[str], None]


@dataclass(frozen=True)
class Trial:
    """One run of the workload: the greedy token ids it generated and its wall time."""

    tokens: tuple[int, ...]
    seconds: float


Measure = Callable[[Settings], Trial]


@dataclass(frozen=True)
class Axis:
    """One setting (an option's dest, as in colibri.toml) and the values to try."""

    key: str
    values: tuple[Any, ...]
    applies: Callable[[Settings], bool] | None = None     # tried only when this holds of the current settings


@dataclass(frozen=True)
class Verdict:
    """The noise rule's decision on two samples of wall times (seconds, lower is faster)."""

    accepted: bool
    base_median: float
    cand_median: float
    spread: float           # pooled spread, seconds
    gain: float             # (base - cand) / base of the medians
    reason: str


@dataclass(frozen=True)
class Outcome:
    """What became of one candidate."""

    key: str
    value: Any
    status: str                     # accepted | not faster | output differs | failed | skipped
    verdict: Verdict | None = None
    detail: str = ""


@dataclass(frozen=True)
class TuneResult:
    """The starting settings, the winner, the reference output and every candidate's outcome."""

    start: dict[str, Any]
    chosen: dict[str, Any]          # == start when nothing beat it beyond the noise
    tokens: tuple[int, ...]
    outcomes: tuple[Outcome, ...]
    final: Verdict | None           # chosen against start (None when nothing was accepted)
    seconds: float                  # the whole search
    fixed: tuple[str, ...] = field(default=())
    run_seconds: float = 0.0        # the slowest run after the warm-up, load included

    @property
    def changed(self) -> dict[str, Any]:
        """The settings whose value the winner changes."""
        return {k: v for k, v in self.chosen.items() if self.start.get(k) != v}

    @property
    def rejected(self) -> tuple[Outcome, ...]:
        """Candidates whose output differed from the reference: engine bugs."""
        return tuple(o for o in self.outcomes if o.status == "output differs")


def spread(times: Sequence[float]) -> float:
    """A robust standard deviation: the median absolute deviation scaled to a normal's sigma."""
    m = statistics.median(times)
    return MAD_TO_SIGMA * statistics.median(abs(t - m) for t in times)


def judge(base: Sequence[float], cand: Sequence[float], k: float = K_SPREAD, min_gain: float = MIN_GAIN) -> Verdict:
    """Accept `cand` when its median time beats `base`'s by more than k pooled spreads and by min_gain at least."""
    if len(base) < 2 or len(cand) < 2:
        raise ColibriError("the noise rule needs at least two timed runs a side")
    mb, mc = statistics.median(base), statistics.median(cand)
    pooled = ((spread(base) ** 2 + spread(cand) ** 2) / 2) ** 0.5
    gain = (mb - mc) / mb if mb > 0 else 0.0
    if mc - mb > k * pooled:
        return Verdict(False, mb, mc, pooled, gain, f"slower by {-gain * 100:.1f}%, beyond {k:g} spreads "
                       f"({(mc - mb) * 1e3:.1f} ms against {k * pooled * 1e3:.1f} ms)")
    if mb - mc <= k * pooled:
        return Verdict(False, mb, mc, pooled, gain, f"gain {gain * 100:+.1f}% within {k:g} spreads "
                       f"({(mb - mc) * 1e3:.1f} ms against {k * pooled * 1e3:.1f} ms)")
    if gain < min_gain:
        return Verdict(False, mb, mc, pooled, gain, f"gain {gain * 100:+.1f}% beyond the noise but under "
                       f"{min_gain * 100:g}%")
    return Verdict(True, mb, mc, pooled, gain, f"gain {gain * 100:+.1f}% beyond {k:g} spreads "
                   f"({(mb - mc) * 1e3:.1f} ms against {k * pooled * 1e3:.1f} ms)")


class OutputChanged(Exception):
    """A run's greedy tokens differ from the reference."""

    def __init__(self, first: int, which: str) -> None:
        super().__init__(f"{which} output differs from the reference at token {first}")
        self.first, self.which = first, which


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The index of the first token where a and b differ (the shorter length when one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class _Runner:
    """Timed runs that check every output against the reference and keep the time spent."""

    def __init__(self, measure: Measure, clock: Callable[[], float]) -> None:
        self.measure, self.clock = measure, clock
        self.reference: tuple[int, ...] | None = None
        self.worst = 0.0                # wall seconds of the slowest run so far, load included: a cautious estimate
        self.last_cost = 0.0            # wall seconds of the latest run

    def run(self, settings: Settings, which: str) -> float:
        t0 = self.clock()
        trial = self.measure(settings)
        self.last_cost = max(self.clock() - t0, trial.seconds)
        self.worst = max(self.worst, self.last_cost)
        if self.reference is None:
            self.reference = tuple(trial.tokens)
        elif tuple(trial.tokens) != self.reference:
            raise OutputChanged(first_difference(trial.tokens, self.reference), which)
        return trial.seconds

    def compare(self, base: Settings, cand: Settings, repeats: int) -> Verdict:
        """`repeats` timed runs of each, alternating which goes first; the candidate's first run goes first of all
        (a candidate whose output differs is caught before any more time is spent on it)."""
        tb: list[float] = []
        tc: list[float] = []
        for r in range(repeats):
            if r % 2 == 0:
                tc.append(self.run(cand, "the candidate's"))
                tb.append(self.run(base, "the baseline's"))
            else:
                tb.append(self.run(base, "the baseline's"))
                tc.append(self.run(cand, "the candidate's"))
        return judge(tb, tc)


def tune(measure: Measure, start: Settings, axes: Sequence[Axis], *, repeats: int = REPEATS,
         budget_seconds: float = 600.0, log: Log = lambda m: None, clock: Callable[[], float] = time.monotonic,
         fixed: Sequence[str] = ()) -> TuneResult:
    """Coordinate descent over `axes` from `start` (see the module's docstring); `fixed` names settings left alone
    because the user chose them, only for the report."""
    if repeats < 2:
        raise ColibriError(f"--repeats {repeats}: the noise rule needs at least 2 runs a side")
    t0 = clock()
    runner = _Runner(measure, clock)
    log("warm-up: the current settings once (kernels compile, files are read)")
    runner.run(dict(start), "the baseline's")
    runner.worst = 0.0                  # the warm-up's compiles say nothing of a run's cost: time one more
    runner.run(dict(start), "the baseline's")
    log(f"reference output: {len(runner.reference or ())} tokens, {runner.last_cost:.1f} s a run")
    current = dict(start)
    outcomes: list[Outcome] = []

    def cost() -> float:                # one comparison: 2 x repeats runs
        return 2 * repeats * runner.worst

    for axis in axes:
        for value in axis.values:
            if current.get(axis.key) == value or axis.applies is not None and not axis.applies(current):
                continue
            cand = {**current, axis.key: value}
            # leave room for the final check (one more comparison) after this one
            if clock() - t0 + 2 * cost() > budget_seconds:
                outcomes.append(Outcome(axis.key, value, "skipped", detail="time budget"))
                continue
            log(f"trying {axis.key} = {value} against {axis.key} = {current.get(axis.key)}")
            try:
                verdict = runner.compare(current, cand, repeats)
            except OutputChanged as exc:
                if exc.which == "the baseline's":
                    raise ColibriError(f"the current settings gave another output on a later run ({exc}): the "
                                       "engine is not deterministic here, so nothing can be tuned; please report "
                                       "it") from None
                log(f"  REJECTED {axis.key} = {value}: {exc}; a speed setting changed the answer, an engine bug")
                outcomes.append(Outcome(axis.key, value, "output differs", detail=str(exc)))
                continue
            except ColibriError as exc:
                log(f"  {axis.key} = {value} cannot run here: {exc}")
                outcomes.append(Outcome(axis.key, value, "failed", detail=str(exc)))
                continue
            status = "accepted" if verdict.accepted else "not faster"
            log(f"  {status}: {verdict.base_median:.3f} s -> {verdict.cand_median:.3f} s median, {verdict.reason}")
            outcomes.append(Outcome(axis.key, value, status, verdict))
            if verdict.accepted:
                current = cand
    final = None
    if current != dict(start):
        log(f"final check: {_describe(current, start)} against the starting settings")
        try:
            final = runner.compare(dict(start), current, repeats)
        except OutputChanged as exc:
            raise ColibriError(f"settings that gave the reference output before gave another now ({exc}): the engine "
                               "is not deterministic here; please report it") from None
        log(f"  {'confirmed' if final.accepted else 'not confirmed'}: {final.base_median:.3f} s -> "
            f"{final.cand_median:.3f} s median, {final.reason}")
        if not final.accepted:
            current = dict(start)
    return TuneResult(dict(start), current, runner.reference or (), tuple(outcomes), final, clock() - t0,
                      tuple(fixed), runner.worst)


def _describe(settings: Settings, start: Settings) -> str:
    return ", ".join(f"{k} = {v}" for k, v in settings.items() if start.get(k) != v)
