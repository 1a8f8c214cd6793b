"""Sliding-window layers in the paged KV cache: they keep only their window's rows (the rest dropped, its pages
returned), and nothing a query attends to is ever dropped: outputs are those of a cache that keeps everything."""

from __future__ import annotations

import numpy as np
import pytest

from engine.generation.prefill import prefill
from engine.kv import KVCache, KVPool, blocks_for
from engine.loader import load_model
from support.tiny_checkpoint import write_tiny

VOCAB = 96
# Gemma 2's alternating local (window 12) and global layers, soft-capping off so the paged kernel runs them
GEMMA2 = {
    "architectures": ["Gemma2ForCausalLM"], "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
    "vocab_size": VOCAB, "sliding_window": 12, "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "max_position_embeddings": 1024,
}
# Mistral's window on every layer; Gemma 2 with soft-capped scores (attention in numpy, reading the window only)
MISTRAL = {
    "architectures": ["MistralForCausalLM"], "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB, "sliding_window": 9,
    "max_position_embeddings": 1024,
}
CAPPED = {**GEMMA2, "attn_logit_softcapping": 5.0, "sliding_window": 7}
CONFIGS = {"gemma2": GEMMA2, "mistral": MISTRAL, "gemma2-capped": CAPPED}


def _model(tmp_path, config):
    return load_model(write_tiny(tmp_path / config["architectures"][0], config)).model


def _tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def _poison(pool: KVPool) -> None:
    """NaN into every dropped row: a query that read one would give NaN logits."""
    for j, arrays in enumerate(pool.layers):
        g = pool.group[j]
        if g >= 0 and pool.dropped[g].any():
            for name in ("ks", "vs"):
                arrays[name][pool.dropped[g]] = np.nan


def _decode(model, cache: KVCache, prompt: list[int], n: int, chunk: int) -> tuple[list[np.ndarray], list[int]]:
    """Prefill in chunks, then n greedy tokens, poisoning dropped rows before each step; (logits, tokens)."""
    rows, out = [prefill(model, prompt, cache, chunk=chunk)], []
    for _ in range(n):
        out.append(int(rows[-1].argmax()))
        _poison(cache.pool)
        rows.append(model.forward([out[-1]], cache)[-1])
    return rows, out


def _fresh(model, tokens: list[int]) -> np.ndarray:
    """Logits [T, V] of one pass over all tokens in a cache that drops nothing before its end."""
    return model.forward(tokens, KVCache(model.spec, len(tokens) + 8), all_logits=True)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dropped_rows_are_never_read(name, tmp_path):
    model = _model(tmp_path, CONFIGS[name])
    pool = KVPool(model.spec, 64, block_size=4)
    cache = KVCache(model.spec, 400, pool=pool)
    prompt = _tokens(70)
    rows, out = _decode(model, cache, prompt, 12, chunk=16)
    assert pool.dropped.any()                               # the local layers did drop rows
    expected = _fresh(model, prompt + out)
    assert np.all(np.isfinite(rows))
    assert np.allclose(np.array(rows), expected[len(prompt) - 1 :], atol=1e-5, rtol=0)
    assert out == [int(r.argmax()) for r in expected[len(prompt) - 1 : -1]]


