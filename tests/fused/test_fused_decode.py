"""The fused decode step: the same bits as the blocks run one at a time, for every layer shape it accepts.

A one-token step of one sequence runs as one parallel region (engine/fused/plan.py); the blocks
path is what batches, prompts and streamed models take. Greedy decoding with each must give the same
logits and routing bit for bit, with one thread or two, through a KV cache of several blocks.
"""

from __future__ import annotations

import os
import re
import time

import numba
import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.kv import KVCache, KVPool
from engine.loader import load_model
from support.reference import build_checkpoint

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9]
STEPS = 12
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}

FUSED = {
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
    "mixtral-window-mha": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=3, sliding_window=6,
                                           num_key_value_heads=4)),
    "llama-tied-mqa-llama3-rope": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=1, rope_scaling=LLAMA3,
                                                 rope_theta=500000.0)),
    "qwen3-moe-head-norms-unnormed": ("qwen3_moe", dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                                        head_dim=16, norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen2-qkv-bias-window": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "granitemoe-attention-multiplier": ("granitemoe", dict(num_local_experts=8, num_experts_per_tok=2,
                                                           attention_multiplier=0.2)),
    "phi3-fused-rows-partial-rotary-window": ("phi3", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                           sliding_window=5, rope_parameters={
                                                               "rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": 0.5})),
}
BLOCKS_ONLY = {   # layers the fused kernel does not run: these decode through the blocks
    "qwen2moe-shared-expert": ("qwen2_moe", dict(moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                                 num_experts=6, num_experts_per_tok=2)),
    "olmoe-clip-full-norms": ("olmoe", dict(num_experts=8, num_experts_per_tok=3, clip_qkv=0.8)),
    "gptoss-sinks-biases-clamp": ("gpt_oss", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                                                  sliding_window=4, swiglu_limit=0.5)),
    "granitemoe-multipliers": ("granitemoe", dict(num_local_experts=8, num_experts_per_tok=2, residual_multiplier=0.5,
                                                  logits_scaling=2.0)),
}


def _model(tmp_path_factory, case: dict, name: str):
    model_type, overrides = case[name]
    src = build_checkpoint(tmp_path_factory.mktemp(name), model_type, **overrides)
    return load_model(convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None))


def _greedy(model, fused: bool, pool: KVPool | None = None):
    model.context.fused_decode = fused
    cache = KVCache(model.spec, 64, pool=pool)
    logits = model.forward(PROMPT, cache)[-1]
    out, routes = [], []
    for _ in range(STEPS):
        token = int(logits.argmax())
        routing = []
        logits = model.forward([token], cache, routing=routing)[-1]
        out.append(logits)
        routes.append([(r.layer, r.experts.tolist(), r.weights.tobytes()) for r in routing])
    cache.release()
    return np.stack(out), routes


def _slot_bytes(out) -> int:
    """The bytes of one expert's slot in a streamed load of the container `out`."""
    from engine.loader import OffloadOptions
    from engine.offload.store import StoreSettings

    probe = load_model(out, offload=OffloadOptions(StoreSettings(capacity=1 << 30)))
    try:
        return probe.store.slot_bytes
    finally:
        probe.close()


@pytest.fixture
def threads():
    before = numba.get_num_threads()
    yield numba.set_num_threads
    numba.set_num_threads(before)


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_steps_equal_the_blocks(tmp_path_factory, threads, name):
    loaded = _model(tmp_path_factory, FUSED, name)
    model = loaded.model
    want_logits, want_routes = _greedy(model, fused=False)
    assert model.context.fused is False                           # never built: the blocks ran every step
    for n in (1, 2):
        threads(n)
        pool = KVPool(model.spec, 32, block_size=4)               # the sequence spans several blocks
        logits, routes = _greedy(model, fused=True, pool=pool)
        assert model.context.fused is not None and model.context.fused is not False
        assert np.array_equal(logits, want_logits), n
        assert routes == want_routes, n


