"""Each expert's story: the store's per-expert counters and tier changes against a scripted run of known requests."""

from __future__ import annotations

import numpy as np
import pytest

from engine.offload.story import CHANGE, TIER_CACHED, TIER_DISK, TIER_PINNED, ExpertCounts, ExpertLog, RouteLog
from support.offload import greedy_logits, load_streamed, mixtral_container

N_EXPERTS, TOP_K, LAYERS = 8, 2, 3


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return mixtral_container(tmp_path_factory, N_EXPERTS, TOP_K, LAYERS)


def _store(container, slots: int, **kw):
    return load_streamed(container, slots, 0, **kw)


def _settled(store) -> None:
    """Reads ahead finished and taken in, so the next step finds them in memory."""
    store.reads.wait()
    store.collect()


def test_counters_follow_a_scripted_run_of_known_requests(container):
    loaded = _store(container, 3, policy="lru", pin_fraction=0.0)
    try:
        store = loaded.store
        store.experts(1, [0, 1])              # token 0: both read
        store.end_token()
        store.experts(1, [1, 2])              # token 1: 1 hits, 2 read
        store.end_token()
        store.experts(1, [0, 3])              # token 2: 0 hits, 3 read in place of 1 (least recently used)
        store.prefetch(1, [4])                # ... 4 read ahead in place of 2
        _settled(store)
        store.end_token()
        store.experts(1, [4, 0])              # token 3: both hit, the guess used
        store.prefetch(1, [5])                # ... 5 read ahead in place of 3
        _settled(store)
        store.end_token()
        store.experts(1, [6, 0])              # token 4: 0 hits; 6 read in place of 4 (used before 5 came)
        store.end_token()
        store.experts(1, [7, 0])              # token 5: 0 hits; 7 read in place of 5: read ahead, never used
        store.end_token()
        counts = store.expert_counts()
    finally:
        loaded.close()
    assert counts.tokens == 6 and counts.steps.tolist() == [0, 6, 0]
    row = lambda grid: grid[1].tolist()       # noqa: E731 - layer 1's experts
    assert row(counts.hits) == [4, 1, 0, 0, 1, 0, 0, 0]
    assert row(counts.misses) == [1, 1, 1, 1, 0, 0, 1, 1]
    assert row(counts.reads) == [1, 1, 1, 1, 1, 1, 1, 1]
    assert row(counts.ahead_used) == [0, 0, 0, 0, 1, 0, 0, 0]
    assert row(counts.ahead_wasted) == [0, 0, 0, 0, 0, 1, 0, 0]
    assert counts.hits[[0, 2]].sum() == counts.misses[[0, 2]].sum() == 0
    assert row(counts.last) == [5, 1, 1, 2, 3, -1, 4, 5]                   # 5 only read ahead: never chosen
    assert row(counts.since_routed()) == [0, 4, 4, 3, 2, -1, 1, 0]        # tokens unchosen since, after token 5
    assert (counts.last[[0, 2]] == -1).all() and (counts.since_routed()[[0, 2]] == -1).all()
    one = counts.story(1, 1)
    assert (one.hits, one.misses, one.reads, one.requests, one.share, one.last) == (1, 1, 1, 2, 2 / 6, 1)
    assert one.changes == ((0, TIER_CACHED), (2, TIER_DISK))       # read at token 0, pushed out at token 2
    assert counts.story(1, 0).changes == ((0, TIER_CACHED),)          # never left
    assert counts.story(1, 4).changes == ((2, TIER_CACHED), (4, TIER_DISK))
    assert counts.story(1, 5).changes == ((3, TIER_CACHED), (5, TIER_DISK))
    assert counts.story(2, 7).changes == () and counts.story(2, 7).share == 0
    with pytest.raises(IndexError, match="outside"):
        counts.story(LAYERS, 0)
    routes = counts.routes                    # each token's step, and what it waited for from disk
    assert routes.tokens().tolist() == [0, 1, 2, 3, 4, 5]
    assert [routes.of(t) for t in range(6)] == [[(1, (0, 1), (0, 1))], [(1, (1, 2), (2,))], [(1, (0, 3), (3,))],
                                                [(1, (4, 0), ())], [(1, (6, 0), (6,))], [(1, (7, 0), (7,))]]


def test_pins_are_tier_changes_too(container, tmp_path):
    loaded = _store(container, 6, policy="lfru", pin_fraction=0.5)
    try:
        store = loaded.store
        store.experts(0, [2, 3])
        store._pin([(0, 2)])                  # as re-pinning does for an expert in memory
        store.end_token()
        counts = store.expert_counts()
    finally:
        loaded.close()
    assert counts.story(0, 2).changes == ((0, TIER_CACHED), (0, TIER_PINNED))
    assert counts.story(0, 3).changes == ((0, TIER_CACHED),)


