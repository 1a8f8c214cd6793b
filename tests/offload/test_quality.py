"""The cache-quality meter: replays of a trace against plain-Python simulations, and the trace a live store keeps."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from engine.kv import KVCache
from engine.offload.accounting import LEARN_STEPS
from engine.offload.quality import CacheTrace, cache_quality, curve_capacities, pins_at
from support.cache_sim import lru_hits, optimum_hits, routing_trace
from support.offload import greedy_logits, load_streamed, mixtral_container

N_EXPERTS, TOP_K, LAYERS = 8, 2, 3


def _trace(steps, capacity: int, policy: str = "lru", **kw) -> CacheTrace:
    fields = dict(slot_bytes=4096, n_experts=len({(layer, e) for layer, ids in steps for e in ids}) + 2,
                  policy=policy, half_life=64.0, experts_per_token=TOP_K * LAYERS, pin_fraction=0.0, prior=None,
                  pin_counts=None, hits=0, accesses=0)
    fields.update(kw)
    return CacheTrace(tuple(steps), capacity, **fields)


def _keys(steps):
    return [[(layer, e) for e in ids] for layer, ids in steps]


def test_replays_match_brute_force_lru_and_the_exhaustive_optimum_on_random_traces():
    for seed in range(25):
        rng = random.Random(seed)
        steps = [(rng.randrange(2), tuple(rng.sample(range(4), rng.randint(1, 2)))) for _ in range(rng.randint(4, 9))]
        quality = cache_quality(_trace(steps, 2), capacities=[1, 2, 3, 4])
        requests = sum(len(ids) for _, ids in steps)
        assert quality.requests == requests
        for c, ours, best in zip(quality.capacities.tolist(), quality.policy, quality.optimum):
            assert ours == lru_hits(_keys(steps), c) / requests, (seed, c)
            assert best == optimum_hits(_keys(steps), c) / requests, (seed, c)
            assert ours <= best


def test_the_curve_spans_the_least_step_to_the_distinct_experts_and_marks_the_capacity():
    steps, _ = routing_trace(3, 16, 2, 120, skew=1.0, seed=1)
    trace = _trace(steps, 7)
    capacities = curve_capacities(trace)
    distinct = len({(layer, e) for layer, ids in steps for e in ids})
    assert capacities[0] == 2 and capacities[-1] == distinct and 7 in capacities
    quality = cache_quality(trace)
    assert quality.capacity == 7 and quality.capacities.tolist() == capacities
    requests = sum(len(ids) for _, ids in steps)
    # with room for every expert, only first uses miss, whatever the policy
    assert quality.policy[-1] == quality.optimum[-1] == 1 - distinct / requests
    assert np.all(np.diff(quality.optimum) >= 0), "the optimum never falls as the cache grows"
    assert np.all(quality.policy <= quality.optimum)
    assert quality.at(7) == (quality.policy[capacities.index(7)], quality.optimum[capacities.index(7)])
    with pytest.raises(KeyError, match="was not replayed"):
        quality.at(5 if 5 not in capacities else 6)


def test_learned_replays_pin_the_most_used_share_and_weigh_by_the_prior():
    steps, prior = routing_trace(2, 8, 2, 200, skew=1.2, seed=4)
    trace = _trace(steps, 6, "learned", prior=prior, pin_counts=prior, pin_fraction=0.34)
    pins = pins_at(trace, 6)
    order = np.argsort(-prior.ravel(), kind="stable")[:2]
    assert pins == {divmod(int(i), 8) for i in order}
    quality = cache_quality(trace, capacities=[4, 6])
    assert np.all(quality.policy <= quality.optimum) and quality.policy[1] > 0


def test_a_cancelled_replay_gives_nothing():
    steps, _ = routing_trace(2, 8, 2, 50, seed=2)
    assert cache_quality(_trace(steps, 4), cancelled=lambda: True) is None


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return mixtral_container(tmp_path_factory, N_EXPERTS, TOP_K, LAYERS)


def test_a_store_keeps_its_recent_steps_and_the_live_hits_over_them(container):
    loaded = load_streamed(container, 5, 0, policy="lru", pin_fraction=0.0)
    try:
        store = loaded.store
        slot = store.slot_bytes
        store.trace = []
        greedy_logits(loaded, [3, 17, 5, 99, 42, 8, 23, 61], 12, batch_prompt=False)
        trace = store.cache_trace()
        assert list(trace.steps) == store.trace and len(trace.steps) == 20 * LAYERS < LEARN_STEPS
        assert (trace.capacity, trace.slot_bytes, trace.policy) == (5, slot, "lru")
        assert trace.n_experts == N_EXPERTS * LAYERS and trace.experts_per_token == TOP_K * LAYERS
        stats = store.stats()
        assert trace.accesses == sum(stats.hits.values()) and trace.live_hit_rate == pytest.approx(stats.hit_rate)
        quality = cache_quality(trace)
        # without pins or read-ahead the store's LRU is the replayed one, but not its order of uses: the fused step
        # asks for its missing experts mid-call, the blocks for a layer's union, and the live counts depend on when
        # each read lands; so the replay is near the live rate, not equal to it
        assert abs(quality.at(5)[0] - trace.live_hit_rate) <= 0.1
        assert quality.at(5)[1] >= quality.at(5)[0]
    finally:
        loaded.close()


def test_a_full_ring_gives_whole_tokens_and_their_own_hits(container):
    loaded = load_streamed(container, 4, policy="lfru")
    try:
        store = loaded.store
        store.accounting.recent = deque(maxlen=10)       # room for 3 tokens of 3 layers and a part of one more
        store.trace = []
        cache = KVCache(loaded.spec, 32)
        seen = []                                        # memory hits and requests after each token
        for t in [3, 17, 5, 99, 42, 8, 23, 61, 7, 150]:
            loaded.model.forward([t], cache)
            hits = store.stats().hits
            seen.append((hits["pinned"] + hits["cached"], sum(hits.values())))
        trace = store.cache_trace()
        assert list(trace.steps) == store.trace[-9:]
        assert (trace.hits, trace.accesses) == (seen[-1][0] - seen[-4][0], seen[-1][1] - seen[-4][1])
        assert trace.policy == "lfru" and trace.accesses == 9 * TOP_K
    finally:
        loaded.close()
