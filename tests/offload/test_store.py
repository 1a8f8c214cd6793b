"""Streaming against resident: the expert store changes speed, never the answer; and it keeps its budget."""

from __future__ import annotations

import numpy as np
import pytest

from engine.blocks.ffn import StoreHooks
from engine.errors import ColibriError, ModelFormatError
from engine.kv import KVCache
from engine.loader import OffloadOptions, load_model
from engine.offload.history import UsageHistory
from engine.offload.store import StoreSettings
from engine.telemetry import Telemetry
from support.offload import greedy_logits, mixtral_container, slot_bytes
from support.reference import build_checkpoint

PROMPT = [3, 17, 5, 99, 42, 8, 23, 61, 7, 150, 12, 33]
N_EXPERTS, TOP_K, LAYERS = 8, 2, 3


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return mixtral_container(tmp_path_factory, N_EXPERTS, TOP_K, LAYERS)


def _run(loaded, steps: int = 10, batch_prompt: bool = True) -> tuple[np.ndarray, list[int]]:
    return greedy_logits(loaded, PROMPT, steps, batch_prompt)


@pytest.fixture(scope="module")
def resident(container):
    return _run(load_model(container))


def _expert_bytes(loaded) -> int:
    return loaded.store.slot_bytes


def _guess_counts(stats) -> list[int]:
    """The read-ahead's guesses so far: predicted, needed, correct."""
    return [stats.prefetch.predicted, stats.prefetch.needed, stats.prefetch.correct]


def _stream(container, slots: int, tmp_path=None, **kw) -> object:
    slot = slot_bytes(container)
    depth = kw.pop("prefetch_depth", 1)
    history = kw.pop("history_path", None)
    telemetry = kw.pop("telemetry", None) or Telemetry(LAYERS, N_EXPERTS)
    settings = StoreSettings(capacity=slots * slot, **kw)
    return load_model(container, offload=OffloadOptions(settings, depth, history), telemetry=telemetry)


@pytest.mark.parametrize("slots, policy, depth, io", [
    (TOP_K, "lru", 0, "pread"),              # the least that can run: every step refills the cache
    (6, "lfru", 1, "pread"),                 # a quarter of the 24 experts
    (12, "learned", 2, "pread"),
    (24, "lru", 1, "pread"),                 # everything fits
    (6, "lru", 0, "mmap"),                   # the page-fault baseline
])
def test_streamed_logits_are_bitwise_the_resident_ones(container, resident, slots, policy, depth, io):
    loaded = _stream(container, slots, policy=policy, prefetch_depth=depth, io=io)
    try:
        logits, tokens = _run(loaded)
        stats = loaded.store.stats()
    finally:
        loaded.close()
    assert tokens == resident[1]
    assert np.array_equal(logits, resident[0])
    assert stats.hits["disk"] > 0
    if slots >= LAYERS * N_EXPERTS:
        assert stats.hits["disk"] <= stats.reads <= LAYERS * N_EXPERTS   # each expert read once (or read ahead), then hits
    occupancy = stats.occupancy
    assert occupancy["pinned"] + occupancy["cached"] <= slots * stats.slot_bytes


def test_token_by_token_prompt_matches_too(container, resident):
    loaded = _stream(container, 4, policy="lfru")
    try:
        logits, tokens = _run(loaded, batch_prompt=False)
    finally:
        loaded.close()
    assert tokens == resident[1]
    full = load_model(container)
    want, _ = _run(full, batch_prompt=False)
    assert np.array_equal(logits, want)


def test_union_reads_each_expert_once_per_layer_step(container):
    loaded = _stream(container, 24, prefetch_depth=0)
    try:
        cache = KVCache(loaded.spec, 64)
        routing = []
        loaded.model.forward(PROMPT, cache, routing=routing)
        distinct = sum(len(np.unique(r.experts)) for r in routing)
        stats = loaded.store.stats()
    finally:
        loaded.close()
    assert stats.reads == distinct                     # 12 tokens x top-2, but one read per distinct expert
    assert sum(stats.hits.values()) == distinct


def test_prefetch_predicts_and_is_counted(container):
    telemetry = Telemetry(LAYERS, N_EXPERTS)
    loaded = _stream(container, 12, prefetch_depth=1, telemetry=telemetry)
    try:
        _run(loaded, steps=12, batch_prompt=False)        # one token a step: a prompt step does not read ahead
        stats = loaded.store.stats()
    finally:
        loaded.close()
    p = stats.prefetch
    assert p.predicted > 0 and p.needed > 0
    assert 0.0 < p.recall <= 1.0 and 0.0 < p.precision <= 1.0
    assert stats.prefetch_issued >= stats.prefetch_used > 0
    snap = telemetry.snapshot()
    assert snap.prefetch_used == stats.prefetch_used
    assert snap.bytes_read == stats.bytes_read
    assert snap.hits["disk"] == stats.hits["disk"]


