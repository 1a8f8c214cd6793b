"""Cache replacement policies: hand-counted traces, the Belady ceiling, pinning, and the workloads
each policy exists for (a hot set with scans for LFRU, skewed routing for the learned prior)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.offload.policy import (
    HALF_LIFE_CHOICES,
    LFRU,
    LRU,
    Learned,
    SimResult,
    belady,
    make_policy,
    simulate,
    tune_half_life,
)
from support.cache_sim import optimum_hits, routing_trace


def hot_and_scan(n_hot: int, n_rounds: int, scan_len: int, layer: int = 0):
    """A small hot set used in turn, with a long one-off scan of fresh keys after every round."""
    trace, fresh = [], 10_000
    for _ in range(n_rounds):
        for _ in range(3):
            trace.extend((layer, (e,)) for e in range(n_hot))
        trace.extend((layer, (fresh + i,)) for i in range(scan_len))
        fresh += scan_len
    return trace


# -- hand-counted traces ----------------------------------------------------------------------

SMALL = [(0, (1,)), (0, (2,)), (0, (3,)), (0, (1,)), (0, (4,)), (0, (2,)), (0, (1,)), (0, (3,))]


def test_lru_counts_by_hand():
    # capacity 2: 1m 2m 3m(-1) 1m(-2) 4m(-3) 2m(-1) 1m(-4) 3m(-2): every access misses
    assert simulate(SMALL, 2, LRU()) == SimResult(accesses=8, hits=0)
    # capacity 3: 1m 2m 3m 1h 4m(-2) 2m(-3) 1h 3m(-4)
    assert simulate(SMALL, 3, LRU()) == SimResult(accesses=8, hits=2)


def test_belady_counts_by_hand():
    # capacity 2: 1m 2m 3m(bypass: next use 7 > 2's 5 > 1's 3) 1h 4m(bypass) 2h 1h 3m
    assert belady(SMALL, 2) == SimResult(accesses=8, hits=3)
    # capacity 3: 1m 2m 3m 1h 4m(bypass, never again) 2h 1h 3h
    assert belady(SMALL, 3) == SimResult(accesses=8, hits=4)


def test_step_keys_are_never_evicted_and_overflow_streams_through():
    # a step of 3 experts in a cache of 2: the third is streamed, not kept, and the first two stay
    trace = [(0, (1, 2, 3)), (0, (1, 2))]
    assert simulate(trace, 2, LRU()) == SimResult(accesses=5, hits=2)
    assert belady(trace, 2) == SimResult(accesses=5, hits=2)
    # multi-expert steps across layers, capacity 3 (LRU by hand):
    # (0,1)m (0,2)m | (1,1)m (0,1 evicted) (1,2)m (0,2 evicted) | (0,1)m (0,2)m both evict layer 1
    trace = [(0, (1, 2)), (1, (1, 2)), (0, (1, 2))]
    assert simulate(trace, 3, LRU()) == SimResult(accesses=6, hits=1)


def test_zero_capacity_misses_everything():
    trace, _ = routing_trace(2, 8, 2, 20, seed=1)
    for policy in (LRU(), LFRU(), Learned(np.ones((2, 8)))):
        assert simulate(trace, 0, policy).hits == 0
    assert belady(trace, 0).hits == 0


def test_capacity_must_hold_the_pinned_keys():
    with pytest.raises(ValueError, match="pinned"):
        simulate(SMALL, 1, LRU(), pinned={(0, 1), (0, 2)})


# -- the Belady ceiling -------------------------------------------------------------------------

def _policies(prior):
    return [LRU(), LFRU(), LFRU(half_life=3.0), Learned(prior), Learned(prior, half_life=5.0)]


@pytest.mark.parametrize("seed", range(40))
def test_belady_bounds_every_policy(seed):
    rng = random.Random(seed)
    n_layers, n_experts = rng.randint(1, 3), rng.randint(3, 10)
    top_k = rng.randint(1, min(4, n_experts))
    trace, prior = routing_trace(n_layers, n_experts, top_k, rng.randint(10, 60),
                                 skew=rng.uniform(0, 1.5), drift=rng.uniform(0, 2), seed=seed)
    capacity = rng.randint(1, n_layers * n_experts)
    pinned = frozenset(rng.sample([(l, e) for l in range(n_layers) for e in range(n_experts)],
                                  rng.randint(0, capacity // 2)))
    best = belady(trace, capacity, pinned)
    for policy in _policies(prior):
        assert simulate(trace, capacity, policy, pinned).hits <= best.hits, policy.name


def test_belady_is_optimal_on_tiny_traces():
    """Against an exhaustive search over every keep/evict choice."""
    for seed in range(30):
        rng = random.Random(seed)
        trace = [(0, tuple(rng.sample(range(5), rng.randint(1, 3)))) for _ in range(rng.randint(3, 9))]
        capacity = rng.randint(1, 4)
        assert belady(trace, capacity).hits == optimum_hits([[(l, e) for e in ids] for l, ids in trace], capacity)


# -- pinning and the policy contract ------------------------------------------------------------

def test_pinned_keys_always_hit_and_leave_the_rest_to_the_cache():
    """Pinning k keys is exactly: those keys hit, the rest runs in a cache k experts smaller."""
    trace, prior = routing_trace(2, 8, 2, 200, skew=0.5, seed=3)
    pinned = frozenset({(0, 0), (1, 5)})
    unpinned = [(l, tuple(e for e in ids if (l, e) not in pinned)) for l, ids in trace]
    n_pinned = sum((l, e) in pinned for l, ids in trace for e in ids)
    assert n_pinned > 0
    for make in (LRU, LFRU, lambda: Learned(prior)):
        policy, inserted = make(), []
        insert = policy.insert
        policy.insert = lambda key, now: (inserted.append(key), insert(key, now))
        with_pins = simulate(trace, 6, policy, pinned)
        assert with_pins.hits == n_pinned + simulate(unpinned, 4, make()).hits, policy.name
        assert not pinned & set(inserted), policy.name       # never cached, so never evicted
    assert belady(trace, 6, pinned).hits == n_pinned + belady(unpinned, 4).hits


def test_pinned_hits_count_once_per_access():
    trace = [(0, (0, 1)), (0, (0, 2)), (0, (0, 1))]
    # pinned (0,0) hits 3 times; one free slot holds 1, then 2 evicts it, then 1 misses
    assert simulate(trace, 2, LRU(), pinned={(0, 0)}) == SimResult(accesses=6, hits=3)
    assert belady(trace, 2, pinned={(0, 0)}) == SimResult(accesses=6, hits=4)


@pytest.mark.parametrize("name", ["lru", "lfru", "learned"])
def test_victim_is_never_excluded(name):
    rng = random.Random(7)
    policy = make_policy(name, prior=np.arange(20.0).reshape(2, 10))
    cached = [(l, e) for l in range(2) for e in range(10)]
    for now, key in enumerate(cached):
        policy.insert(key, now)
        policy.access(key, now)
    for now in range(20, 300):
        key = rng.choice(cached)
        policy.access(key, now)
        exclude = frozenset(rng.sample(cached, rng.randint(0, 19)))
        victim = policy.victim(exclude)
        assert victim in cached and victim not in exclude
    with pytest.raises(LookupError):
        policy.victim(frozenset(cached))
    for key in cached:
        policy.remove(key)
    with pytest.raises(LookupError):
        policy.victim(frozenset())


@pytest.mark.parametrize("name, half_life", [("lru", 4.0), ("lfru", 4.0), ("learned", 4.0), ("learned", 0.5)])
def test_access_many_is_access_one_by_one(name, half_life):
    """A step's uses given at once leave the policy as one `access` each would: the same victims, step by step,
    through evictions, re-insertions and (half_life 0.5: a rescale every 128 steps) the counts' rescaling."""
    trace, prior = routing_trace(2, 16, 3, 200, skew=1.2, seed=3)
    one, many = (make_policy(name, prior=prior, half_life=half_life) for _ in range(2))
    cached: set = set()
    victims = []
    for now, (layer, ids) in enumerate(trace):
        keys = [(layer, e) for e in ids]
        for key in keys:
            if key not in cached:
                if len(cached) == 8:
                    victim = one.victim(frozenset(keys))
                    assert many.victim(frozenset(keys)) == victim
                    victims.append(victim)
                    cached.discard(victim)
                    one.remove(victim)
                    many.remove(victim)
                cached.add(key)
                one.insert(key, now)
                many.insert(key, now)
        for key in keys:
            one.access(key, now)
        many.access_many(keys, now)
    assert len(victims) > 100
    if name != "lru":
        assert all(one.score(k) == many.score(k) for k in cached)


