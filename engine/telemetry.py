"""Live telemetry of generation: per-token phase times, tier hits and I/O, occupancy, expert heat.

The engine thread records into plain counters (no lock on the hot path); `end_token` closes a
per-token record and commits everything under a lock, so a `Snapshot` taken from any thread is
a consistent cut at a token boundary. Front ends subscribe for frozen snapshots (the GUI at
<= 30 Hz, the server as server-sent events through `Snapshot.to_dict`).

Typical use on the engine thread:

    tel.begin()                                  # a generation starts: wall time counts from here
    with tel.phase("attention"): ...
    with tel.phase("experts"):
        tel.route(layer, topk_ids)               # [k] for one token, [T, k] for a prefill chunk
        with tel.phase("io_wait"): ...           # counted to io_wait only, not to experts
    tel.end_token()                              # or end_token(n=T, prefill=True) for a chunk
    ...
    tel.flush()                                  # subscribers throttled out of the last state get it

`phase(name)` returns one reused object per phase, so a loop may look it up once. Heat decays
lazily (a scale factor) and routes are counted in batches, so a token costs tens of microseconds.
Recording methods belong to one thread (the engine's); reports from an I/O thread go through it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

PHASES = ("attention", "dense", "experts", "io_wait", "sampling", "other")
TIERS = ("pinned", "cached", "disk")

_TIMED = PHASES[:-1]  # "other" is never timed: it is what the timed phases leave of the wall time
_S = 1e9  # ns per second; dividing (not multiplying by 1e-9) keeps 7_750_000 ns == 0.00775 s

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenTimes:
    """Seconds spent per phase by one decoded token, or by a prefill chunk of n tokens."""

    n: int
    prefill: bool
    wall: float         # since the previous record (or `begin`)
    attention: float
    dense: float
    experts: float
    io_wait: float
    sampling: float
    other: float        # wall minus the timed phases, never below 0

    def to_dict(self) -> dict:
        """Plain values for JSON."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: Mapping) -> TokenTimes:
        """The inverse of to_dict; KeyError names a missing field."""
        return cls(int(d["n"]), bool(d["prefill"]), *(float(d[name]) for name in ("wall", *PHASES)))