@pytest.mark.parametrize("io", ["pread", "mmap"])
def test_streamed_experts_fused_equal_the_blocks(tmp_path_factory, threads, io):
    """Streamed experts: each call stops at a layer's routing, the store brings the experts in (in groups as reads
    finish), the next calls run them; the same bits as the blocks, and as the resident model."""
    from engine.fused import kernel as fk
    from engine.fused.plan import FusedDecode
    from engine.loader import OffloadOptions
    from engine.offload.store import StoreSettings

    model_type, overrides = FUSED["qwen3-moe-head-norms-unnormed"]      # a dense layer among the MoE ones
    src = build_checkpoint(tmp_path_factory.mktemp("s"), model_type, **overrides)
    out = convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None)
    resident, _ = _greedy(load_model(out).model, fused=True)
    slot = _slot_bytes(out)
    for n in (1, 2):
        threads(n)
        loaded = load_model(out, offload=OffloadOptions(StoreSettings(capacity=3 * slot, io=io, policy="lru"), 1))
        try:
            model = loaded.model
            want_logits, want_routes = _greedy(model, fused=False)
            logits, routes = _greedy(model, fused=True)
            assert isinstance(model.context.fused, FusedDecode)
            assert model.context.fused.lay[:, fk.L_STREAMED].sum() > 0   # the streamed layers stopped for their experts
            assert loaded.store.stats().hits["disk"] > 0
        finally:
            loaded.close()
        assert np.array_equal(logits, want_logits), n
        assert routes == want_routes, n
        assert np.array_equal(logits, resident), n


def test_a_streamed_decode_stops_reading_ahead_when_that_is_slower(tmp_path_factory, monkeypatch):
    """The fused step reads ahead for its first steps, then measures: with the guesses made slow, the steps go on
    without them (trying them now and then), and the answer is the resident model's either way."""
    from engine.loader import OffloadOptions
    from engine.offload.store import StoreSettings
    from engine.tuning import FasterChoice

    model_type, overrides = FUSED["mixtral"]
    src = build_checkpoint(tmp_path_factory.mktemp("a"), model_type, **overrides)
    out = convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None)
    resident = load_model(out).model
    slot = _slot_bytes(out)
    loaded = load_model(out, offload=OffloadOptions(StoreSettings(capacity=3 * slot, policy="lru"), 1))
    try:
        model = loaded.model
        guesses = []
        real = model.context.predict
        monkeypatch.setattr(model.context, "predict",
                            lambda j, x: (guesses.append(len(steps)), time.sleep(0.02), real(j, x)))
        cache, want_cache = KVCache(model.spec, 128), KVCache(resident.spec, 128)
        logits, want = model.forward(PROMPT, cache)[-1], resident.forward(PROMPT, want_cache)[-1]
        steps = []
        for _ in range(6 * FasterChoice.PROBE):
            assert np.array_equal(logits, want)
            token = int(want.argmax())
            steps.append(token)
            logits, want = model.forward([token], cache)[-1], resident.forward([token], want_cache)[-1]
    finally:
        loaded.close()
    ahead = sorted(set(guesses))                                  # the steps that read ahead
    assert ahead[:FasterChoice.FIRST + 1] == list(range(1, FasterChoice.FIRST + 2))   # the first steps did
    late = [s for s in ahead if s > 2 * FasterChoice.PROBE]
    assert 1 <= len(late) <= 4                                    # then only the tries (16, 32, 64 steps apart)


