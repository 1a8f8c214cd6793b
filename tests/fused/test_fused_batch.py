"""The fused step of a batch: one token of each of several sequences through every layer in one parallel region
(engine/fused/batch.py) gives each sequence the logits its own single fused step gives, bit for bit, for 2, 3
and 8 sequences at different positions, with one thread or two, dense layers or routed experts (each expert the
batch chose read once for the rows that chose it); the other ways to decode a batch give the same bits."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.fused.batch import BatchedDecode
from engine.kv import KVCache, KVPool
from engine.loader import load_model
from support.batching import greedy_alone, greedy_together
from support.reference import build_checkpoint

PROMPTS = [[5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9], [7, 7, 1], [120, 3, 4, 5, 6, 9, 11], [12],
           [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 2, 3, 4, 5, 6, 7], [77, 78], [1, 2, 3, 4, 5], [33, 34, 35, 36]]
STEPS = 6
CASES = {
    "llama-tied-mqa": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen2-qkv-bias-window": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
}


def _model(tmp_path_factory, name: str, bits: int = 4):
    """The case's tiny model converted at `bits` (4: the rows16 integer kernels; 3 and 2: the float planes')."""
    model_type, overrides = CASES[name]
    src = build_checkpoint(tmp_path_factory.mktemp(name), model_type, **overrides)
    return load_model(convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=bits),
                              log=lambda m: None)).model


@pytest.fixture
def threads():
    before = numba.get_num_threads()
    yield numba.set_num_threads
    numba.set_num_threads(before)


@pytest.mark.parametrize("name,bits", [("llama-tied-mqa", 4), ("qwen2-qkv-bias-window", 4), ("llama-tied-mqa", 2),
                                       ("mixtral", 4), ("mixtral", 2)])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_a_batch_fused_together_equals_each_sequence_alone(tmp_path_factory, monkeypatch, threads, name, bits, n):
    model = _model(tmp_path_factory, name, bits)
    assert model.context.batch_fused, "on by default"
    pool = KVPool(model.spec, 8 * 20, block_size=4)                  # several blocks per sequence
    prompts = PROMPTS[:n]
    for t in (1, 2):
        threads(t)
        alone = greedy_alone(model, pool, prompts, STEPS)
        together, calls = greedy_together(model, pool, prompts, STEPS, monkeypatch, 0)
        assert calls == STEPS                                        # every step ran as the batch's fused step
        for k in range(n):
            assert np.array_equal(together[k], alone[k]), (t, k)


def test_experts_report_each_rows_routing_and_decode_any_way_with_the_same_bits(tmp_path_factory, monkeypatch):
    """A MoE model's batch reports, per layer, the experts each sequence's token chose alone (the blocks' routing);
    a fused step each, or one pass of the blocks for all (the fused batch switched off), give the same bits."""
    model = _model(tmp_path_factory, "mixtral")
    pool = KVPool(model.spec, 8 * 20, block_size=4)
    prompts = PROMPTS[:5]
    caches = [KVCache(model.spec, 64, pool=pool) for _ in prompts]
    tokens = [int(model.forward(p, c)[-1].argmax()) for p, c in zip(prompts, caches)]
    alone = []
    for t, c in zip(tokens, caches):                     # each token by the blocks, its routing reported
        routing: list = []
        model.forward_batch([([t], c)], routing=routing)
        c.truncate(c.length - 1)
        alone.append(routing)
    reported = []
    real = BatchedDecode.run

    def spy(self, *a):
        out = real(self, *a)
        reported.append(out[1])
        return out
    monkeypatch.setattr(BatchedDecode, "run", spy)
    model.forward_batch([([t], c) for t, c in zip(tokens, caches)])
    for c in caches:
        c.release()
    assert reported and len(reported[0]) == model.spec.n_layers
    for r in reported[0]:
        for b in range(len(prompts)):
            mine = next(a for a in alone[b] if a.layer == r.layer)
            assert np.array_equal(r.experts[b], mine.experts[0]) and np.array_equal(r.weights[b], mine.weights[0])
    monkeypatch.undo()
    expected = greedy_alone(model, pool, prompts, STEPS)
    together, calls = greedy_together(model, pool, prompts, STEPS, monkeypatch, 1)
    assert calls == 0
    model.context.batch_fused = False
    blocks, calls = greedy_together(model, pool, prompts, STEPS, monkeypatch, 0)
    assert calls == 0
    for k in range(len(prompts)):
        assert np.array_equal(together[k], expected[k]) and np.array_equal(blocks[k], expected[k]), k


def test_the_batch_step_chooses_its_threads_per_batch_size_with_the_same_bits(tmp_path_factory, monkeypatch, threads):
    """The batch's fused step first runs on every thread, then tries one (its choice, one per batch size, measures
    both); each sequence gets the logits it gets alone whatever the count."""
    from engine.fused import batch as fused_batch
    from engine.tuning import ThreadChoice

    model = _model(tmp_path_factory, "llama-tied-mqa")
    pool = KVPool(model.spec, 8 * 20, block_size=4)
    threads(2)
    alone = greedy_alone(model, pool, PROMPTS[:3], STEPS)
    used = []
    real = fused_batch.decode_batch
    monkeypatch.setattr(fused_batch, "decode_batch", lambda t, *a: (used.append(t), real(t, *a))[1])
    together, calls = greedy_together(model, pool, PROMPTS[:3], STEPS, monkeypatch, 0)
    first = ThreadChoice.FIRST + 1                   # each count's first step is not counted
    assert calls == STEPS and used == [2] * first + [1] * (STEPS - first)
    for k in range(3):
        assert np.array_equal(together[k], alone[k]), k
    batched = model.context.batched
    assert batched is not None and batched._threads[3].steps == STEPS and batched._threads[2].steps == 0
    # the steps that tried one thread are no measure of the batch's way against a fused step each: not counted
    assert batched.tries(3) == STEPS - first
    assert len(model.context.apart[3].walls[0]) == first - 1          # (its first step is not counted either)


def test_the_bench_sets_batched_experts_against_the_bound_of_their_union(tmp_path_factory, monkeypatch):
    """The batched steps count the experts they read (each layer's union); the bench's bound is n sequences' bytes
    over a step's: above 1 (dense weights read once), below n (rows share experts only by chance)."""
    from app.bench.kv import _union_bound

    model = _model(tmp_path_factory, "mixtral")
    pool = KVPool(model.spec, 8 * 20, block_size=4)
    assert _union_bound(model, 3) is None                                     # no batched step yet
    greedy_together(model, pool, PROMPTS[:3], STEPS, monkeypatch, 0)
    steps, experts = model.context.batched.reads[3]
    moe = model.spec.n_layers                                                 # every layer routes: 8 experts, top 2
    assert steps == STEPS and moe * 2 * STEPS <= experts <= moe * 6 * STEPS
    bound = _union_bound(model, 3)
    assert 1 < bound < 3
    model.context.batched.reads[3] = [1, moe * 2]            # had the rows all chosen the same experts: 3 for 3
    assert _union_bound(model, 3) == pytest.approx(3)
    model.context.batched.reads[3] = [1, moe * 6]            # each row its own experts: the least the union saves
    assert 1 < _union_bound(model, 3) <= bound


@pytest.mark.parametrize("io", ["pread", "mmap"])
def test_a_streamed_batch_reads_each_chosen_expert_once_with_each_sequences_bits(tmp_path_factory, monkeypatch,
                                                                                 threads, io):
    """Streamed experts: a batch's step stops at a layer whose union is not all in memory, the store brings the
    union once (in groups when the cache holds fewer slots than the union, each group a call), and each sequence
    gets the logits of its own steps on the resident model."""
    from support.offload import load_streamed, mixtral_container

    container = mixtral_container(tmp_path_factory, experts=8, top_k=2, layers=2)
    resident = load_model(container).model
    prompts = PROMPTS[:4]
    alone = greedy_alone(resident, KVPool(resident.spec, 8 * 20, block_size=4), prompts, STEPS)
    for t in (1, 2):
        threads(t)
        loaded = load_streamed(container, 3, io=io, policy="lru")    # 3 slots: a union of up to 8 in groups
        try:
            model, store = loaded.model, loaded.store
            asked = []
            real = store.groups

            def groups(layer, ids, started=None):
                asked.append((layer, list(ids)))
                return real(layer, ids, started)
            monkeypatch.setattr(store, "groups", groups)
            before = store.stats().hits["disk"]
            pool = KVPool(model.spec, 8 * 20, block_size=4)
            together, calls = greedy_together(model, pool, prompts, STEPS, monkeypatch, 0)
            disk = store.stats().hits["disk"] - before
        finally:
            loaded.close()
        assert calls == STEPS                                        # every step ran as the batch's fused step
        for k in range(len(prompts)):
            assert np.array_equal(together[k], alone[k]), (t, k)
        steps = asked[model.spec.n_layers * len(prompts):]          # after each prompt's pass of the blocks
        assert steps and len(steps) <= STEPS * model.spec.n_layers
        for layer, ids in steps:
            assert ids == sorted(set(ids)) and len(ids) > 2          # one union of 4 rows' experts, each once
        assert disk > 0


def test_the_scheduler_runs_together_only_the_sequences_whose_steps_the_expert_cache_holds(tmp_path_factory):
    """A streamed model's scheduler admits as many sequences at once as the expert cache holds a step of (more
    would read over each other's experts at every step); each answer is its answer alone on the resident model."""
    from engine.generation.generate import GenerationRequest
    from engine.generation.scheduler import Scheduler
    from support.offload import load_streamed, mixtral_container

    container = mixtral_container(tmp_path_factory, experts=8, top_k=2, layers=2)
    resident = load_model(container).model

    def answers(model, max_batch):
        sched = Scheduler(model, KVPool(model.spec, 8 * 20, block_size=4), max_len=40, max_batch=max_batch)
        seqs = [sched.submit(GenerationRequest(prompt=tuple(p), max_tokens=STEPS, stop_ids=frozenset()))
                for p in PROMPTS[:4]]
        widest = 0
        while sched.busy:
            sched.step()
            widest = max(widest, len(sched.running))
        return [s.tokens for s in seqs], sched.room, widest

    want, _, _ = answers(resident, 1)
    for slots, room in ((3, 1), (32, 4)):
        loaded = load_streamed(container, slots)
        try:
            got, at_once, widest = answers(loaded.model, 4)
        finally:
            loaded.close()
        assert at_once == room and widest == room, slots
        assert got == want, slots