@dataclass(frozen=True, eq=False)
class Snapshot:
    """A consistent, immutable view of the telemetry as of one committed token boundary."""

    seq: int                        # one more per committed state (end_token, flush, reset)
    tokens: int                     # decoded tokens so far
    prefill_tokens: int
    recent: tuple[TokenTimes, ...]  # the last `history` records, oldest first
    averages: Mapping[str, float]   # mean seconds per decoded token, per phase and "wall", over `recent`
    tok_per_s: float                # decoded tokens / their wall time, over `recent`
    hits: Mapping[str, int]         # experts found per tier ("disk": misses read from disk)
    hit_rate: float                 # (pinned + cached) / all hits, 0 when none
    bytes_read: int
    prefetch_issued: int
    prefetch_used: int
    prefetch_wasted: int
    occupancy: Mapping[str, int]    # bytes held per tier
    gauges: Mapping[str, float]
    heat: np.ndarray                # [L, E] float32 decayed routing counts, read-only copy
    current: tuple[tuple[int, tuple[int, ...]], ...]  # (layer, expert ids) of the latest token

    def to_dict(self, recent: int | None = None) -> dict:
        """JSON-serialisable plain values; `recent` keeps only the last that many records."""
        records = self.recent if recent is None else self.recent[len(self.recent) - min(recent, len(self.recent)):]
        return {
            "seq": self.seq,
            "tokens": self.tokens,
            "prefill_tokens": self.prefill_tokens,
            "recent": [r.to_dict() for r in records],
            "averages": dict(self.averages),
            "tok_per_s": self.tok_per_s,
            "hits": dict(self.hits),
            "hit_rate": self.hit_rate,
            "bytes_read": self.bytes_read,
            "prefetch_issued": self.prefetch_issued,
            "prefetch_used": self.prefetch_used,
            "prefetch_wasted": self.prefetch_wasted,
            "occupancy": dict(self.occupancy),
            "gauges": dict(self.gauges),
            "heat": np.round(self.heat.astype(np.float64), 4).tolist(),
            "current": [[layer, list(ids)] for layer, ids in self.current],
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> Snapshot:
        """The inverse of `to_dict` (a snapshot sent over the wire); ValueError naming what is missing or malformed."""
        try:
            heat = np.array(d["heat"], np.float32)
            if heat.ndim != 2:  # [] is a model without experts; anything else must be a grid
                if heat.size:
                    raise ValueError(f"heat must be a [layers, experts] grid, got shape {heat.shape}")
                heat = heat.reshape(0, 0)
            heat.flags.writeable = False
            return cls(
                seq=int(d["seq"]),
                tokens=int(d["tokens"]),
                prefill_tokens=int(d["prefill_tokens"]),
                recent=tuple(TokenTimes.from_dict(r) for r in d["recent"]),
                averages=MappingProxyType({str(k): float(v) for k, v in d["averages"].items()}),
                tok_per_s=float(d["tok_per_s"]),
                hits=MappingProxyType({str(k): int(v) for k, v in d["hits"].items()}),
                hit_rate=float(d["hit_rate"]),
                bytes_read=int(d["bytes_read"]),
                prefetch_issued=int(d["prefetch_issued"]),
                prefetch_used=int(d["prefetch_used"]),
                prefetch_wasted=int(d["prefetch_wasted"]),
                occupancy=MappingProxyType({str(k): int(v) for k, v in d["occupancy"].items()}),
                gauges=MappingProxyType({str(k): float(v) for k, v in d["gauges"].items()}),
                heat=heat,
                current=tuple((int(layer), tuple(int(e) for e in ids)) for layer, ids in d["current"]),
            )
        except KeyError as exc:
            raise ValueError(f"a telemetry snapshot needs the field {exc.args[0]!r}") from None
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"a telemetry snapshot has a malformed field: {exc}") from None


class Subscription:
    """A callback fed by one source (a model's telemetry, the engine service, a remote server's stream) at most
    every `min_interval` s; `close` (idempotent) stops it for good. app/service hands out the same class."""

    def __init__(self, callback: Callable[[Any], None], min_interval: float = 0.0, *,
                 on_close: Callable[[Subscription], None] | None = None, max_failures: int | None = None):
        self.callback = callback
        self.min_interval = min_interval
        self.failures = 0               # exceptions raised by the callback, in all
        self.last_error: BaseException | None = None
        self.seen = -1                  # sequence number of the last delivered value (for sources that number them)
        self._on_close = on_close       # tells the source to forget this subscription
        self._max_failures = max_failures   # failures in a row that drop it; None: never dropped, each one logged
        self._interval_ns = int(min_interval * 1e9)
        self._last_ns: int | None = None  # clock of the last delivery
        self._streak = 0                # consecutive failures
        self._closed = False
        self._lock = threading.RLock()  # held while the callback runs: after close() returns it never runs again

    @property
    def closed(self) -> bool:
        """Whether the subscription was closed (or dropped after repeated failures)."""
        return self._closed

    def due(self, now_ns: int) -> bool:
        """Whether min_interval has passed since the last delivery (or nothing was delivered yet)."""
        return self._last_ns is None or now_ns - self._last_ns >= self._interval_ns

    def close(self) -> None:
        """Stop deliveries; waits for a callback running on another thread to return."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._on_close is not None:
            self._on_close(self)

    def deliver(self, value: Any, now_ns: int, seq: int = -1) -> bool:
        """Run the callback on the caller's thread; False when it raised (recorded, never raised)."""
        with self._lock:
            if self._closed:
                return True
            self._last_ns = now_ns
            self.seen = seq
            try:
                self.callback(value)
            except Exception as exc:  # a broken view must never stop generation
                self.failures += 1
                self._streak += 1
                self.last_error = exc
                if self._max_failures is None:
                    log.exception("subscriber %r failed", self.callback)
                elif self._streak >= self._max_failures:
                    log.warning("telemetry subscriber %r dropped after %d failures in a row",
                                self.callback, self._streak, exc_info=exc)
                    self.close()
                return False
            self._streak = 0
            return True

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Phase:
    """The reusable context manager of one phase; the stack, sums and mark are shared by all phases."""

    __slots__ = ("_index", "_clock", "_stack", "_acc", "_mark")

    def __init__(self, index: int, clock: Callable[[], int], stack: list[int], acc: list[int], mark: list[int]):
        self._index = index
        self._clock = clock
        self._stack = stack   # open phases, innermost last
        self._acc = acc       # [5] ns per timed phase, this token
        self._mark = mark     # [1] when the innermost open phase last started counting

    def __enter__(self) -> None:
        now = self._clock()
        stack = self._stack
        if stack:  # the enclosing phase stops counting while this one runs
            self._acc[stack[-1]] += now - self._mark[0]
        stack.append(self._index)
        self._mark[0] = now

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        now = self._clock()
        self._acc[self._stack.pop()] += now - self._mark[0]
        self._mark[0] = now


