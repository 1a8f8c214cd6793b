"""Replacement policies for the routed-expert RAM cache, and the simulator that scores them.

A key is `(layer, expert)`; all experts have the same size, so capacity counts experts. A trace
is the sequence of MoE layer steps, `(layer, expert ids needed together)`, in execution order.
`simulate` replays a trace through a policy; `belady` gives the offline optimum at the same
capacity, the ceiling any policy is measured against.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import AbstractSet, Protocol, runtime_checkable

import numpy as np

Key = tuple[int, int]                      # (layer, expert)
Trace = Sequence[tuple[int, Sequence[int]]]  # [(layer, distinct expert ids of one step)]

# The half-life of a use, in tokens (the policies count layer steps: pass tokens * n_layers).
# Synthetic Zipf traces (tests/offload/test_policy.py) want a long memory when stationary (>= 64
# tokens) and a short one when the topic drifts (8-16); recorded chat traces want a few tokens at
# small caches. No single value fits every workload, so the store learns it: `tune_half_life`
# replays the session's recent steps at each of HALF_LIFE_CHOICES and the usage history keeps the
# winner for the next start.
DEFAULT_HALF_LIFE_TOKENS = 4.0
HALF_LIFE_CHOICES = (1.0, 2.0, 4.0, 8.0, 16.0, 64.0)
LFRU_HALF_LIFE = 512.0                     # steps: the policies' default when the caller names none
# The hottest key by history counts 1 + 2 per use: a few more hits than LFRU on stationary traces,
# about as many on drifting ones, and a prior of the wrong experts costs little.
LEARNED_PRIOR_WEIGHT = 2.0

_RENORM_EXPONENT = 256.0                   # rescale scores once increments reach 2**this


class Policy(Protocol):
    """Which cached key to give up; told of every use, insertion and removal by the cache."""

    name: str

    def access(self, key: Key, now: int) -> None:
        """`key` was used at step `now` (a hit, just loaded, or streamed through)."""

    def access_many(self, keys: Sequence[Key], now: int) -> None:
        """`access` of each of `keys` at step `now` (the uses of one layer step), in order."""

    def insert(self, key: Key, now: int) -> None:
        """`key` entered the cache."""

    def remove(self, key: Key) -> None:
        """`key` left the cache."""

    def victim(self, exclude: AbstractSet[Key]) -> Key:
        """The cached key to evict, never one in `exclude`; LookupError when there is none."""


@runtime_checkable
class ValuingPolicy(Policy, Protocol):
    """A policy that values keys (frequency policies): it may admit a newcomer only by value."""

    admission: bool                 # whether a newcomer must be worth at least the key it would push out

    def score(self, key: Key) -> float:
        """The key's value now; comparable between keys."""

    def admit(self, key: Key, victim: Key) -> bool:
        """Whether `key` should replace `victim` (else it is read through, not kept)."""