def test_streamed_layers_whose_experts_are_in_memory_run_on_without_stopping(tmp_path_factory, monkeypatch):
    """With every expert in memory a streamed token is one call (no stop per layer), and the store counts the
    layers it ran as if it had been asked for them: the same hits and steps as the blocks path."""
    from engine.fused import kernel as fk
    from engine.loader import OffloadOptions
    from engine.offload.store import StoreSettings

    model_type, overrides = FUSED["mixtral"]
    src = build_checkpoint(tmp_path_factory.mktemp("r"), model_type, **overrides)
    out = convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None)
    calls = []
    real = fk.decode_step
    monkeypatch.setattr(fk, "decode_step", lambda *a: (calls.append(1), real(*a)))
    results = {}
    for fused in (False, True):
        loaded = load_model(out, offload=OffloadOptions(StoreSettings(capacity=1 << 30, policy="lru"), 1))
        try:
            model = loaded.model
            model.context.fused_decode = fused
            cache = KVCache(model.spec, 64)
            logits = model.forward(PROMPT, cache)[-1]
            store = loaded.store
            for layer in sorted({key[0] for key in store.recipes}):   # every expert in memory from here on
                for _ in store.groups(layer, list(range(8))):
                    pass
            for _ in range(3):                              # the first fused token loads kernels; then one call each
                logits = model.forward([int(logits.argmax())], cache)[-1]
            calls.clear()
            out_logits = []
            for _ in range(STEPS):
                logits = model.forward([int(logits.argmax())], cache)[-1]
                out_logits.append(logits)
            stats = loaded.store.stats()
            results[fused] = (np.stack(out_logits), dict(stats.hits), loaded.store.accounting.now, len(calls))
        finally:
            loaded.close()
    (want, want_hits, want_now, _), (got, hits, now, n_calls) = results[False], results[True]
    assert np.array_equal(got, want)
    assert hits == want_hits and now == want_now                # counted as the blocks path counts
    assert n_calls == STEPS                                      # one call a token: no layer stopped


@pytest.mark.parametrize("name", list(BLOCKS_ONLY))
def test_other_layers_decode_through_the_blocks(tmp_path_factory, name):
    model = _model(tmp_path_factory, BLOCKS_ONLY, name).model
    want, _ = _greedy(model, fused=False)
    got, _ = _greedy(model, fused=True)
    assert model.context.fused is None                            # looked at once, and declined
    assert np.array_equal(got, want)


@pytest.mark.parametrize("bits, close", [(16, 3e-2), (8, 5e-2)])   # 8-bit activations widen fp16's 1e-2 a little
def test_rounded_kv_fused_equals_the_blocks(tmp_path_factory, threads, bits, close):
    """Keys and values stored as fp16, or as int8 with a scale per row: the fused step rounds them as the cache's
    writer does, and reads them back the same way as the blocks' attention."""
    model = _model(tmp_path_factory, FUSED, "mixtral-window-mha").model
    want, want_routes = _greedy(model, fused=False, pool=KVPool(model.spec, 32, block_size=4, bits=bits))
    for n in (1, 2):
        threads(n)
        pool = KVPool(model.spec, 32, block_size=4, bits=bits)
        got, routes = _greedy(model, fused=True, pool=pool)
        plan = model.context.fused
        assert plan not in (None, False) and plan.accepts(KVCache(model.spec, 8, pool=pool))
        assert np.array_equal(got, want), n
        assert routes == want_routes, n
    exact, _ = _greedy(model, fused=True, pool=KVPool(model.spec, 32, block_size=4))
    assert not np.array_equal(got, exact)                          # it did round
    assert np.abs(got - exact).max() < close * np.abs(exact).max()


@pytest.mark.parametrize("bits", [32, 8])
def test_retention_fused_equals_the_blocks(tmp_path_factory, threads, bits):
    """A cache that keeps attention weights for retention: the fused step hands each layer's weights over as the
    blocks' attention does, so the heavy-hitter scores, the blocks kept past the context and the logits agree bit
    for bit."""
    model = _model(tmp_path_factory, FUSED, "mixtral-window-mha").model
    stream = PROMPT + PROMPT[:8] + PROMPT                       # 34 tokens through a context of 16

    def run(fused: bool):
        model.context.fused_decode = fused
        pool = KVPool(model.spec, 16, block_size=4, bits=bits)
        cache = KVCache(model.spec, 16, pool=pool, overflow="retain", sink_tokens=4, recent_tokens=4)
        out = [model.forward(stream[:6], cache)[-1]]
        for t in stream[6:]:
            out.append(model.forward([t], cache)[-1])
        return np.stack(out), cache

    want, blocks = run(False)
    for n in (1, 2):
        threads(n)
        got, fused = run(True)
        assert model.context.fused not in (None, False) and model.context.fused.accepts(fused)
        assert np.array_equal(got, want), n
        assert np.array_equal(fused.heat, blocks.heat) and fused.tokens == blocks.tokens, n
    assert blocks.evicted > 0 and blocks.tokens[:4] == stream[:4]     # retention ran: the sinks stayed