class _Heat:
    """Decayed routing counts [L, E], kept as raw * scale so a token's decay is one float multiply.

    Routes wait in `pending` with their token's weight (1 / scale) and are added in one weighted
    bincount when a snapshot needs them or FOLD tokens have piled up. Used under the Telemetry lock.
    """

    FOLD = 64

    def __init__(self, n_layers: int, n_experts: int, half_life: float):
        self.raw = np.zeros((n_layers, n_experts), np.float64)  # [L, E]
        self.scale = 1.0
        self.half_life = half_life
        self.pending: list[tuple[list[tuple[int, np.ndarray]], float]] = []  # (routes, weight) per token

    def clear(self) -> None:
        """Forget all counts (the shape stays)."""
        self.raw[...] = 0.0
        self.scale = 1.0
        self.pending = []

    def add_token(self, n: int, routes: list[tuple[int, np.ndarray]]) -> None:
        """Decay by n tokens, then count this token's routes at full weight."""
        if self.half_life != float("inf"):
            self.scale *= 0.5 ** (n / self.half_life)
        if routes:
            self.pending.append((routes, 1.0 / self.scale))
            if len(self.pending) >= self.FOLD:
                self.fold()

    def fold(self) -> None:
        """Add the pending routes to raw (grown to fit when the model's shape was not given)."""
        if not self.pending:
            return
        routes = [(layer, ids, w) for token, w in self.pending for layer, ids in token]
        self.pending = []
        sizes = [ids.size for _, ids, _ in routes]
        flat_ids = np.concatenate([ids for _, ids, _ in routes], axis=None).astype(np.int64)
        flat_layers = np.repeat(np.array([layer for layer, _, _ in routes], np.int64), sizes)
        weights = np.repeat(np.array([w for _, _, w in routes]), sizes)
        keep = flat_ids >= 0  # negative ids are padding (dropped slots)
        flat_ids, flat_layers, weights = flat_ids[keep], flat_layers[keep], weights[keep]
        if flat_ids.size:
            L, E = self.raw.shape
            need_l, need_e = int(flat_layers.max()) + 1, int(flat_ids.max()) + 1
            if need_l > L or need_e > E:
                grown = np.zeros((max(L, need_l), max(E, need_e)), np.float64)
                grown[:L, :E] = self.raw
                self.raw = grown
                L, E = grown.shape
            self.raw += np.bincount(flat_layers * E + flat_ids, weights=weights, minlength=L * E).reshape(L, E)
        if self.scale < 1e-100:  # renormalise long before float64 runs out of range
            self.raw *= self.scale
            self.scale = 1.0

    def array(self) -> np.ndarray:
        """The heat now, as a new read-only float32 [L, E] array."""
        self.fold()
        heat = (self.raw * self.scale).astype(np.float32)
        heat.flags.writeable = False
        return heat