class LRU:
    """Evict the cached key used least recently."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()   # oldest use first

    def access(self, key: Key, now: int) -> None:
        """Mark a cached key as the most recent; uses of keys not cached are ignored."""
        if key in self._order:
            self._order.move_to_end(key)

    def access_many(self, keys: Sequence[Key], now: int) -> None:
        """`access` of each of `keys`, in order."""
        order = self._order
        for key in keys:
            if key in order:
                order.move_to_end(key)

    def insert(self, key: Key, now: int) -> None:
        """Add `key` as the most recent."""
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        """Forget `key`."""
        self._order.pop(key, None)

    def victim(self, exclude: AbstractSet[Key]) -> Key:
        """The oldest cached key not in `exclude`."""
        for key in self._order:            # excluded keys are the current step's: near the end
            if key not in exclude:
                return key
        raise LookupError("no cached key outside the excluded ones")


class LFRU:
    """Evict the cached key of lowest decayed use count (each use worth 1, halving every
    `half_life` steps); ties go to the older last use.

    Counts outlive eviction, so a key that comes back brings its past with it: a one-off scan
    enters with a count of 1 and leaves first, while the hot set keeps its standing.
    Decay is lazy: a use at step t adds 2**(t / half_life) (rescaled now and then) instead of
    every count shrinking each step; the order is the same, and scores change only when their
    key is used, so a heap with stale entries skipped finds the victim.
    """

    name = "lfru"

    def __init__(self, half_life: float = LFRU_HALF_LIFE, admission: bool = False):
        self.admission = admission
        if not half_life > 0:
            raise ValueError(f"half_life must be > 0 steps, got {half_life}")
        self.half_life = float(half_life)
        self._base = 0                      # step at which an increment is worth 1
        self._count: dict[Key, float] = {}  # scaled decayed count: true count * 2**((base - now) / h)
        self._last: dict[Key, int] = {}
        self._cached: set[Key] = set()
        self._heap: list[tuple[float, int, Key]] = []  # (score, last use, key); stale entries skipped

    def _weight(self, key: Key) -> float:
        """How much a use of `key` counts (1; the learned policy weighs by its prior)."""
        return 1.0

    def _score(self, key: Key) -> float:
        return self._count.get(key, 0.0) * self._weight(key)

    def _push(self, key: Key) -> None:
        heapq.heappush(self._heap, (self._score(key), self._last.get(key, -1), key))
        if len(self._heap) > 4 * len(self._cached) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(self._score(k), self._last.get(k, -1), k) for k in self._cached]
        heapq.heapify(self._heap)

    def access(self, key: Key, now: int) -> None:
        """Add one use at step `now` (counted for keys outside the cache too)."""
        exponent = (now - self._base) / self.half_life
        if exponent > _RENORM_EXPONENT:    # keep the scaled counts inside float range
            scale = 2.0 ** -exponent
            self._count = {k: c * scale for k, c in self._count.items() if c * scale > 1e-300}
            self._last = {k: t for k, t in self._last.items() if k in self._count or k in self._cached}
            self._base, exponent = now, 0.0
            self._rebuild()
        self._count[key] = self._count.get(key, 0.0) + 2.0 ** exponent
        self._last[key] = now
        if key in self._cached:
            self._push(key)

    def access_many(self, keys: Sequence[Key], now: int) -> None:
        """`access` of each of `keys` at step `now`, in order: the same counts and heap entries, the step's increment
        worked out once (a fused token counts many uses at once, on the path between two tokens)."""
        if (now - self._base) / self.half_life > _RENORM_EXPONENT:
            for key in keys:                # the first rescales, as `access` does
                self.access(key, now)
            return
        inc = 2.0 ** ((now - self._base) / self.half_life)
        count, last, cached, heap, weight = self._count, self._last, self._cached, self._heap, self._weight
        for key in keys:
            c = count[key] = count.get(key, 0.0) + inc
            last[key] = now
            if key in cached:
                heapq.heappush(heap, (c * weight(key), now, key))
        if len(heap) > 4 * len(cached) + 64:
            self._rebuild()

    def insert(self, key: Key, now: int) -> None:
        """`key` entered the cache (its past uses still count)."""
        self._cached.add(key)
        self._last.setdefault(key, now)
        self._push(key)

    def remove(self, key: Key) -> None:
        """`key` left the cache; its count is kept."""
        self._cached.discard(key)

    def score(self, key: Key) -> float:
        """The key's value now (decayed, prior-weighted use count); comparable between keys."""
        return self._score(key)

    def admit(self, key: Key, victim: Key) -> bool:
        """Whether `key` (on its past uses, before this one) should replace `victim`, or be read through.

        With admission on, a newcomer must score at least as high as the key it would push out: when a
        token's experts outnumber the cache, the cache keeps its best keys instead of cycling through all.
        """
        return not self.admission or self._score(key) >= self._score(victim)

    def victim(self, exclude: AbstractSet[Key]) -> Key:
        """The cached key of lowest score outside `exclude` (older last use on ties)."""
        held = []
        try:
            while self._heap:
                score, last, key = self._heap[0]
                if key not in self._cached or score != self._score(key) or last != self._last.get(key, -1):
                    heapq.heappop(self._heap)          # stale: evicted or used since
                elif key in exclude:
                    held.append(heapq.heappop(self._heap))
                else:
                    return key
            raise LookupError("no cached key outside the excluded ones")
        finally:
            for entry in held:
                heapq.heappush(self._heap, entry)