def test_the_ring_keeps_the_latest_changes_oldest_first():
    log = ExpertLog(2, 4, 2, changes=4)
    for token in range(6):
        log.tokens = token
        log.tier((token % 2, token % 4), TIER_CACHED if token % 3 else TIER_DISK)
    counts = log.frozen()
    assert isinstance(counts, ExpertCounts) and counts.changes.dtype == CHANGE
    assert counts.changes["token"].tolist() == [2, 3, 4, 5]
    assert counts.story(0, 2).changes == ((2, TIER_CACHED),)
    log.hit_many([(1, 3), (1, 3), (0, 0)])
    assert log.hits[1, 3] == 2 and log.hits[0, 0] == 1 and counts.hits.sum() == 0   # a copy: no later counts
    assert np.all(log.frozen().hits == log.hits)


def test_the_last_token_to_choose_each_expert_and_the_tokens_since():
    log = ExpertLog(2, 4, 2)
    assert (log.frozen().last == -1).all() and (log.frozen().since_routed() == -1).all()
    log.chose(0, [1, 2])                      # token 0
    log.tokens = 1
    log.chose(0, np.array([2, 3]))            # token 1 (ids as the router gives them, too)
    log.chose(1, (0,))
    log.tokens = 2
    counts = log.frozen()
    assert counts.last.tolist() == [[-1, 0, 1, 1], [1, -1, -1, -1]]
    assert counts.since_routed().tolist() == [[-1, 1, 0, 0], [0, -1, -1, -1]]
    log.chose(0, [1])                         # token 2, under way: as recent as the last token that ended
    assert log.frozen().since_routed()[0].tolist() == [-1, 0, 0, 0]
    assert counts.last[0, 1] == 0 and counts.story(0, 1).last == 0   # a copy: no later steps


def test_the_counters_add_up_to_the_stores_own_over_a_generation(container):
    loaded = load_streamed(container, 5, policy="learned")
    try:
        loaded.store.trace = []
        greedy_logits(loaded, [3, 17, 5, 99, 42, 8], 10, batch_prompt=False)
        stats, counts, trace = loaded.store.stats(), loaded.store.expert_counts(), loaded.store.trace
    finally:
        loaded.close()
    assert counts.hits.sum() == stats.hits["pinned"] + stats.hits["cached"] > 0
    assert counts.misses.sum() == stats.hits["disk"] > 0
    assert counts.reads.sum() == stats.reads
    assert (counts.ahead_used.sum(), counts.ahead_wasted.sum()) == (stats.prefetch_used, stats.prefetch_wasted)
    assert counts.steps.tolist() == [16] * LAYERS and counts.tokens == 16
    assert counts.last.max(axis=1).tolist() == [15] * LAYERS          # the last token chose some in every layer
    assert ((counts.last >= 0) == (counts.hits + counts.misses > 0)).all()   # chosen once at least: requested
    routes = counts.routes                    # every forward decoded one token: each step is kept
    assert routes.tokens().tolist() == list(range(16))
    assert [(int(layer), tuple(int(e) for e in ids if e >= 0)) for layer, ids in zip(routes.layer, routes.experts)] \
        == trace
    assert routes.disk.sum() == stats.hits["disk"]
    assert all(set(disk) <= set(ids) for t in range(16) for _, ids, disk in routes.of(t))


def test_the_route_ring_keeps_the_latest_steps_and_skips_wide_ones():
    log = RouteLog(2, steps=3)
    log.begin(0, 0, [5, 6], {(0, 6)})
    log.begin(1, 0, [1, 2, 3])                # a prompt's union: wider than top-k, left out
    log.read(1, (0, 2))                       # ... so no step is open to mark
    for token in (1, 2, 3):
        log.begin(token, 1, [token, 7])
        log.read(token, (1, 7))
    log.read(2, (1, 3))                       # another token's read marks nothing
    routes = log.frozen()
    assert routes.token.tolist() == [1, 2, 3]
    assert routes.of(1) == [(1, (1, 7), (7,))] and routes.of(0) == []


def test_answers_are_runs_of_tokens_and_their_usage_is_a_share_of_tokens():
    log = RouteLog(2)
    for token in (4, 5, 6, 20, 21):           # a prompt of 13 tokens between two answers
        for layer in range(2):
            log.begin(token, layer, [token % 3, 3 + layer])
    routes = log.frozen()
    assert routes.answers() == [(4, 6), (20, 21)]
    usage = routes.usage(4, 6, (2, 5))
    assert usage[0].tolist() == [1 / 3, 1 / 3, 1 / 3, 1.0, 0.0]    # tokens 4, 5, 6 choose 1, 2, 0; all choose 3
    assert usage[1].tolist() == [1 / 3, 1 / 3, 1 / 3, 0.0, 1.0]
    assert routes.usage(20, 21, (2, 5))[0].tolist() == [0.5, 0.0, 0.5, 1.0, 0.0]
    assert routes.usage(7, 19, (2, 5)).sum() == 0 and RouteLog(2).frozen().answers() == []
