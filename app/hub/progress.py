"""What `pull` and `convert` report while they work: typed events, and the text line the CLI prints for each.

A job calls its `Report` callback with a `Note` (news without a measure) or a `Progress` (DONE of
TOTAL units of one stage). The CLI prints `render(event)`; the GUI reads the fields. A callback
may raise to stop the job at its next event (the GUI's Cancel does so). When a pull makes a
model from another (upcycling, then converting), the events of that step carry the model's name.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Note:
    """A line of news: what starts, what was found, what is ready."""

    message: str
    model: str = ""         # the model a pull is making when this was said; "" for the job itself


@dataclass(frozen=True)
class Progress:
    """DONE of TOTAL units of STAGE are finished; MESSAGE says it in words.

    Stages: "write" (tensors written by convert) and "upcycle" (moefy, in fractions of 1).
    """

    stage: str
    done: float             # a count (tensors), or a fraction of TOTAL = 1.0 where the work has no natural unit
    total: float
    message: str
    model: str = ""         # as in Note
    waiting: bool = False   # said during a step that reports nothing (a compile): DONE is where it stands, not stuck

    @property
    def fraction(self) -> float:
        """DONE / TOTAL, 0 to 1 (0 when TOTAL is 0)."""
        return min(max(self.done / self.total, 0.0), 1.0) if self.total else 0.0


HubEvent = Note | Progress
Report = Callable[[HubEvent], None]
Log = Callable[[str], None]


def render(event: HubEvent) -> str:
    """The line the CLI prints for EVENT; a step of a pull is indented under the model it makes."""
    if not event.model:
        return event.message
    share = f"{event.done / event.total * 100:3.0f}% " if isinstance(event, Progress) and event.total else ""
    return f"  {event.model}: {share}{event.message}"


def to_stderr(event: HubEvent) -> None:
    """Print EVENT's line on stderr (what the `pull` and `convert` commands show)."""
    print(render(event), file=sys.stderr, flush=True)


def as_lines(log: Log) -> Report:
    """A Report that hands each event's line to LOG."""

    def report(event: HubEvent) -> None:
        log(render(event))

    return report


def reporter(progress: Report | None, log: Log | None, default: Report) -> Report:
    """The callback a job reports to: PROGRESS, else LOG fed with lines, else DEFAULT."""
    if progress is not None:
        return progress
    return as_lines(log) if log is not None else default


def noting(report: Report, model: str = "") -> Log:
    """A text log (for helpers that say lines) whose lines reach REPORT as Notes."""

    def log(message: str) -> None:
        report(Note(message, model))

    return log