def test_lfru_evicts_the_lowest_decayed_count_then_the_older_use():
    policy = LFRU(half_life=10.0)
    for key, uses in (((0, 0), [0, 1, 2]), ((0, 1), [3]), ((0, 2), [4])):
        policy.insert(key, uses[0])
        for t in uses:
            policy.access(key, t)
    assert policy.victim(frozenset()) == (0, 1)             # count 1, older than (0, 2)
    policy.access((0, 1), 5)
    assert policy.victim(frozenset()) == (0, 2)
    # 3 uses at steps 0..2 decay below 1 fresh use after ~16 half-lives of silence
    policy.access((0, 2), 200)
    policy.access((0, 1), 200)
    assert policy.victim(frozenset()) == (0, 0)


def test_make_policy_names():
    assert isinstance(make_policy("lru"), LRU)
    assert type(make_policy("lfru")) is LFRU
    assert isinstance(make_policy("learned", prior={(0, 1): 3.0}), Learned)
    with pytest.raises(ValueError, match="lru, lfru, learned"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="prior"):
        make_policy("learned")


# -- the workloads each policy is for -----------------------------------------------------------

def test_lfru_beats_lru_on_a_hot_set_with_scans():
    trace = hot_and_scan(n_hot=6, n_rounds=20, scan_len=8)
    lru = simulate(trace, 8, LRU())
    lfru = simulate(trace, 8, LFRU())
    assert lfru.hit_rate > lru.hit_rate + 0.2
    assert lfru.hits <= belady(trace, 8).hits


