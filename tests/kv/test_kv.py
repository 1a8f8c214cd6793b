"""The paged KV cache: kernels against plain numpy, prefix reuse, memory taken and returned, retention."""

from __future__ import annotations

import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.blocks.attention import attend, causal_mask
from engine.blocks.rope import Rotary
from engine.errors import ColibriError, GenerationError
from engine.kernels.attention import attend_latent, attend_paged
from engine.kv import KVCache, KVFullError, KVPool, choose_victim
from engine.kv.retention import _rotate_back
from engine.loader import load_model
from engine.spec import RopeSpec
from support.families import FAMILIES
from support.reference import build_checkpoint

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 31, 77, 2, 45, 120, 6, 18]


def _scatter(x: np.ndarray, block: int, rng, n_blocks: int, axis: int, table=None) -> tuple[np.ndarray, np.ndarray]:
    """Cut x along `axis` (positions) into blocks placed at random slots of a pool; (pool, table)."""
    s = x.shape[axis]
    n = -(-s // block)
    if table is None:
        table = rng.permutation(n_blocks)[:n].astype(np.int32)
    moved = np.moveaxis(x, axis, 0)                              # [S, ...]
    pool = rng.standard_normal((n_blocks, block, *moved.shape[1:])).astype(np.float32)   # garbage elsewhere
    for i, b in enumerate(table):
        rows = moved[i * block : (i + 1) * block]
        pool[b, : rows.shape[0]] = rows
    return np.moveaxis(pool, 1, axis + 1), table


@pytest.mark.parametrize("heads, kv_heads, window, block", [(8, 8, None, 4), (8, 2, None, 16), (6, 1, 5, 1), (4, 2, 3, 8)])
def test_paged_kernel_matches_numpy(heads, kv_heads, window, block):
    rng = np.random.default_rng(heads + kv_heads + block)
    t, start, d = 9, 14, 16
    end = start + t
    q = rng.standard_normal((t, heads, d)).astype(np.float32)
    k = rng.standard_normal((kv_heads, end, d)).astype(np.float32)
    v = rng.standard_normal((kv_heads, end, d)).astype(np.float32)
    positions = np.arange(start, end)
    kb, table = _scatter(k, block, rng, 40, axis=1)              # [NB, Hkv, B, D]
    vb, _ = _scatter(v, block, rng, 40, axis=1, table=table)
    ones = np.ones(kb.shape[:3], np.float32)
    expected = attend(q, k, v, causal_mask(positions, end, window), 0.25)
    got = attend_paged(q, kb, ones, vb, ones, table, positions, 0.25, window)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_paged_rows_are_the_same_alone_or_in_a_batch():
    rng = np.random.default_rng(0)
    kb = rng.standard_normal((8, 2, 16, 32)).astype(np.float32)
    vb = rng.standard_normal((8, 2, 16, 32)).astype(np.float32)
    ones = np.ones((8, 2, 16), np.float32)
    table = np.array([3, 0, 7, 5], np.int32)
    q = rng.standard_normal((20, 8, 32)).astype(np.float32)
    positions = np.arange(40, 60)
    batch = attend_paged(q, kb, ones, vb, ones, table, positions, 0.2)
    for t in (0, 7, 19):
        alone = attend_paged(q[t : t + 1], kb, ones, vb, ones, table, positions[t : t + 1], 0.2)
        assert np.array_equal(alone[0], batch[t])


def test_latent_kernel_matches_numpy():
    rng = np.random.default_rng(3)
    t, start, h, dn, dr, rank, dv, block = 5, 11, 4, 8, 6, 12, 10, 4
    end = start + t
    q_nope = rng.standard_normal((t, h, dn)).astype(np.float32)
    q_rot = rng.standard_normal((t, h, dr)).astype(np.float32)
    w_uk = rng.standard_normal((h, dn, rank)).astype(np.float32)
    w_uv = rng.standard_normal((h, dv, rank)).astype(np.float32)
    lat = rng.standard_normal((end, rank)).astype(np.float32)
    rot = rng.standard_normal((end, dr)).astype(np.float32)
    positions = np.arange(start, end)
    q_lat = np.einsum("thd,hdr->htr", q_nope, w_uk)
    scores = (q_lat @ lat.T + np.einsum("thd,sd->hts", q_rot, rot)) * 0.3 + causal_mask(positions, end, None)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected = np.einsum("hts,sr,hvr->thv", probs, lat, w_uv)
    lb, table = _scatter(lat, block, rng, 9, axis=0)
    rb, _ = _scatter(rot, block, rng, 9, axis=0, table=table)
    ones = np.ones(lb.shape[:2], np.float32)
    got = attend_latent(q_nope, q_rot, w_uk, w_uv, lb, ones, rb, ones, table, positions, 0.3)
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()


def test_kept_weights_are_each_rows_attention():
    rng = np.random.default_rng(1)
    kb = rng.standard_normal((4, 1, 8, 16)).astype(np.float32)
    ones = np.ones((4, 1, 8), np.float32)
    q = rng.standard_normal((3, 2, 16)).astype(np.float32)
    _, w = attend_paged(q, kb, ones, kb, ones, np.arange(4, dtype=np.int32), np.array([20, 25, 29]), 0.25, 4, keep=True)
    assert w.shape == (6, 30)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-5)
    assert np.all(w[0:2, 21:] == 0) and np.all(w[0:2, :17] == 0)   # window 4 at position 20: keys 17..20