def test_each_ranks_absent_guesses_are_scored_by_their_step(container):
    """How often a guess's expert not in memory was used by its step, rank by rank: the first rank guessed right
    every time, the second never."""
    from engine.offload.readahead import THROUGH_PRECISION

    loaded = _stream(container, LAYERS * N_EXPERTS, policy="learned")
    store = loaded.store
    try:
        for _ in range(100):
            assert (1, 6) not in store.slots.where and (1, 7) not in store.slots.where     # (nothing reads them)
            store.prefetch(1, [6, 7], read=False)
            store.account(1, [0, 6])
        ranks = store.read_ahead.ranks.scores
        assert ranks[0] > THROUGH_PRECISION > ranks[1] == 0.0
        assert store.stats().prefetch.precision == pytest.approx(0.5)
    finally:
        loaded.close()


@pytest.mark.parametrize("learned", [1.0, 0.0])
def test_a_refused_guess_at_a_rank_mostly_right_is_read_through_a_scratch_slot(container, learned):
    """A guess whose expert is worth less than every cached one is not read (it would push out an expert worth
    more) unless its rank's absent guesses were mostly used: then it is read through a scratch slot, found in
    memory by its step, and not kept. Either way no cached expert leaves for it."""
    loaded = _stream(container, 8, policy="learned")          # 6 cached and 2 scratch slots
    store = loaded.store
    try:
        for _ in range(4):                                     # layer 0's experts 0-5 cached, used often
            for ids in ([0, 1], [2, 3], [4, 5]):
                for _ in store.groups(0, ids):
                    pass
        cached = {k for k in store.built if k not in store.slots.transient}
        assert cached == {(0, e) for e in range(6)}
        store.read_ahead.ranks.scores[0] = learned                      # (as 64 guesses of that rank would have taught)
        store.prefetch(1, [6, 7])
        read = store.slots.where.keys() - cached
        while store.reads.loading:
            store.collect()
        assert {k for k in store.built if k not in store.slots.transient} == cached
        if not learned:
            assert not read and store.stats().prefetch_issued == 0
            return
        assert read == {(1, 6)} and (1, 6) in store.slots.transient   # rank 1: not learned
        assert store.stats().prefetch_issued == 1
        missed = store.stats().hits["disk"]
        for _ in store.groups(1, [6, 0]):
            pass
        assert store.stats().hits["disk"] == missed + 1 and store.stats().prefetch_used == 1   # (1, 6) was in memory
        assert (1, 6) not in store.built and not store.slots.transient and len(store.slots.scratch) == 2
    finally:
        loaded.close()


def test_a_read_ahead_started_during_a_step_never_evicts_that_steps_experts(container):
    """The fused decode step starts the next layer's reads while a layer's experts are being brought in and
    computed (the `started` callback): those reads must take other slots, never the step's own."""
    loaded = _stream(container, 3, policy="lru", prefetch_depth=0)
    store = loaded.store
    try:
        for _ in store.groups(0, [0, 1]):                # both in memory, then one free slot
            pass
        before = {i: store.built[(0, i)].gate.a.copy() for i in (0, 1)}
        seen = {}
        for group in store.groups(0, [0, 1], started=lambda: store.prefetch(1, [2, 3, 4])):
            for i, e in group.items():
                seen[i] = e.gate.a.copy()
        assert sorted(seen) == [0, 1]
        assert all(np.array_equal(seen[i], before[i]) for i in (0, 1))     # not overwritten by a read ahead
        assert (0, 0) in store.built and (0, 1) in store.built
        assert store.stats().prefetch_issued == 1                            # only the free slot was used
    finally:
        loaded.close()