class Learned(LFRU):
    """LFRU whose uses are weighted by a prior (routing counts from usage history): a use of a
    key counts 1 + prior_weight * prior / max(prior), so the hottest key by history is worth
    1 + prior_weight online uses per use and needs log2(1 + prior_weight) more half-lives idle
    before it falls below a cold key used as often.

    The weight multiplies uses rather than adding a constant so scores still change only on use
    (the lazy heap of LFRU); a shifted workload still wins, after a few half-lives.
    """

    name = "learned"

    def __init__(self, prior: Mapping[Key, float] | np.ndarray, half_life: float = LFRU_HALF_LIFE,
                 prior_weight: float = LEARNED_PRIOR_WEIGHT, admission: bool = True):
        super().__init__(half_life, admission)
        if not prior_weight >= 0:
            raise ValueError(f"prior_weight must be >= 0, got {prior_weight}")
        if isinstance(prior, np.ndarray):
            if prior.ndim != 2:
                raise ValueError(f"prior array must be [layers, experts], got shape {prior.shape}")
            prior = {(int(l), int(e)): float(prior[l, e]) for l, e in zip(*np.nonzero(prior))}
        values = np.fromiter(prior.values(), np.float64, len(prior))
        if not np.all(np.isfinite(values)) or np.any(values < 0):
            raise ValueError("prior counts must be finite and >= 0")
        top = float(values.max()) if len(values) else 0.0
        scale = prior_weight / top if top > 0 else 0.0
        self._weights = {k: 1.0 + scale * float(v) for k, v in prior.items()}

    def _weight(self, key: Key) -> float:
        return self._weights.get(key, 1.0)


POLICIES = ("lru", "lfru", "learned")


def wants_admission(capacity: int, experts_per_token: int) -> bool:
    """Admit by value when a token's experts would fill most of the cache: recency then only cycles.

    On recorded chat traces admission lifts LFRU's hits well when a token's experts nearly fill the
    cache, and costs a little when the cache holds twice as many.
    """
    return capacity < 2 * experts_per_token


def make_policy(name: str, prior: Mapping[Key, float] | np.ndarray | None = None, *,
                half_life: float = LFRU_HALF_LIFE, admission: bool | None = None) -> Policy:
    """The policy called `name` ("lru", "lfru" or "learned"; "learned" needs `prior`).

    admission: None keeps each policy's default (LFRU off, learned on); see `wants_admission`.
    """
    if name == "lru":
        return LRU()
    if name == "lfru":
        return LFRU(half_life, bool(admission))
    if name == "learned":
        if prior is None:
            raise ValueError("the learned policy needs a prior (usage history counts [layers, experts])")
        return Learned(prior, half_life, admission=True if admission is None else admission)
    raise ValueError(f"unknown cache policy {name!r}: use one of {', '.join(POLICIES)}")


def tune_half_life(trace: Trace, capacity: int, n_layers: int, prior: Mapping[Key, float] | np.ndarray | None = None,
                   pinned: AbstractSet[Key] = frozenset(), admission: bool = False,
                   choices: Sequence[float] = HALF_LIFE_CHOICES) -> float:
    """The half-life in tokens, among `choices`, whose policy (learned with `prior`, else LFRU) hits most
    often replaying `trace` at `capacity` with `pinned` held; ties go to the one nearest the default."""
    if not choices:
        raise ValueError("tune_half_life needs at least one half-life to try")

    def hits(tokens: float) -> int:
        steps = tokens * n_layers
        policy = (make_policy("learned", prior, half_life=steps, admission=admission) if prior is not None
                  else make_policy("lfru", half_life=steps, admission=admission))
        return simulate(trace, capacity, policy, pinned).hits

    return max(choices, key=lambda h: (hits(h), -abs(np.log2(h / DEFAULT_HALF_LIFE_TOKENS))))


@dataclass(frozen=True)
class SimResult:
    """Accesses and hits of one replayed trace."""

    accesses: int
    hits: int

    @property
    def hit_rate(self) -> float:
        """Hits per access (0 for an empty trace)."""
        return self.hits / self.accesses if self.accesses else 0.0


def _free_slots(capacity: int, pinned: AbstractSet[Key]) -> int:
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0 experts, got {capacity}")
    if len(pinned) > capacity:
        raise ValueError(f"{len(pinned)} pinned experts do not fit a capacity of {capacity}")
    return capacity - len(pinned)


