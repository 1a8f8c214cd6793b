"""Plain-Python cache simulations the expert cache's replays are checked against: small, slow and obvious."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations

import numpy as np

Key = tuple[int, int]


def optimum_hits(steps: Sequence[Sequence[Key]], capacity: int) -> int:
    """The most hits any keep/evict choice reaches (an exhaustive search: tiny traces only)."""
    best = {frozenset(): 0}                       # cache contents -> most hits so far
    for keys in steps:
        nxt: dict[frozenset, int] = {}
        for cache, hits in best.items():
            h = hits + sum(k in cache for k in keys)
            misses = [k for k in keys if k not in cache]
            others = [k for k in cache if k not in keys]
            kept_hits = cache - set(others)
            pool = others + misses
            room = capacity - len(kept_hits)
            for n in range(0, min(room, len(pool)) + 1):
                for chosen in combinations(pool, n):
                    # an unneeded cached key can be dropped; a missed one may be kept
                    new = kept_hits | set(chosen)
                    if nxt.get(new, -1) < h:
                        nxt[new] = h
        best = nxt
    return max(best.values())


def lru_hits(steps: Sequence[Sequence[Key]], capacity: int) -> int:
    """Hits of a least-recently-used cache of `capacity` keys that never evicts a key of the step in progress."""
    order: list[Key] = []                         # cached keys, least recently used first
    hits = 0
    for keys in steps:
        for key in keys:
            if key in order:
                hits += 1
                order.remove(key)
                order.append(key)
                continue
            if len(order) >= capacity:
                victims = [k for k in order if k not in keys]
                if not victims:
                    continue                      # no room this step: read through
                order.remove(victims[0])
            order.append(key)
    return hits


def routing_trace(n_layers: int, n_experts: int, top_k: int, n_tokens: int, *, skew: float = 1.0,
                  drift: float = 0.0, persistence: float = 0.98, seed: int = 0):
    """A synthetic MoE routing trace: per layer, expert popularity falls as rank**-skew (Zipf, in
    a random order per layer), plus a topic bias of scale `drift` that wanders token to token
    (AR(1) with `persistence`); each token takes top_k experts without replacement.

    Returns (trace, expected counts [L, E]) where the counts are the stationary popularities, the
    prior a usage history would have learned."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, n_experts + 1, dtype=np.float64)
    base = np.stack([rng.permutation(-skew * np.log(ranks)) for _ in range(n_layers)])  # [L, E]
    bias = np.zeros((n_layers, n_experts))                                                # [L, E]
    noise_scale = drift * np.sqrt(1 - persistence**2)
    trace = []
    for _ in range(n_tokens):
        bias = persistence * bias + noise_scale * rng.standard_normal(bias.shape)
        gumbel = rng.gumbel(size=bias.shape)                                              # [L, E]
        top = np.argpartition(-(base + bias + gumbel), top_k - 1, axis=1)[:, :top_k]      # [L, k]
        trace.extend((layer, tuple(int(e) for e in top[layer])) for layer in range(n_layers))
    return trace, np.exp(base)