def test_rotating_a_stored_key_moves_its_position():
    for interleaved in (False, True):
        rope = RopeSpec(dim=16, theta=10000.0, interleaved=interleaved)
        rotary = Rotary(rope)
        x = np.random.default_rng(2).standard_normal((3, 2, 24)).astype(np.float32)  # partial rotary: 16 of 24
        at = rotary.apply(x, *rotary.tables(np.array([40, 41, 42])))
        want = rotary.apply(x, *rotary.tables(np.array([24, 25, 26])))
        moved = at.copy()
        _rotate_back(moved, rope, -16)
        np.testing.assert_allclose(moved, want, atol=2e-5)


def test_victim_is_the_least_attended_block_between_sinks_and_the_recent_window():
    bs = 4
    scores = np.ones(8 * bs)
    scores[0:4] = 0.0        # block 0: the sinks, kept however little attention they draw
    scores[12:16] = 0.2      # block 3: the least attended of the middle
    scores[24:32] = 0.0      # blocks 6 and 7: the recent window, kept
    assert choose_victim(scores, 8, bs, sink_tokens=4, recent_tokens=8) == 3
    assert choose_victim(scores, 2, bs, sink_tokens=4, recent_tokens=4) is None


@pytest.fixture(scope="module", params=["llama", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def tiny(request, tmp_path_factory):
    """A 4-bit container of each attention kind: its kernels are bitwise row-invariant, so cached,
    shared and batched runs must give exactly the logits of a fresh one."""
    model_type, overrides = {"llama": ("llama", {}), **FAMILIES}[request.param]
    src = build_checkpoint(tmp_path_factory.mktemp(request.param), model_type, **overrides)
    return load_model(convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None))


def _decode(model, cache, prompt, steps=6) -> np.ndarray:
    rows = [model.forward(prompt, cache, all_logits=True)]
    for _ in range(steps):
        rows.append(model.forward([int(np.argmax(rows[-1][-1]))], cache))
    return np.concatenate(rows)


@pytest.mark.parametrize("block", [1, 4, 64])
def test_block_size_never_changes_the_logits(tiny, block):
    want = _decode(tiny.model, KVCache(tiny.spec, 64), PROMPT)
    pool = KVPool(tiny.spec, 200, block_size=block)
    pool.free.reverse()                      # hand out blocks in an order unlike positions
    got = _decode(tiny.model, KVCache(tiny.spec, 64, pool=pool), PROMPT)
    assert np.array_equal(got, want)


def test_prefix_reuse_gives_identical_logits_and_shares_blocks(tiny):
    pool = KVPool(tiny.spec, 32, block_size=4)
    first = KVCache(tiny.spec, 64, pool=pool)
    tiny.model.forward(PROMPT, first)
    question = PROMPT + [11, 12, 13]
    second = KVCache(tiny.spec, 64, pool=pool)
    held = second.adopt(question)
    assert held == 20                                   # five full blocks of the shared prefix
    assert all(pool.ref[b] == 2 for b in second.table)
    reused = tiny.model.forward(question[held:], second, all_logits=True)[-1]
    fresh = tiny.model.forward(question, KVCache(tiny.spec, 64), all_logits=True)[-1]
    assert np.array_equal(reused, fresh)
    assert pool.hits >= 5


def test_memory_is_taken_as_blocks_fill_and_returned(tiny):
    pool = KVPool(tiny.spec, 16, block_size=4, prefix_cache=False)
    cache = KVCache(tiny.spec, 64, pool=pool)
    assert pool.nbytes == 0
    tiny.model.forward(PROMPT[:5], cache)
    assert pool.nbytes == 2 * pool.block_bytes and cache.nbytes == 2 * pool.block_bytes
    tiny.model.forward(PROMPT[5:], cache)
    assert pool.nbytes == 5 * pool.block_bytes
    cache.release()
    assert pool.nbytes == 0 and pool.used_blocks == 0


def test_cached_prefixes_are_evicted_least_recently_used(tiny):
    pool = KVPool(tiny.spec, 6, block_size=4)
    a = KVCache(tiny.spec, 64, pool=pool)
    tiny.model.forward(PROMPT[:9], a)                   # 2 full blocks indexed, 3 held
    a.release()
    assert len(pool.cached) == 2 and pool.used_blocks == 0
    b = KVCache(tiny.spec, 64, pool=pool)
    tiny.model.forward(list(range(30, 54)), b)          # needs all 6 blocks: both cached prefixes evicted
    assert len(pool.cached) == 0 and not pool.index.keys() & set(a._digests)
    c = KVCache(tiny.spec, 64, pool=pool)
    with pytest.raises(KVFullError, match="KV cache is full.*--max-memory"):
        tiny.model.forward([1, 2], c)


def test_trimming_frees_the_oldest_cached_prefixes_down_to_a_limit_and_keeps_blocks_in_use(tiny):
    pool = KVPool(tiny.spec, 32, block_size=4)
    old, recent = KVCache(tiny.spec, 64, pool=pool), KVCache(tiny.spec, 64, pool=pool)
    tiny.model.forward(PROMPT[:8], old)                 # two full blocks, cached once released
    tiny.model.forward(list(range(30, 38)), recent)
    old.release()
    recent.release()
    live = KVCache(tiny.spec, 64, pool=pool)
    tiny.model.forward(list(range(60, 72)), live)       # three blocks in use
    assert len(pool.cached) == 4 and pool.nbytes == 7 * pool.block_bytes
    assert pool.trim_cached(5 * pool.block_bytes) == 2  # the first chat's prefix goes first
    assert pool.nbytes == 5 * pool.block_bytes and not pool.index.keys() & set(old._digests)
    assert set(recent._digests) <= pool.index.keys()
    assert pool.trim_cached(0) == 2 and pool.nbytes == 3 * pool.block_bytes == live.nbytes


def test_writing_after_truncating_into_a_shared_block_copies_it(tiny):
    pool = KVPool(tiny.spec, 32, block_size=4)
    a = KVCache(tiny.spec, 64, pool=pool)
    tiny.model.forward(PROMPT, a)
    b = KVCache(tiny.spec, 64, pool=pool)
    b.adopt(PROMPT + [1])
    b.truncate(10)                                      # into a shared block
    tiny.model.forward([100, 101], b)
    assert b.table[2] != a.table[2]
    again = KVCache(tiny.spec, 64, pool=pool)
    again.adopt(PROMPT + [1])
    got = tiny.model.forward([1], again)
    want = tiny.model.forward(PROMPT + [1], KVCache(tiny.spec, 64))
    assert np.array_equal(got, want)                    # a's blocks were not touched by b


def test_overflow_error_names_the_numbers_and_the_fix(tiny):
    cache = KVCache(tiny.spec, 16)
    with pytest.raises(GenerationError, match="reach 20 tokens but the context holds 16.*--overflow"):
        tiny.model.forward(PROMPT, cache)


@pytest.mark.parametrize("overflow, bits", [("slide", 32), ("retain", 32), ("slide", 16)])
def test_overflow_evicts_blocks_and_keeps_positions_inside_the_context(tiny, overflow, bits):
    pool = KVPool(tiny.spec, 16, block_size=4, bits=bits)
    cache = KVCache(tiny.spec, 16, pool=pool, overflow=overflow, sink_tokens=4, recent_tokens=4)
    stream = PROMPT + PROMPT[:8]                           # 28 tokens through a context of 16
    tiny.model.forward(stream[:12], cache)
    for t in stream[12:]:
        logits = tiny.model.forward([t], cache)
        assert np.isfinite(logits).all()
        assert cache.length <= 16
    assert cache.evicted == 12 and len(cache.tokens) == cache.length == 16
    if overflow == "retain":
        assert cache.tokens[:4] == stream[:4]              # the sinks stay
    else:
        assert cache.tokens == stream[12:]                 # the oldest blocks went first
    assert cache.tokens[-4:] == stream[-4:]
    assert pool.used_blocks == 4


def test_int8_kv_halves_memory_and_stays_close(tiny):
    exact = _decode(tiny.model, KVCache(tiny.spec, 64), PROMPT, steps=0)
    pool = KVPool(tiny.spec, 20, block_size=16, bits=8)
    got = _decode(tiny.model, KVCache(tiny.spec, 64, pool=pool), PROMPT, steps=0)
    per_row = np.abs(got - exact).max(axis=1) / np.abs(exact).max()
    assert np.median(per_row) <= 0.05       # a row whose routing flips may differ more (MoE)
    assert pool.block_bytes <= KVPool(tiny.spec, 1, block_size=16).block_bytes * 0.6 or pool.block_bytes == 4096


def test_fp16_kv_halves_memory_and_stays_close(tiny):
    exact = _decode(tiny.model, KVCache(tiny.spec, 64), PROMPT, steps=0)
    pool = KVPool(tiny.spec, 20, block_size=16, bits=16)
    got = _decode(tiny.model, KVCache(tiny.spec, 64, pool=pool), PROMPT, steps=0)
    assert pool.layers[0]["k"].dtype == np.uint16
    per_row = np.abs(got - exact).max(axis=1) / np.abs(exact).max()
    # 0.01 with float activations; the 4-bit weights' kernels round activations to 8 bits per block (rows16), and
    # a value that fp16 moves across a rounding step moves the output by a step: 0.012-0.019 measured
    assert 0 < np.median(per_row) <= 0.03
    full = KVPool(tiny.spec, 1, block_size=16).block_bytes
    assert pool.block_bytes < full * 0.6


def test_fp16_kernel_reads_the_rounded_rows():
    """The paged kernel on fp16 rows equals the numpy reference on the same rows rounded to fp16."""
    rng = np.random.default_rng(3)
    t, start, d, heads, kv_heads, block = 5, 11, 24, 4, 2, 4        # d: 16 lanes and a tail of 8
    end = start + t
    q = rng.standard_normal((t, heads, d)).astype(np.float32)
    k = rng.standard_normal((kv_heads, end, d)).astype(np.float32)
    v = rng.standard_normal((kv_heads, end, d)).astype(np.float32)
    positions = np.arange(start, end)
    kb, table = _scatter(k, block, rng, 40, axis=1)
    vb, _ = _scatter(v, block, rng, 40, axis=1, table=table)
    ones = np.ones(kb.shape[:3], np.float32)
    k16, v16 = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    expected = attend(q, k16, v16, causal_mask(positions, end, None), 0.25)
    got = attend_paged(q, kb.astype(np.float16).view(np.uint16), ones, vb.astype(np.float16).view(np.uint16), ones,
                       table, positions, 0.25, None)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_bad_settings_are_refused():
    with pytest.raises(ColibriError, match="power of two"):
        from engine.kv import check_kv_settings
        check_kv_settings(12, 32, "error")
    with pytest.raises(ColibriError, match="use 32 .* 16 .* or 8"):
        check_kv_settings(16, 4, "error")
    with pytest.raises(ColibriError, match="retain"):
        check_kv_settings(16, 32, "drop")