def test_learned_prior_beats_lru_on_skewed_routing():
    trace, prior = routing_trace(8, 32, 4, 300, skew=1.0, seed=11)
    capacity = 8 * 32 // 4
    lru = simulate(trace, capacity, LRU())
    learned = simulate(trace, capacity, Learned(prior))
    wrong = simulate(trace, capacity, Learned(prior[:, ::-1].copy()))  # a prior for another model
    assert learned.hit_rate > lru.hit_rate + 0.05
    assert learned.hit_rate > wrong.hit_rate
    assert learned.hits <= belady(trace, capacity).hits


def test_learned_with_a_flat_prior_is_lfru():
    trace, _ = routing_trace(4, 16, 2, 100, seed=5)
    assert simulate(trace, 16, Learned(np.ones((4, 16)))) == simulate(trace, 16, LFRU(admission=True))
    assert simulate(trace, 16, Learned(np.ones((4, 16)), admission=False)) == simulate(trace, 16, LFRU())


def test_admission_keeps_the_best_keys_when_a_step_outnumbers_the_cache():
    """A cyclic scan of 12 keys through 8 slots: LRU misses every time; admission keeps 8 and hits them."""
    trace = [(0, tuple(range(12)))] * 0 + [(0, (i,)) for _ in range(50) for i in range(12)]
    assert simulate(trace, 8, LRU()).hits == 0
    kept = simulate(trace, 8, LFRU(admission=True))
    assert kept.hits >= 8 * 45


def test_the_learned_half_life_follows_the_workload():
    # a drifting topic rewards a short memory, a stationary one a long memory; tuning finds which
    drifting, prior = routing_trace(4, 32, 2, 600, skew=0.3, drift=3.0, persistence=0.9, seed=3)
    stationary, _ = routing_trace(4, 32, 2, 600, skew=1.0, seed=3)
    capacity = 4 * 32 // 4
    short = tune_half_life(drifting, capacity, 4, prior)
    long = tune_half_life(stationary, capacity, 4, prior)
    assert short in HALF_LIFE_CHOICES and long in HALF_LIFE_CHOICES and short < long

    def hits(trace, tokens):
        return simulate(trace, capacity, Learned(prior, half_life=tokens * 4)).hits

    assert all(hits(drifting, short) >= hits(drifting, h) for h in HALF_LIFE_CHOICES)   # it is the best choice
    assert hits(stationary, long) > hits(stationary, short)
    with pytest.raises(ValueError, match="at least one"):
        tune_half_life(drifting, capacity, 4, prior, choices=())