def _step_keys(layer: int, ids: Sequence[int]) -> list[Key]:
    keys = [(int(layer), int(e)) for e in ids]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a step of layer {layer} lists an expert twice: {list(ids)}")
    return keys


def simulate(trace: Trace, capacity: int, policy: Policy,
             pinned: AbstractSet[Key] = frozenset()) -> SimResult:
    """Replay a trace through a cache of `capacity` experts (pinned ones count against capacity and always hit)."""
    slots = _free_slots(capacity, pinned)
    cached: set[Key] = set()
    accesses = hits = 0
    for now, (layer, ids) in enumerate(trace):
        keys = _step_keys(layer, ids)
        step = frozenset(keys)             # all resident together: none evictable this step
        accesses += len(keys)
        for key in keys:
            if key in pinned:
                hits += 1
                continue
            if key in cached:
                hits += 1
                policy.access(key, now)
                continue
            if len(cached) >= slots:
                try:
                    old = policy.victim(step) if slots else None
                except LookupError:
                    old = None
                if old is None:            # no room this step: streamed through, not kept
                    policy.access(key, now)
                    continue
                if old not in cached or old in step:
                    raise RuntimeError(f"policy {policy.name} chose {old}, which it may not evict")
                admit = getattr(policy, "admit", lambda k, v: True)(key, old)   # judged on its past uses
                policy.access(key, now)
                if not admit:
                    continue               # not worth a place: read through, the victim stays
                cached.remove(old)
                policy.remove(old)
                cached.add(key)
                policy.insert(key, now)
                continue
            cached.add(key)
            policy.insert(key, now)
            policy.access(key, now)
    return SimResult(accesses, hits)


def belady(trace: Trace, capacity: int, pinned: AbstractSet[Key] = frozenset()) -> SimResult:
    """The offline optimum (evict the key whose next use is farthest in the future) at the same capacity.

    A missed key whose own next use is the farthest is streamed through instead of kept
    (bypass), and a step's overflow is its farthest-needed keys, so this bounds every policy
    (an exhaustive search in the tests agrees on small traces).
    """
    slots = _free_slots(capacity, pinned)
    steps = [_step_keys(layer, ids) for layer, ids in trace]
    # Rank every use by the sequence of steps it is needed at from then on (lexicographic), so
    # keys needed at the same next step are told apart by the uses after it.
    never = sum(len(keys) for keys in steps)
    following: list[list[int]] = [[] for _ in steps]  # per step, per key: rank of its next use
    seen: dict[Key, int] = {}                          # key -> rank of its nearest later use
    rank = never
    for t in range(len(steps) - 1, -1, -1):
        following[t] = [seen.get(k, never) for k in steps[t]]
        for n, k in sorted(zip(following[t], steps[t]), reverse=True):
            rank -= 1
            seen[k] = rank
    nxt: dict[Key, int] = {}               # cached key -> rank of its next use
    heap: list[tuple[int, Key]] = []       # (-rank of next use, key); stale entries skipped
    accesses = hits = 0
    for t, keys in enumerate(steps):
        accesses += len(keys)
        step = set(keys)
        # Misses nearest-needed first, so the step's own overflow is the farthest-needed part.
        for n, key in sorted(zip(following[t], keys)):
            if key in pinned:
                hits += 1
            elif key in nxt:
                hits += 1
                nxt[key] = n
                heapq.heappush(heap, (-n, key))
            elif slots and len(nxt) < slots:
                nxt[key] = n
                heapq.heappush(heap, (-n, key))
            elif slots:
                held = []
                while heap and (nxt.get(heap[0][1]) != -heap[0][0] or heap[0][1] in step):
                    entry = heapq.heappop(heap)
                    if nxt.get(entry[1]) == -entry[0]:
                        held.append(entry)       # current, but needed this step
                if heap and -heap[0][0] > n:     # a cached key is needed later than this one
                    _, old = heapq.heappop(heap)
                    del nxt[old]
                    nxt[key] = n
                    heapq.heappush(heap, (-n, key))
                for entry in held:
                    heapq.heappush(heap, entry)
        if len(heap) > 4 * len(nxt) + 64:
            heap = [(-n, k) for k, n in nxt.items()]
            heapq.heapify(heap)
    return SimResult(accesses, hits)