def _noop(*args: object, **kwargs: object) -> None:
    """What every recording method of a disabled Telemetry does."""


_NULL_PHASE = contextlib.nullcontext()


class Telemetry:
    """Per-token timings, cache counters and expert heat of one engine, published as snapshots."""

    MAX_FAILURES = 3  # a subscriber whose callback raises this many times in a row is dropped

    def __init__(self, n_layers: int = 0, n_experts: int = 0, history: int = 512,
                 heat_half_life: float = 64.0, enabled: bool = True,
                 clock: Callable[[], int] = time.perf_counter_ns):
        if history < 1:
            raise ValueError(f"telemetry history must be at least 1 record, got {history}")
        if not heat_half_life > 0:
            raise ValueError(f"heat_half_life must be a positive number of tokens (inf: no decay), got {heat_half_life}")
        self.history = history
        self.heat_half_life = float(heat_half_life)
        self._enabled = enabled
        self._clock = clock
        self._lock = threading.Lock()

        # engine thread only: the token in flight and the counts since the last commit
        self._acc = [0] * len(_TIMED)   # ns per timed phase, this token (zeroed in place: phases hold it)
        self._stack: list[int] = []     # open phases, innermost last
        self._mark = [clock()]          # when the innermost open phase last started counting
        self._token_start = self._mark[0]
        self._phases = {name: _Phase(i, clock, self._stack, self._acc, self._mark) for i, name in enumerate(_TIMED)}
        self._d_hits = dict.fromkeys(TIERS, 0)
        self._d_bytes = 0
        self._d_prefetch = [0, 0, 0]    # issued, used, wasted
        self._occupancy = dict.fromkeys(TIERS, 0)
        self._gauges: dict[str, float] = {}
        self._routes: list[tuple[int, np.ndarray]] = []  # (layer, ids copy) this token

        # committed: written under the lock, read by snapshot()
        self._subs: tuple[Subscription, ...] = ()  # replaced, never mutated, so end_token reads it lock-free
        self._callback_errors = 0
        self._heat = _Heat(n_layers, n_experts, self.heat_half_life)
        self._occupancy_c: dict[str, int] = dict(self._occupancy)
        self._gauges_c: dict[str, float] = {}
        self._clear_committed()
        self._seq = 0

        if not enabled:  # bound no-ops shadow the methods: the enabled path pays no flag check
            for name in ("begin", "add_time", "hit", "bytes_read", "prefetch", "set_occupancy",
                         "set_gauge", "route", "end_token", "flush", "reset"):
                setattr(self, name, _noop)
            self.phase = lambda name: _NULL_PHASE

    def _clear_committed(self) -> None:
        """Zero the committed counts, records and heat (the caller holds the lock or owns self)."""
        self._records: deque[TokenTimes] = deque(maxlen=self.history)
        self._records_ns: deque[tuple[int, ...]] = deque(maxlen=self.history)  # (n, wall, *phases) of decode records, else ()
        self._dec_sum = [0] * (2 + len(PHASES))  # n, wall, phases: ns sums over the decode records in `recent`
        self._tokens = 0
        self._prefill_tokens = 0
        self._hits = dict.fromkeys(TIERS, 0)
        self._bytes = 0
        self._prefetch = [0, 0, 0]
        self._heat.clear()
        self._latest: list[tuple[int, np.ndarray]] = []  # the routes of the last token
        self._cache: Snapshot | None = None

    @property
    def enabled(self) -> bool:
        """False for the no-op telemetry."""
        return self._enabled

    @property
    def callback_errors(self) -> int:
        """Exceptions raised by subscriber callbacks so far (caught, never propagated)."""
        return self._callback_errors

    # --- engine thread ---------------------------------------------------------------------

    def phase(self, name: str) -> AbstractContextManager[None]:
        """A block timed into this token's `name` bucket; an inner phase's time counts to it alone."""
        try:
            return self._phases[name]
        except KeyError:
            raise ValueError(f"unknown telemetry phase {name!r}: expected one of {_TIMED}") from None

    def add_time(self, name: str, seconds: float) -> None:
        """Count seconds measured elsewhere to a phase; inside an open phase they leave that phase, as if nested."""
        ns = int(seconds * 1e9)
        try:
            self._acc[_TIMED.index(name)] += ns
        except ValueError:
            raise ValueError(f"unknown telemetry phase {name!r}: expected one of {_TIMED}") from None
        if self._stack:
            self._acc[self._stack[-1]] -= ns

    def hit(self, tier: str, n: int = 1) -> None:
        """Count n experts found in `tier` ("disk": a miss read from disk)."""
        self._d_hits[tier] += n

    def bytes_read(self, n: int) -> None:
        """Count n bytes read from disk."""
        self._d_bytes += n

    def prefetch(self, issued: int = 0, used: int = 0, wasted: int = 0) -> None:
        """Count prefetches issued, used (hit before eviction) and wasted (evicted unused)."""
        d = self._d_prefetch
        d[0] += issued
        d[1] += used
        d[2] += wasted

    def set_occupancy(self, tier: str, nbytes: int) -> None:
        """Set the bytes `tier` holds now."""
        if tier not in self._occupancy:
            raise ValueError(f"unknown tier {tier!r}: expected one of {TIERS}")
        self._occupancy[tier] = nbytes

    def set_gauge(self, name: str, value: float) -> None:
        """Set a free-form number (rss, budget, kv bytes, prefetch recall ...)."""
        self._gauges[name] = value

    def route(self, layer: int, ids: npt.ArrayLike) -> None:
        """Record the experts a layer chose: [k] for one token or [T, k] for a chunk (negative ids are padding)."""
        if layer < 0:
            raise ValueError(f"telemetry route: layer must be >= 0, got {layer}")
        # copied: the caller may reuse its index buffer before end_token reads it
        self._routes.append((layer, ids.copy() if type(ids) is np.ndarray else np.array(ids)))

    def begin(self) -> None:
        """Mark the start of a generation: the next record's wall time counts from here, idle time is dropped."""
        now = self._clock()
        self._acc[:] = [0] * len(_TIMED)
        self._token_start = now
        self._mark[0] = now
        self._routes = []

    def end_token(self, n: int = 1, prefill: bool = False) -> None:
        """Close the record of this token (or prefill chunk of n), commit everything and notify subscribers."""
        now = self._clock()
        acc = self._acc
        if self._stack:  # a phase still open: its time so far belongs to this token
            acc[self._stack[-1]] += now - self._mark[0]
            self._mark[0] = now
        wall = now - self._token_start
        self._token_start = now
        acc = acc.copy()
        self._acc[:] = [0] * len(_TIMED)
        other = max(0, wall - sum(acc))
        rec = TokenTimes(n, prefill, wall / _S, *(a / _S for a in acc), other / _S)
        ns = () if prefill else (n, wall, *acc, other)
        routes = self._routes
        self._routes = []
        with self._lock:
            records_ns = self._records_ns
            if len(records_ns) == records_ns.maxlen:  # the oldest record leaves the window
                old = records_ns[0]
                if old:
                    self._dec_sum = [s - o for s, o in zip(self._dec_sum, old)]
            if ns:
                self._dec_sum = [s + v for s, v in zip(self._dec_sum, ns)]
                self._tokens += n
            else:
                self._prefill_tokens += n
            self._records.append(rec)
            records_ns.append(ns)
            self._heat.add_token(n, routes)
            self._latest = routes
            self._commit_counts()
        self._publish(now, force=False)

    def flush(self) -> None:
        """Commit the counts so far without closing a token, and deliver to subscribers that have not seen them."""
        with self._lock:
            if self._uncommitted():
                self._commit_counts()
        self._publish(self._clock(), force=True)

    # --- any thread ------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The state as of the last end_token / flush / reset (built once per state, then shared)."""
        with self._lock:
            if self._cache is None:
                self._cache = self._build()
            return self._cache

    def subscribe(self, callback: Callable[[Snapshot], None], min_interval: float = 0.0) -> Subscription:
        """Call `callback(snapshot)` on the engine thread at end_token, at most every min_interval seconds."""
        sub = Subscription(callback, min_interval, on_close=self._unsubscribe if self._enabled else None,
                           max_failures=self.MAX_FAILURES)
        if self._enabled:
            with self._lock:
                self._subs = self._subs + (sub,)
        return sub

    def reset(self) -> None:
        """Forget counts, records and heat (occupancy and gauges are states and stay); seq keeps growing."""
        with self._lock:
            self._clear_committed()
            self._seq += 1

    # --- internals ---------------------------------------------------------------------------

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs = tuple(s for s in self._subs if s is not sub)

    def _uncommitted(self) -> bool:
        """Whether the engine changed anything since the last commit."""
        return bool(any(self._d_hits.values()) or self._d_bytes or any(self._d_prefetch)
                    or self._occupancy != self._occupancy_c or self._gauges != self._gauges_c)

    def _commit_counts(self) -> None:
        """Move the engine's counts since the last commit into the committed state (lock held, engine thread)."""
        d_hits = self._d_hits
        for tier in TIERS:
            self._hits[tier] += d_hits[tier]
            d_hits[tier] = 0
        self._bytes += self._d_bytes
        self._d_bytes = 0
        d = self._d_prefetch
        p = self._prefetch
        p[0] += d[0]
        p[1] += d[1]
        p[2] += d[2]
        d[0] = d[1] = d[2] = 0
        self._occupancy_c = dict(self._occupancy)
        self._gauges_c = dict(self._gauges)
        self._seq += 1
        self._cache = None

    def _publish(self, now: int, force: bool) -> None:
        """Deliver the committed state to due subscribers (engine thread, lock not held)."""
        subs = self._subs
        if not subs:
            return
        seq = self._seq
        due = [s for s in subs if s.seen < seq] if force else [s for s in subs if s.due(now)]
        if due:
            snap = self.snapshot()
            for s in due:
                if not s.deliver(snap, now, snap.seq):
                    self._callback_errors += 1

    def _build(self) -> Snapshot:
        """A new Snapshot of the committed state (lock held)."""
        n, wall, *phases = self._dec_sum
        averages = {name: (ns / n / _S if n else 0.0) for name, ns in zip(PHASES, phases)}
        averages["wall"] = wall / n / _S if n else 0.0
        hits = {k: int(v) for k, v in self._hits.items()}
        total = sum(hits.values())
        latest = {layer: ids[-1] if ids.ndim > 1 else ids for layer, ids in self._latest}  # a layer's last route wins
        current = tuple((layer, tuple(e for e in latest[layer].tolist() if e >= 0)) for layer in sorted(latest))
        p = self._prefetch
        return Snapshot(
            seq=self._seq,
            tokens=self._tokens,
            prefill_tokens=self._prefill_tokens,
            recent=tuple(self._records),
            averages=MappingProxyType(averages),
            tok_per_s=n * _S / wall if wall > 0 else 0.0,
            hits=MappingProxyType(hits),
            hit_rate=(hits["pinned"] + hits["cached"]) / total if total else 0.0,
            bytes_read=int(self._bytes),
            prefetch_issued=int(p[0]),
            prefetch_used=int(p[1]),
            prefetch_wasted=int(p[2]),
            occupancy=MappingProxyType({k: int(v) for k, v in self._occupancy_c.items()}),
            gauges=MappingProxyType({k: float(v) for k, v in self._gauges_c.items()}),
            heat=self._heat.array(),
            current=current,
        )


NULL = Telemetry(enabled=False)
"""The telemetry of code given none: every recording method is a no-op."""