def test_a_sliding_layer_holds_its_window_after_a_long_prompt(tmp_path):
    model = _model(tmp_path, GEMMA2)
    bs, window = 4, GEMMA2["sliding_window"]
    pool = KVPool(model.spec, 128, block_size=bs)
    cache = KVCache(model.spec, 500, pool=pool)
    prefill(model, _tokens(300), cache, chunk=64)
    model.forward([1], cache)
    held = blocks_for(cache.length, bs)
    assert pool.held_blocks(1) == held                      # the global layer keeps every block
    assert pool.held_blocks(0) <= -(-window // bs) + 1       # the local one its window, rounded to blocks
    local = pool.group_bytes[0]
    assert pool.nbytes == held * pool.block_bytes - (held - pool.held_blocks(0)) * local
    assert cache.nbytes == pool.nbytes


def test_dropped_rows_return_their_pages(tmp_path):
    model = _model(tmp_path, GEMMA2)                       # 2 kv heads x 32 rows x 16 floats: a page per block
    pool = KVPool(model.spec, 16, block_size=32)
    cache = KVCache(model.spec, 500, pool=pool)
    prefill(model, _tokens(200), cache, chunk=64)
    model.forward([1], cache)
    gone = [b for b in cache.table if pool.dropped[0, b]]
    assert gone == cache.table[: (200 - 12 + 1) // 32]      # all before the window of the last step (at 200)
    assert not np.any(pool.layers[0]["k"][gone]) and not np.any(pool.layers[0]["v"][gone])   # zero pages again
    assert np.all(np.any(pool.layers[1]["k"][gone], axis=(1, 2, 3)))     # the global layer's rows stay


def test_truncate_is_exact_within_a_step_and_recomputes_past_dropped_rows(tmp_path):
    model = _model(tmp_path, MISTRAL)
    cache = KVCache(model.spec, 400, pool=KVPool(model.spec, 64, block_size=4))
    tokens = _tokens(120, seed=1)
    prefill(model, tokens[:100], cache, chunk=16)
    base = cache.length
    model.forward(tokens[100:110], cache)                    # a step of ten (as a speculative draft is checked)
    assert cache.truncate(base + 3) == base + 3              # back within the step: exact
    assert cache.truncate(base) == base
    kept = cache.truncate(40)                                # far back: the window's rows there are gone
    assert kept < 40 and kept == cache.length
    logits = model.forward(tokens[kept:110], cache, all_logits=True)
    assert np.allclose(logits, _fresh(model, tokens[:110])[kept:], atol=1e-5, rtol=0)


def test_prefix_reuse_holds_only_whole_windows(tmp_path):
    model = _model(tmp_path, GEMMA2)
    pool = KVPool(model.spec, 96, block_size=4)
    first = KVCache(model.spec, 400, pool=pool)
    tokens = _tokens(150, seed=2)
    prefill(model, tokens[:120], first, chunk=16)
    model.forward(tokens[120:121], first)
    first.release()
    again = KVCache(model.spec, 400, pool=pool)
    held = again.adopt(tokens[:121] + [3])                   # the whole conversation: its last window is whole
    assert held == 120
    other = KVCache(model.spec, 400, pool=pool)
    part = other.adopt(tokens[:61])                          # cut where the local layer's rows are gone
    assert part < 60
    for cache, held_n, end in ((again, held, 122), (other, part, 61)):
        seq = (tokens[:121] + [3])[:end]
        logits = model.forward(seq[held_n:], cache, all_logits=True)
        assert np.allclose(logits, _fresh(model, seq)[held_n:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("overflow", ["slide", "retain"])
def test_overflow_never_evicts_into_a_dropped_window(overflow, tmp_path):
    model = _model(tmp_path, GEMMA2)
    cache = KVCache(model.spec, 48, pool=KVPool(model.spec, 32, block_size=4), overflow=overflow, recent_tokens=0)
    prompt = _tokens(40, seed=3)
    logits = prefill(model, prompt, cache, chunk=8)
    for _ in range(60):                                      # past the context: blocks evicted as the window moves
        _poison(cache.pool)
        if overflow == "retain":                             # the least attended block: one inside the window
            cache.heat[: cache.length] = 1e6
            cache.heat[max(0, cache.length - 8) : cache.length] = 0.0
        logits = model.forward([int(logits.argmax())], cache)[-1]
        assert np.all(np.isfinite(logits))
    assert cache.evicted > 0 and cache.pool.dropped.any()
    assert overflow == "slide" or cache.tokens[:4] == prompt[:4]    # retention kept the sinks


def _check_counts(pool: KVPool, caches: list[KVCache]) -> None:
    """The pool's per-block counts are the holders still attending; nothing they attend to is dropped."""
    want = np.zeros_like(pool.need)
    for cache in caches:
        for g, front in enumerate(cache._front):
            for b in cache.table[front:]:
                want[g, b] += 1
                assert not pool.dropped[g, b]
    assert np.array_equal(pool.need, want)


def test_random_steps_truncations_and_reuse_keep_counts_and_outputs(tmp_path):
    model = _model(tmp_path, GEMMA2)
    rng = np.random.default_rng(5)
    doc = _tokens(120, seed=4)
    pool = KVPool(model.spec, 160, block_size=4)
    caches = [KVCache(model.spec, 300, pool=pool) for _ in range(3)]
    reused = 0
    for _ in range(40):
        cache = caches[rng.integers(3)]
        op = rng.integers(4)
        if op == 0 or cache.length == 0:     # reuse another sequence's tokens or the document's, then run the rest
            other = caches[rng.integers(3)]
            head = list(other.tokens[: other.length]) if other.length and rng.integers(2) else \
                doc[: rng.integers(8, 120)]
            cache.release()
            prompt = head + _tokens(int(rng.integers(1, 6)), seed=int(rng.integers(99)))
            held = cache.adopt(prompt)
            reused += held
            prefill(model, prompt[held:], cache, chunk=int(rng.integers(3, 20)))
        elif op == 1:                                        # a step of a few tokens, rolled back in part
            base = cache.length
            model.forward(_tokens(int(rng.integers(1, 8)), seed=int(rng.integers(99))), cache)
            assert cache.truncate(base + int(rng.integers(0, cache.length - base + 1))) >= base
        elif op == 2:                                        # back anywhere: may hold less, then recompute
            target = int(rng.integers(0, cache.length + 1))
            kept = cache.truncate(target)
            assert kept <= target and kept == cache.length
        else:                                                # decode
            model.forward(_tokens(int(rng.integers(1, 4)), seed=int(rng.integers(99))), cache)
        _check_counts(pool, caches)
        _poison(pool)
        if cache.length:                                     # the next token's logits as a fresh run gives them
            tokens = list(cache.tokens[: cache.length])
            got = model.forward([7], cache)[-1]
            assert np.allclose(got, _fresh(model, tokens + [7])[-1], atol=1e-5, rtol=0)
            _check_counts(pool, caches)
    assert pool.dropped.any() and reused > 0
