"""The cache-quality meter: how well the expert cache serves its recent trace, against Belady's optimum, and
what it would serve at other budgets.

The store keeps its recent layer steps in a ring (`Accounting.recent`); `ExpertStore.cache_trace` copies them,
with what its policy needs to be replayed, into a frozen `CacheTrace` on the engine thread. `cache_quality` then
replays that trace anywhere (the inspector does so off its GUI thread): the store's policy at several capacities,
and the offline optimum at the same ones, so a plot of hit rate against budget shows a budget change's effect
before it is made. Replays start cold while the live cache was warm: at the current capacity the replay can
read a little below the live rate, the more so the shorter the trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.offload.policy import Policy, belady, make_policy, simulate, wants_admission

Step = tuple[int, tuple[int, ...]]          # (layer, distinct expert ids of one layer step)
CURVE_POINTS = 9                            # capacities a curve is replayed at, the current one among them


@dataclass(frozen=True, eq=False)
class CacheTrace:
    """A store's recent layer steps and what its policy needs to replay them at any capacity."""

    steps: tuple[Step, ...]                 # oldest first
    capacity: int                           # slots the cache has now
    slot_bytes: int                         # bytes of one slot
    n_experts: int                          # routed experts of the model (no capacity helps past them)
    policy: str                             # the policy in use: lru | lfru | learned
    half_life: float                        # the policy's half-life, in layer steps
    experts_per_token: int                  # routed experts a token uses over all layers (decides admission)
    pin_fraction: float                     # share of the slots pinned from the usage history
    prior: np.ndarray | None                # [L, E] float64 the learned policy's prior (None for the others)
    pin_counts: np.ndarray | None           # [L, E] float64 usage history counts the pins follow (None: no pins)
    hits: int                               # memory hits of the live cache over about these steps
    accesses: int                           # expert requests of the live cache over about these steps

    @property
    def live_hit_rate(self) -> float | None:
        """The live cache's share of requests served from memory over the trace (None before any request)."""
        return self.hits / self.accesses if self.accesses else None

    @property
    def requests(self) -> int:
        """Expert requests in the trace."""
        return sum(len(ids) for _, ids in self.steps)

    def distinct(self) -> int:
        """Distinct experts the trace asks for (a cache this large misses only each one's first request)."""
        return len({(layer, e) for layer, ids in self.steps for e in ids})

    def least(self) -> int:
        """The fewest slots a replay can run with: the largest step."""
        return max((len(ids) for _, ids in self.steps), default=1)


@dataclass(frozen=True, eq=False)
class CacheQuality:
    """Hit rates replayed over a trace, one per capacity in slots (ascending)."""

    capacities: np.ndarray                  # [C] int64 slots
    policy: np.ndarray                      # [C] float64 the store's policy replayed
    optimum: np.ndarray                     # [C] float64 Belady's optimum
    capacity: int                           # the store's capacity now (one of `capacities`)
    slot_bytes: int
    live: float | None                      # the live cache's hit rate over the trace
    requests: int                           # expert requests replayed

    def at(self, capacity: int) -> tuple[float, float]:
        """(policy, optimum) hit rates at one of `capacities`; KeyError for another."""
        where = np.flatnonzero(self.capacities == capacity)
        if not where.size:
            raise KeyError(f"capacity {capacity} was not replayed (replayed: {self.capacities.tolist()})")
        return float(self.policy[where[0]]), float(self.optimum[where[0]])


def curve_capacities(trace: CacheTrace, points: int = CURVE_POINTS) -> list[int]:
    """Capacities to replay: about `points`, spread geometrically from the least a step needs to the most that can
    still help (the trace's distinct experts), the current capacity always among them."""
    low = trace.least()
    high = max(low, min(trace.distinct(), trace.n_experts))
    spread = np.geomspace(low, high, max(points - 1, 1)) if high > low else np.array([low])
    return sorted({int(round(c)) for c in spread} | {max(trace.capacity, low)})


def pins_at(trace: CacheTrace, capacity: int) -> frozenset[tuple[int, int]]:
    """The experts the store would pin at `capacity` slots: its share of them, most used first (as the history
    pins them)."""
    counts = trace.pin_counts
    n = int(capacity * trace.pin_fraction)
    if counts is None or n <= 0:
        return frozenset()
    flat = counts.ravel()                                           # [L * E]
    order = np.argsort(-flat, kind="stable")[:n]                    # ties: lower key first
    return frozenset(divmod(int(i), counts.shape[1]) for i in order if flat[i] > 0)


def policy_at(trace: CacheTrace, capacity: int) -> Policy:
    """A fresh policy of the store's kind for a cache of `capacity` slots."""
    admission = wants_admission(capacity, trace.experts_per_token) if trace.policy != "lru" else False
    if trace.policy == "learned" and trace.prior is not None:
        return make_policy("learned", trace.prior, half_life=trace.half_life, admission=admission)
    name = "lfru" if trace.policy == "learned" else trace.policy
    return make_policy(name, half_life=trace.half_life, admission=admission)


def replay(trace: CacheTrace, capacity: int) -> tuple[float, float]:
    """(policy, optimum) hit rates of the trace at `capacity` slots, both with the experts the store would pin."""
    pins = pins_at(trace, capacity)
    ours = simulate(trace.steps, capacity, policy_at(trace, capacity), pins)
    best = belady(trace.steps, capacity, pins)          # pins start in memory: the optimum's ceiling has them too
    return ours.hit_rate, best.hit_rate


def cache_quality(trace: CacheTrace, capacities: Sequence[int] | None = None,
                  cancelled: Callable[[], bool] = lambda: False) -> CacheQuality | None:
    """Replay the trace at each capacity (default: `curve_capacities`); None if `cancelled()` turns true between
    two replays. Capacities under the largest step are raised to it (a step's experts are in memory together)."""
    chosen = sorted({max(int(c), trace.least()) for c in (capacities or curve_capacities(trace))})
    current = max(trace.capacity, trace.least())
    if current not in chosen:
        chosen = sorted(chosen + [current])
    ours = np.zeros(len(chosen), np.float64)                        # [C]
    best = np.zeros(len(chosen), np.float64)                        # [C]
    for i, c in enumerate(chosen):
        if cancelled():
            return None
        ours[i], best[i] = replay(trace, c)
    return CacheQuality(np.array(chosen, np.int64), ours, best, current, trace.slot_bytes, trace.live_hit_rate,
                        trace.requests)