def test_a_read_into_a_laid_out_slot_is_handed_over_by_its_reader_thread(container):
    """As a read completes, its reader thread hands the expert over (`on_arrival`) when the slot's tensors are
    already laid out, before the store takes it in; the first read into a slot wakes the store's taker (`on_read`)
    instead, which lays them out. What is handed over is the expert's own weights."""
    import threading

    resident = load_model(container).model.experts
    loaded = _stream(container, TOP_K, policy="lru", prefetch_depth=0)
    store = loaded.store
    handed, woken = {}, []

    def arrival(key, e):                               # (read now: the slot is read over later)
        handed[key] = (threading.current_thread().name, e.gate.dequantize(), e.down.dequantize())
    store.attach(StoreHooks(on_read=lambda: woken.append(threading.current_thread().name), on_arrival=arrival))
    try:
        store.experts(0, [0, 1])                       # the first reads into the two slots
        first, first_handed = list(woken), dict(handed)
        store.experts(0, [2, 3])                       # then the same slots, read over
    finally:
        loaded.close()
    assert len(first) == 2 and not first_handed
    assert set(handed) == {(0, 2), (0, 3)} and woken == first
    for (layer, e), (thread, gate, down) in handed.items():
        assert thread.startswith("colibri-io")
        want = resident.per_layer[layer][e]
        assert np.array_equal(gate, want.gate.dequantize()) and np.array_equal(down, want.down.dequantize())


def test_account_steps_counts_as_account_does_step_by_step(container, tmp_path):
    """The fused decode counts a token's layer steps in one call: the store ends as one `account` a step would
    leave it (hits, telemetry, the prediction's score, prefetches used, the policy's scores, the usage history)."""
    rng = np.random.default_rng(11)
    tokens = [[(layer, sorted(int(e) for e in rng.choice(N_EXPERTS, TOP_K, replace=False))) for layer in range(LAYERS)]
              for _ in range(6)]
    seen = []
    for side in ("one", "many"):
        telemetry = Telemetry(LAYERS, N_EXPERTS)
        loaded = _stream(container, LAYERS * N_EXPERTS, policy="learned", history_path=tmp_path / f"{side}.npz",
                         telemetry=telemetry)
        store = loaded.store
        try:
            for layer in range(LAYERS):                  # every expert in memory (one is read ahead, unused yet)
                for _ in store.groups(layer, list(range(1, N_EXPERTS))):
                    pass
            store.prefetch(0, [0], read=True)
            while store.reads.loading:
                store.collect()
            stats = store.stats()
            before, predicted = dict(stats.hits), _guess_counts(stats)
            pinned_uses = 0                              # (the usage history pins experts as the tokens go)
            for steps in tokens:
                pinned_uses += sum((layer, e) in store.pinned for layer, ids in steps for e in ids)
                store.prefetch(1, [steps[1][1][0], 7 - steps[1][1][0]], read=False)   # one right, one maybe
                if side == "one":
                    for layer, ids in steps:
                        store.account(layer, ids)
                else:
                    store.account_steps(steps)
                store.end_token()
                telemetry.end_token()
            keys = [(layer, e) for layer in range(LAYERS) for e in range(N_EXPERTS)]
            stats = store.stats()
            hits = {tier: n - before[tier] for tier, n in stats.hits.items()}
            pf_counts = [n - m for n, m in zip(_guess_counts(stats), predicted)]
            assert hits["pinned"] == pinned_uses
            acc = store.accounting
            seen.append((hits, acc.now, list(acc.recent), pf_counts, stats.prefetch_used,
                         [acc.policy.score(k) for k in keys], store.history.counts.tolist(),
                         dict(telemetry.snapshot().hits)))
        finally:
            loaded.close()
    assert seen[0] == seen[1]
    hits, now, recent, pf_counts = seen[0][:4]
    assert 0 < hits["pinned"] < hits["pinned"] + hits["cached"]
    assert hits["pinned"] + hits["cached"] == 6 * LAYERS * TOP_K == seen[0][7]["pinned"] + seen[0][7]["cached"]
    assert hits["disk"] == 0 and now > 6 * LAYERS and recent[-1] == (2, tuple(tokens[-1][2][1]))
    first = int(0 in tokens[0][0][1])                     # the read ahead of expert 0 of layer 0, scored and used
    right = sum(len({steps[1][1][0], 7 - steps[1][1][0]} & set(steps[1][1])) for steps in tokens)
    assert pf_counts == [12 + 1, 12 + TOP_K, right + first] and seen[0][4] == int(any(0 in steps[0][1] for steps in tokens))


def test_history_pins_experts_on_the_next_start(container, resident, tmp_path):
    path = tmp_path / "usage.npz"
    loaded = _stream(container, 8, policy="learned", history_path=path)
    _run(loaded)
    loaded.close()
    assert path.is_file()
    again = _stream(container, 8, policy="learned", history_path=path, pin_fraction=0.5)
    try:
        assert len(again.store.pinned) == 4
        logits, tokens = _run(again)
        stats = again.store.stats()
    finally:
        again.close()
    assert tokens == resident[1] and np.array_equal(logits, resident[0])
    assert stats.hits["pinned"] > 0