def test_single_tokens_of_several_sequences_take_the_faster_way_with_the_same_bits(tmp_path_factory, monkeypatch):
    """One token of each of several sequences runs as one step for all (the batch's fused step) or as a fused step
    per sequence, whichever measured faster at that batch size; both are tried, and each sequence gets the logits
    it gets alone."""
    from engine.fused.plan import FusedDecode
    from engine.tuning import FasterChoice

    model = _model(tmp_path_factory, FUSED, "mixtral").model
    prompts = [PROMPT, PROMPT[3:], PROMPT[:7]]
    alone = []
    for p in prompts:                                            # each sequence by itself, through the blocks
        model.context.fused_decode = False
        cache = KVCache(model.spec, 64)
        rows = [model.forward(p, cache)[-1]]
        for _ in range(3 * FasterChoice.PROBE):
            rows.append(model.forward([int(rows[-1].argmax())], cache)[-1])
        alone.append(np.stack(rows))
    model.context.fused_decode = True
    fused_calls = []
    real = FusedDecode.run
    monkeypatch.setattr(FusedDecode, "run", lambda self, *a, **k: (fused_calls.append(1), real(self, *a, **k))[1])
    caches = [KVCache(model.spec, 64) for _ in prompts]
    logits = [model.forward(p, c)[-1] for p, c in zip(prompts, caches)]
    ways = []
    for step in range(3 * FasterChoice.PROBE):
        before = len(fused_calls)
        out = model.forward_batch([([int(x.argmax())], c) for x, c in zip(logits, caches)])
        ways.append(len(fused_calls) - before)
        logits = [o[-1] for o in out]
        for k, x in enumerate(logits):
            assert np.array_equal(x, alone[k][step + 1]), (step, k)
    assert ways[0] == len(prompts) and 0 in ways                 # a fused step each first, then one pass tried
    assert set(ways) == {0, len(prompts)}
    apart = model.context.apart       # steps of 3 sequences chose among themselves, not with other batch sizes
    assert apart[3].steps == 3 * FasterChoice.PROBE and apart[2].steps == 0


def test_a_sequence_that_cannot_go_on_fails_the_step_before_any_other_has_run(tmp_path_factory):
    """Several sequences' tokens run a fused step each: one whose context is full fails the whole step first, so
    a retry (as the scheduler retries one by one) does not run the others twice."""
    from engine.errors import GenerationError
    from engine.tuning import BySize, FasterChoice

    model = _model(tmp_path_factory, FUSED, "mixtral").model
    model.context.apart = BySize(FasterChoice)                    # a fresh choice starts with a fused step each
    roomy, full = KVCache(model.spec, 64), KVCache(model.spec, len(PROMPT))
    token = int(model.forward(PROMPT, roomy)[-1].argmax())
    model.forward(PROMPT, full)
    with pytest.raises(GenerationError, match="context holds"):
        model.forward_batch([([token], roomy), ([token], full)])
    assert roomy.length == len(PROMPT)                            # nothing ran for it
    alone = KVCache(model.spec, 64)
    model.forward(PROMPT, alone)
    assert np.array_equal(model.forward([token], roomy), model.forward([token], alone))


def test_the_int8_row_encoder_is_the_caches(tmp_path_factory):
    """The fused step's int8 writer gives the numpy writer's rows and scales, ties and zeros included."""
    from engine.kernels.attention import encode_i8_row
    from engine.kv.layers import _encode

    rng = np.random.default_rng(3)
    rows = rng.standard_normal((64, 48)).astype(np.float32) * rng.uniform(0.01, 100, (64, 1)).astype(np.float32)
    rows[0] = 0.0                                                  # an all-zero row: scale 0, values 0
    rows[1] = 0.0
    rows[1, :4] = [127.0, 0.5, -1.5, 2.5]                          # scale 1: halves are ties, rounded to even
    want, want_scale = _encode(rows, np.dtype(np.int8))
    got = np.zeros_like(want)
    scales = np.array([encode_i8_row(r, r.size, got[i], 0) for i, r in enumerate(rows)], np.float32)
    assert np.array_equal(got, want) and np.array_equal(scales, want_scale)