def test_a_session_teaches_the_next_its_cache_half_life(container, resident, tmp_path):
    from engine.offload.accounting import MIN_LEARN_TOKENS
    from engine.offload.policy import DEFAULT_HALF_LIFE_TOKENS, HALF_LIFE_CHOICES

    path = tmp_path / "usage.npz"
    first = _stream(container, 8, policy="learned", history_path=path)
    assert first.store.accounting.half_life_tokens == DEFAULT_HALF_LIFE_TOKENS
    _run(first, steps=MIN_LEARN_TOKENS + 4)
    learned = first.store.learn_policy()
    first.close()                                           # learns again and saves it with the counts
    assert learned in HALF_LIFE_CHOICES
    again = _stream(container, 8, policy="learned", history_path=path)
    try:
        assert again.store.accounting.half_life_tokens == learned == UsageHistory.load(
            path, again.store.container.model_hash, LAYERS, N_EXPERTS).policy_half_life
        logits, tokens = _run(again)
    finally:
        again.close()
    assert tokens == resident[1] and np.array_equal(logits, resident[0])   # a learned policy never changes the answer


def test_too_small_a_cache_says_the_minimum(container):
    with pytest.raises(ColibriError, match="allow at least"):
        _stream(container, TOP_K - 1)


def test_a_corrupt_expert_is_refused_when_first_read(container, tmp_path):
    import shutil

    from engine.formats.container import Container

    copy = tmp_path / "moe"
    shutil.copytree(container, copy)
    x = Container.open(copy, verify=False).extents[(1, 3)]
    with open(copy / x.file, "r+b") as f:
        f.seek(x.offset + 100)
        byte = f.read(1)
        f.seek(x.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    loaded = _stream(copy, 24, prefetch_depth=0)
    try:
        with pytest.raises(ModelFormatError, match="checksum mismatch in expert 3 of layer 1"):
            for _ in range(20):
                _run(loaded, steps=4)
        assert (1, 3) not in loaded.store.built          # not kept: the next step that wants it reads it again
        with pytest.raises(ModelFormatError, match="checksum mismatch in expert 3 of layer 1"):
            for _ in range(20):
                _run(loaded, steps=4)
    finally:
        loaded.close()


def test_streaming_needs_a_container(tmp_path):
    src = build_checkpoint(tmp_path / "hf", "mixtral", num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ColibriError, match="colibri convert"):
        load_model(src, offload=OffloadOptions(StoreSettings(capacity=1 << 20)))


def test_close_stops_the_readers(container):
    import threading

    loaded = _stream(container, 6)
    _run(loaded, steps=2)
    loaded.close()
    loaded.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("colibri-io")]


def test_live_budget_and_io_threads_change_between_tokens(container, resident):
    loaded = _stream(container, 24, policy="lfru")
    store, model = loaded.store, loaded.model
    try:
        cache = KVCache(loaded.spec, len(PROMPT) + 12)
        logits = [model.forward(PROMPT, cache, all_logits=True)]
        tokens = []
        changes = {2: lambda: store.set_capacity(4 * store.slot_bytes),      # shrink: evicts
                   4: lambda: store.set_io_threads(1),
                   5: lambda: setattr(model.context, "prefetch_depth", 2),
                   7: lambda: store.set_capacity(20 * store.slot_bytes)}     # grow: fills again
        for step in range(10):
            if step in changes:
                changes[step]()
            if step == 3:
                occ = store.stats().occupancy
                assert occ["pinned"] + occ["cached"] <= 4 * store.slot_bytes
            tokens.append(int(np.argmax(logits[-1][-1])))
            logits.append(model.forward([tokens[-1]], cache))
        assert store.n_slots == 20
        with pytest.raises(ColibriError, match="allow at least"):
            store.set_capacity(store.slot_bytes)
    finally:
        loaded.close()
    assert tokens == resident[1]
    assert np.array_equal(np.concatenate(logits), resident[0])


@pytest.mark.parametrize("slots, most, rows", [(8, 8, 1), (16, 8, 3), (30, 8, 8), (30, 4, 4)])
def test_sequences_decode_together_as_many_as_the_cache_holds_the_steps_of(container, slots, most, rows):
    """A batch's step reads its union once: as many sequences run together as the cache is expected to hold a
    step of (3 layers of 8 experts, top 2: b rows choose 24 (1 - (3/4)^b) experts, within 90% of the slots)."""
    loaded = _stream(container, slots)
    try:
        assert loaded.store.batch_rows(most) == rows
    finally:
        loaded.close()