def test_probes_take_the_blocks(tmp_path_factory):
    model = _model(tmp_path_factory, FUSED, "mixtral").model
    seen = []
    cache = KVCache(model.spec, 64)
    model.forward(PROMPT, cache)
    model.forward([3], cache, probe=lambda name, x: seen.append(name))
    assert seen                                                   # a probe sees every product: the blocks ran


def test_thread_choice_follows_the_faster_count():
    from engine.tuning import ThreadChoice

    choice = ThreadChoice()
    picks = []
    for _ in range(4 * ThreadChoice.PROBE):
        n = choice.pick(2)
        picks.append(n)
        choice.record(n, 0.030 if n == 2 else 0.020)     # another program holds the second core
    first = ThreadChoice.FIRST + 1                        # each count's first step is not counted
    assert picks[:first] == [2] * first and picks[first:2 * first] == [1] * first   # both counts tried first
    late = picks[2 * ThreadChoice.PROBE:]
    assert late.count(1) > late.count(2) >= 1             # one thread from then on, two now and then
    assert choice.tries == first + picks[2 * first:].count(2)   # the steps that measured the count not chosen
    assert ThreadChoice().pick(1) == 1


def test_thread_choice_tries_the_other_count_less_often_while_it_keeps_losing():
    from engine.tuning import ThreadChoice

    choice = ThreadChoice()
    picks = []
    for step in range(4000):
        n = choice.pick(2)
        picks.append(n)
        two = 0.010 if step < 2000 else 0.040                  # a quiet machine, then another program arrives
        choice.record(n, two if n == 2 else 0.020)
    early = picks[2 * (ThreadChoice.FIRST + 1):2000]            # after both counts' first measurements
    assert 3 <= early.count(1) <= 8                            # tries at 16, 32, 64, ... steps apart
    assert picks[-500:].count(1) > 450                          # the load came: one thread, found by a try


def _container(tmp_path_factory, name: str):
    """A 4-bit container of the FUSED case `name`."""
    model_type, overrides = FUSED[name]
    src = build_checkpoint(tmp_path_factory.mktemp(name), model_type, **overrides)
    return convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None)


def _counting_stops(monkeypatch, store) -> list:
    """The layer steps a fused call stopped for (the store's `groups`, which the engine thread drives)."""
    stops = []
    real = store.groups

    def groups(layer, ids, started=None):
        stops.append(layer)
        return real(layer, ids, started)
    monkeypatch.setattr(store, "groups", groups)
    return stops


def test_a_streamed_call_waits_for_the_experts_it_lacks_instead_of_stopping(tmp_path_factory, monkeypatch, threads):
    """While a call runs, its driver thread reads the experts a layer lacks (and the guesses of later layers), and
    the call waits for them where it is, running the layer's experts that are in memory meanwhile: most misses cost
    no stop, and the answer is the resident model's."""
    from engine.fused.driver import Driver
    from engine.loader import OffloadOptions
    from engine.offload.store import StoreSettings

    some = []                                          # per call, the layers run in two parts (W_SOME)
    end = Driver.end

    def counting_end(driver):
        n = driver.n
        some.append(int(np.count_nonzero(driver.post[driver.layout.second : driver.layout.second + n])))
        end(driver)
    monkeypatch.setattr(Driver, "end", counting_end)
    out = _container(tmp_path_factory, "mixtral")
    want, _ = _greedy(load_model(out).model, fused=True)
    slot = _slot_bytes(out)
    for n in (1, 2):
        threads(n)
        loaded = load_model(out, offload=OffloadOptions(StoreSettings(capacity=5 * slot, policy="lru"), 1))
        try:
            model = loaded.model
            stops = _counting_stops(monkeypatch, loaded.store)
            before = loaded.store.stats().hits["disk"]
            got, _ = _greedy(model, fused=True)
            assert model.context.fused.driver is not None
            disk = loaded.store.stats().hits["disk"] - before
        finally:
            loaded.close()
        assert np.array_equal(got, want), n
        assert disk > 0
        assert len(stops) < disk / 2, (n, len(stops), disk)      # most misses were waited for in the call
        assert sum(some) > 0, n                                  # some while others ran
        some.clear()


def test_a_guess_does_not_wake_the_driver_which_reads_it_when_awake(tmp_path_factory, monkeypatch):
    """The read-ahead's guesses are posted without waking the driver thread: what it reads from its eventfd adds
    up to no more than the wake-ups of calls beginning, of reads completing (1 each) and of the kernel's posts of
    needs (the experts asked for, counted from the post as each call ends: a need may be met by reads in flight
    before the driver is awake to take it, and the next token clears it); awake, it hands the guesses posted by then
    to `prefetch`, which reads them. The answer is the resident model's."""
    import threading

    from engine.fused import driver as fused_driver
    from engine.loader import OffloadOptions
    from engine.offload.store import ExpertStore, StoreSettings

    counts = {"woken": 0, "poked": 0, "posted": 0, "asked": 0, "ahead": 0}
    lock = threading.Lock()                             # (pokes come from the engine's and the readers' threads)
    posted: set[int] = set()                            # layers whose needs this token are counted
    eventfd_read, poke, need, prefetch = os.eventfd_read, fused_driver._Wake.poke, ExpertStore.need, ExpertStore.prefetch
    token, end = fused_driver.Driver.token, fused_driver.Driver.end

    def count(name, n):
        with lock:
            counts[name] += n

    def woken(fd):
        value = eventfd_read(fd)
        count("woken", value)
        return value

    def poked(wake):
        count("poked", 1)
        poke(wake)

    def new_token(driver):
        posted.clear()
        token(driver)

    def ended(driver):
        n, needed = driver.n, driver.layout.needed
        for j in np.flatnonzero(driver.post[needed : needed + n]).tolist():
            if j not in posted:                         # the kernel wrote this count to the eventfd as it posted
                posted.add(j)
                count("posted", int(driver.post[needed + j]))
        end(driver)

    def asked(store, layer, ids, *meanwhile):
        count("asked", len(ids))
        return need(store, layer, ids, *meanwhile)

    def reading_ahead(store, layer, ids, read=True):
        count("ahead", read and threading.current_thread().name == "colibri-read-ahead")
        return prefetch(store, layer, ids, read)
    monkeypatch.setattr(fused_driver.os, "eventfd_read", woken)
    monkeypatch.setattr(fused_driver._Wake, "poke", poked)
    monkeypatch.setattr(fused_driver.Driver, "token", new_token)
    monkeypatch.setattr(fused_driver.Driver, "end", ended)
    monkeypatch.setattr(ExpertStore, "need", asked)
    monkeypatch.setattr(ExpertStore, "prefetch", reading_ahead)
    out = _container(tmp_path_factory, "mixtral")
    want, _ = _greedy(load_model(out).model, fused=True)
    loaded = load_model(out, offload=OffloadOptions(StoreSettings(capacity=5 * _slot_bytes(out), policy="lru"), 1))
    try:
        model = loaded.model
        monkeypatch.setattr(model.context.ahead, "pick", lambda preferred, other: preferred)   # always reading ahead
        got, _ = _greedy(model, fused=True)
    finally:
        loaded.close()
    assert np.array_equal(got, want)
    assert counts["asked"] > 0 and counts["ahead"] > 0, counts   # misses waited for, guesses read while awake
    assert 0 < counts["asked"] <= counts["posted"], counts
    assert 0 < counts["woken"] <= counts["poked"] + counts["posted"], counts   # no wake-up of a guess's own


def test_an_error_of_the_driver_stops_the_call_and_reaches_the_caller(tmp_path_factory, monkeypatch):
    """A failure on the driver thread does not leave a call waiting for experts that will not come: the call stops
    and the error is raised on the engine thread."""
    from engine.loader import OffloadOptions
    from engine.offload.store import StoreSettings

    out = _container(tmp_path_factory, "mixtral")
    slot = _slot_bytes(out)
    loaded = load_model(out, offload=OffloadOptions(StoreSettings(capacity=3 * slot, policy="lru"), 1))
    try:
        model = loaded.model
        cache = KVCache(model.spec, 64)
        token = int(model.forward(PROMPT, cache)[-1].argmax())

        def broken(layer, ids, meanwhile):
            raise OSError("the disk went away")
        monkeypatch.setattr(loaded.store, "need", broken)
        with pytest.raises(OSError, match="went away"):
            for _ in range(STEPS):                         # (a token whose experts are all in memory asks nothing)
                token = int(model.forward([token], cache)[-1].argmax())
    finally:
        loaded.close()


def test_an_expert_leaving_is_not_read_over_while_a_thread_may_read_it(tmp_path_factory):
    """An expert at whose layer a thread of a running call is does not give up its slot: the driver's ask is refused
    (it stays flagged), and the store's word that it leaves returns only once the thread has moved on (the slot is
    then read over). An expert of another layer leaves at once."""
    import threading

    from engine.fused import kernel as fk
    from engine.loader import OffloadOptions
    from engine.offload.store import StoreSettings

    out = _container(tmp_path_factory, "mixtral")
    loaded = load_model(out, offload=OffloadOptions(StoreSettings(capacity=1 << 30, policy="lru"), 1))
    try:
        model = loaded.model
        model.forward([int(model.forward(PROMPT, KVCache(model.spec, 64))[-1].argmax())], KVCache(model.spec, 64))
        plan = model.context.fused
        layer = plan.streamed_layers[-1]
        assert plan.streamed_layers[0] != layer
        plan.flags[layer, :] = 1
        plan.cur[1 * fk.LINE] = layer                      # thread 1 of a call is at this layer
        assert not plan._release((layer, 2))               # the driver asks first: not now, and still flagged
        assert plan.flags[layer, 2] == 1
        other = plan.streamed_layers[0]
        plan.flags[other, 2] = 1
        assert plan._release((other, 2)) and plan.flags[other, 2] == 0   # another layer's may go
        left = threading.Event()
        t = threading.Thread(target=lambda: (plan._held((layer, 0), None), left.set()))
        t.start()
        assert not left.wait(0.2)                          # still waiting
        assert plan.flags[layer, 0] == 0                   # unflagged first: a thread arriving later sees it gone
        plan._held((plan.streamed_layers[0], 1), None)   # another layer: at once
        plan.cur[1 * fk.LINE] = -1                          # the thread moved on
        assert left.wait(5)
        t.join()
    finally:
        loaded.close()


def test_a_corrupt_expert_a_running_call_used_is_refused_before_its_answer(tmp_path_factory):
    """The driver's reads are checked after they land, while the call may already run them (the check is off its
    path): the step raises once the call returns, before its logits are given, and the expert is not kept."""
    import shutil

    from engine.errors import ModelFormatError
    from engine.formats.container import Container
    from engine.loader import OffloadOptions
    from engine.offload.store import StoreSettings

    out = _container(tmp_path_factory, "mixtral")
    copy = tmp_path_factory.mktemp("bad") / "model"
    shutil.copytree(out, copy)
    extents = Container.open(copy, verify=False).extents
    for key in [k for k in extents if isinstance(k, tuple) and k[0] == 1]:   # every expert of layer 1
        x = extents[key]
        with open(copy / x.file, "r+b") as f:
            f.seek(x.offset + 100)
            byte = f.read(1)
            f.seek(x.offset + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
    # room for every expert: the driver always finds a slot, so the call never stops for `groups` to read them
    loaded = load_model(copy, offload=OffloadOptions(StoreSettings(capacity=1 << 30, policy="lru"), 1))
    try:
        model = loaded.model
        model.context.fused_decode = True
        cache = KVCache(model.spec, 64)
        token = PROMPT[0]
        with pytest.raises(ModelFormatError, match="checksum mismatch in expert [0-9]+ of layer 1") as raised:
            for _ in range(STEPS):
                token = int(model.forward([token], cache)[-1].argmax())
        assert model.context.fused.driver is not None
        assert "account_steps" in [entry.name for entry in raised.traceback]    # counted after the call: it ran them
        e = int(re.search(r"expert ([0-9]+) of layer 1", str(raised.value)).group(1))
        assert (1, e) not in loaded.store.built
        with pytest.raises(ModelFormatError, match="checksum mismatch"):   # nor any other of them, read or not
            for _ in range(STEPS):
                token = int(model.forward([token], cache)[-1].argmax())
    finally:
        loaded.close()
